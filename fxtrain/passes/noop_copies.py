"""Aten graph pass: drop the copies eager PyTorch does not make.

A captured step runs ops eager never dispatches. Counted on BERT-base MLM under bf16 autocast (one
step of the eager executor, passes on): 25 ``clone``s in the forward, one per ``Dropout(p=0)``
(eager's ``dropout`` returns its input when ``p == 0``; the decomposition AOTAutograd traces with
clones it), 24 repeated casts (autocast casts the input of each of Q, K and V: three ``_to_copy`` of
one tensor), and 36 ``slice_backward``s in the backward (a zero fill and a copy each) from the
attention pass's whole-width ``narrow`` of Q, K and V (``passes/varlen.py`` no longer makes it; a
model's own ``x[:, :n]`` of the whole width is the same). On a GPU each is a kernel launch and a pass
over the tensor: ~120 of the eager executor's ~1,200 kernels per step there.

Dropped, each only where no value can differ:

- ``clone(x)`` (and ``slice_backward`` over the whole tensor, which is one) when neither the copy
  nor ``x`` is ever written in place, ``x`` is not a view (its base could then be kept alive, and be
  written through another view) nor a graph input (the runtime writes a buffer's update back after
  the forward, which would change what a backward saving ``x`` instead of the copy reads), the
  copy's strides are ``x``'s, and the copy is not a graph output (an output aliasing another value
  would change what a caller's in-place op reaches);
- ``slice(x, dim, 0, end)`` that keeps the whole dim, and ``detach(x)``: views, no kernel, but an
  op dispatched each (the joint graph's backward is explicit: a detach there stops no gradient;
  BERT-base's graphs held 50);
- a dtype cast of a value already cast the same way, while that first cast is still read later in
  the step (Q's, K's and V's input casts are all read by the weights' gradients in the backward), so
  no tensor lives longer than one of the two did and the step's peak cannot grow; with the same
  conditions on in-place writes and outputs. The partitioner then saves one cast, not three.

Runs on the joint graph before the partitioner cuts it (``capture/aot.py``): one pass sees both
directions, the joint's outputs are the caller's values and the gradients (never the saved ones),
and it is functional (the only in-place writes are input mutations, which the pass respects). A
code generator (inductor) removes all three itself; the eager executor runs the graph as given.
"""
from __future__ import annotations

import operator
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx
from torch.fx import Node

from ..runtime.step import PassReport
from .rows import _same

NAME = "noop_copies"
aten = torch.ops.aten
_COPIES = {aten.clone.default}
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _schema(node: Node) -> Optional[Any]:
    target = node.target
    return getattr(target, "_schema", None) if node.op == "call_function" else None


def _aliases_input(node: Node) -> bool:
    """``node``'s result is (a view of, or an in-place update of) its first argument."""
    schema = _schema(node)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and bool(schema.arguments) and schema.arguments[0].alias_info is not None


def _base(node: Any) -> Any:
    """The tensor whose memory ``node`` is: through views, in-place results and getitems of them."""
    while isinstance(node, Node):
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node) \
                and _aliases_input(node.args[0]):
            node = node.args[0].args[0]
        elif _aliases_input(node) and isinstance(node.args[0], Node):
            node = node.args[0]
        else:
            break
    return node


def _written(graph: torch.fx.Graph) -> Set[Node]:
    """Bases some op writes in place (``copy_``, ``index_put_``, ``mul_``, an ``out=`` argument...)."""
    bases: Set[Node] = set()
    for node in graph.nodes:
        schema = _schema(node)
        if schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(v, Node):
                    bases.add(_base(v))
    return bases


def _outputs(graph: torch.fx.Graph) -> Tuple[Set[Node], Set[Node]]:
    """(the graph's outputs, their bases)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    found: Set[Node] = set()
    torch.fx.map_arg(out.args, found.add)
    return found, {_base(n) for n in found}


def _val(node: Any) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim() \
        and all(_same(x, y) for x, y in zip(a.shape, b.shape)) \
        and all(_same(x, y) for x, y, n in zip(a.stride(), b.stride(), a.shape) if not _same(n, 1))


def _whole_slice(node: Node) -> bool:
    """``slice(x, dim, start, end, step)`` of ``x``'s whole ``dim``."""
    v = _val(node.args[0])
    dim, start, end, step = (node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
                             for i, (name, default) in enumerate((("dim", 0), ("start", None), ("end", None),
                                                                  ("step", 1)), start=1))
    # Plain ints only: comparing a symbolic start or step would guard on it.
    if v is None or not isinstance(dim, int) or not isinstance(step, int) or step != 1 \
            or not (start is None or (isinstance(start, int) and start == 0)):
        return False
    size = v.shape[dim]
    return end is None or (isinstance(end, int) and (end >= sys.maxsize or (isinstance(size, int) and end >= size))) \
        or _same(end, size)


def _whole_slice_backward(node: Node) -> bool:
    """``slice_backward(grad, sizes, dim, 0, end, 1)`` whose slice was the whole dim: a copy of ``grad``."""
    _, sizes, dim, start, end, step = node.args[:6]
    return isinstance(step, int) and step == 1 and isinstance(start, int) and start == 0 and isinstance(dim, int) and \
        ((isinstance(end, int) and end >= sys.maxsize) or _same(end, sizes[dim]))


def _cast_key(node: Node) -> Optional[Tuple[Any, ...]]:
    key = (node.target, node.args, tuple(sorted(node.kwargs.items(), key=lambda kv: kv[0])))
    try:
        hash(key)
    except TypeError:   # a list argument
        return None
    return key


def noop_copies(joint: torch.fx.GraphModule) -> PassReport:
    """On the joint graph, before the partitioner: the forward's outputs there are the caller's and
    the gradients, never the saved values, and merged casts are saved once."""
    graph = joint.graph
    written = _written(graph)
    returned, outputs = _outputs(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_use: Dict[Node, int] = {n: max((order[u] for u in n.users), default=order[n]) for n in graph.nodes}
    counts = {"clone": 0, "slice": 0, "cast": 0, "detach": 0}
    first_cast: Dict[Tuple[Any, ...], Node] = {}
    doomed: List[Node] = []

    def replace(node: Node, by: Node, kind: str) -> None:
        node.replace_all_uses_with(by)
        last_use[by] = max(last_use[by], last_use[node])
        doomed.append(node)
        counts[kind] += 1

    def free_copy(copy: Node, source: Any) -> bool:
        """``copy`` may be ``source`` itself: nothing writes either, and no output is the copy."""
        return isinstance(source, Node) and source.op != "placeholder" and _base(source) is source \
            and source not in written and copy not in written and copy not in outputs

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _COPIES or (node.target is aten.slice_backward.default and _whole_slice_backward(node)):
            source, cv, sv = node.args[0], _val(node), _val(node.args[0])
            if cv is not None and sv is not None and free_copy(node, source) and _same_layout(cv, sv):
                replace(node, source, "clone")
        elif node.target is aten.slice.Tensor and _whole_slice(node) and node not in returned \
                and _base(node) not in written:
            replace(node, node.args[0], "slice")
        elif node.target is aten.detach.default and node not in returned:
            replace(node, node.args[0], "detach")
        elif node.target in _CASTS and isinstance(node.args[0], Node):
            key = _cast_key(node)
            if key is None:
                continue
            first = first_cast.get(key)
            alive = first is not None and (last_use[first] > order[node] or first in returned)
            if alive and _base(node.args[0]) not in written and first not in written and node not in written \
                    and node not in outputs:
                replace(node, first, "cast")
            elif not alive:
                first_cast[key] = node
    if not doomed:
        return PassReport(NAME, False, "no copy eager does not make")
    for node in reversed(doomed):
        graph.erase_node(node)
    graph.lint()
    joint.recompile()
    said = [f"{counts['clone']} copies of unwritten tensors", f"{counts['slice']} whole-tensor slices",
            f"{counts['cast']} repeated casts", f"{counts['detach']} detaches"]
    return PassReport(NAME, True, "dropped " + ", ".join(s for s in said if not s.startswith("0 ")))
