"""Backward graphs that accept ``None`` for outputs nobody differentiated.

A model such as ``BertForMaskedLM(labels=...)`` returns both the loss and the logits. Eager autograd
only walks back from the loss, but AOTAutograd's single autograd node receives a gradient for every
output, so by default autograd materialises a zero tensor the size of the logits and the backward
graph adds it to the real gradient: on the DESIGN §7 model that is ~0.45 s of a 1.5 s step.

We switch materialisation off on our nodes (``grad_fn.materialize_grads = False``) and keep one
specialisation of the backward graph per pattern of absent gradients: an ``add`` whose operand is an
absent gradient becomes its other operand; any other use gets zeros sized from the run-time shapes.

The other way round, a custom Function's backward may return None for an input (PythonOps,
``fxtrain/pythonop/op.py``): eager's engine then passes no gradient on, and a parameter that no
other path reaches keeps ``.grad`` None (AdamW skips it; zeros it would decay). The backward op
must return zeros there; ``PythonOpSources`` finds, once per graph, the gradient outputs that
only PythonOp gradients reach, and each run turns those to None whose every PythonOp gradient was
such zeros this time (the op logs them: ``pythonop.op.log_absent_gradients``).
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from .shapes import ShapeSolver, value_info

logger = logging.getLogger("fxtrain")

_ADDS = (torch.ops.aten.add.Tensor,)


def values_read(gm: torch.fx.GraphModule) -> set:
    """The nodes whose fake values a graph kept without the others still needs: the placeholders
    (what a compile is traced with) and the adds with their operands (what the absent-gradient
    specialisation reads, ``_eliminate``). The cache's entries and the tier's worker both keep these."""
    keep = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            keep.add(n)
        elif n.op == "call_function" and n.target in _ADDS:
            keep.add(n)
            keep.update(a for a in n.args if isinstance(a, torch.fx.Node))
    return keep


def _python_op_backward() -> Any:
    import fxtrain.pythonop.op  # noqa: F401  (registers the op)
    return torch.ops.fxtrain.python_op_backward.default


_ACCEPT_NONE = {_python_op_backward()}


def _python_op_log() -> Any:
    from fxtrain.pythonop.op import log_absent_gradients
    return log_absent_gradients


_ALWAYS = None   # a value a gradient always reaches (a tangent), whatever the PythonOps return


def python_op_sources(gm: torch.fx.GraphModule) -> Dict[int, frozenset]:
    """Per output position of the backward graph ``gm`` that PythonOp gradients reach and no
    tangent does without one: the ``(key, k)`` gradient outputs of ``python_op_backward`` calls it
    depends on. Eager's rule, followed node by node: a value carries a gradient when any of its
    inputs does (a sum of two paths, an op's backward formula with one defined input), a value
    computed from saved forward values only carries none, a tangent always carries one, and a
    PythonOp's gradient output carries one unless the user's backward returned None (known only
    when it runs). An output whose sources all returned None is one eager leaves without a gradient.
    """
    op = _python_op_backward()
    reach: Dict[torch.fx.Node, Optional[frozenset]] = {}
    none: frozenset = frozenset()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            reach[n] = _ALWAYS if n.name.startswith("tangents") else none
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (list, tuple)) else (n.args[0],)
            found = {}
            for i, o in enumerate(outs):
                r = reach.get(o, none) if isinstance(o, torch.fx.Node) else none
                if r:   # not _ALWAYS (None), not empty
                    found[i] = r
            return found
        elif (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
              and n.args[0].target is op):
            reach[n] = frozenset({(n.args[0].args[0], n.args[1])})
        else:
            total: set = set()
            for a in n.all_input_nodes:
                r = reach.get(a, none)
                if r is _ALWAYS:
                    total = None  # type: ignore[assignment]
                    break
                total |= r
            reach[n] = _ALWAYS if total is None else frozenset(total)
    return {}


def _drop_absent(out: Any, sources: Dict[int, frozenset], absent: set, positions: Optional[Sequence[int]] = None) -> List[Any]:
    """``out`` with None at the positions whose every PythonOp gradient was absent (``positions``:
    the full graph's output position of each item, when ``out`` is a part of it)."""
    out = list(out)
    for j, o in enumerate(out):
        i = j if positions is None else positions[j]
        s = sources.get(i)
        if s is not None and o is not None and s <= absent:
            out[j] = None
    return out


def _eliminate(gm: torch.fx.GraphModule, absent: Sequence[int]) -> Tuple[torch.fx.GraphModule, List[int]]:
    """Copy of ``gm`` with absent tangents folded away where an add makes that exact.

    Returns the graph and the placeholder indices that still need materialised zeros.
    """
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    absent_nodes = {placeholders[i] for i in absent}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ADDS and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            for zero, other in ((a, b), (b, a)):
                if zero in absent_nodes and isinstance(other, torch.fx.Node):
                    ov, nv = value_info(other), value_info(node)
                    if (ov is not None and nv is not None and ov.shape is not None
                            and ov.shape == nv.shape and ov.dtype == nv.dtype):
                        env[node] = env[other]
                        break
            if node in env:
                continue
        if node.target in _ACCEPT_NONE:
            # A PythonOp's backward takes Tensor?[]: the absent gradient arrives as None, as in eager.
            env[node] = graph.node_copy(node, lambda n: None if n in absent_nodes else env[n])
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    new_gm = torch.fx.GraphModule(gm, graph)
    new_placeholders = [n for n in new_gm.graph.nodes if n.op == "placeholder"]
    still_used = [i for i in absent if new_placeholders[i].users]
    return new_gm, still_used


def _run_as_is(gm: torch.fx.GraphModule) -> Callable[[List[Any]], Any]:
    def run(args: List[Any]) -> Any:
        call_args = list(args)
        args.clear()
        return gm.forward(*call_args)
    return run


class AbsentGradBackward:
    """Backward callable: specialises ``gm`` per pattern of ``None`` tangents.

    ``compile(graph)`` gives the executor's boxed callable for the graph and for each specialisation
    (compiled when a pattern first occurs); by default the graph runs as it is.
    """

    def __init__(self, gm: torch.fx.GraphModule,
                 compile: Callable[[torch.fx.GraphModule], Callable[[List[Any]], Any]] = _run_as_is) -> None:
        self.gm = gm
        self.compile = compile
        self._full: Optional[Callable[[List[Any]], Any]] = None
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tangents = [i for i, n in enumerate(self.placeholders) if n.name.startswith("tangents")]
        self.solver = ShapeSolver(self.placeholders)
        # None is only safe to accept where zeros can be rebuilt if a specialisation needs them.
        infos = {i: value_info(self.placeholders[i]) for i in self.tangents}
        self.accepts_none = all(info is not None and info.shape is not None and self.solver.can_solve(info.shape)
                                for info in infos.values())
        self.variants: Dict[Tuple[int, ...], Tuple[Callable[..., Any], List[int]]] = {}
        # (absent tangents, weight outputs) -> the graph cut into B and W (runtime/weight_split.py)
        self.splits: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], Tuple[Any, List[int]]] = {}
        # Outputs only PythonOp gradients reach: None after a run where none of those came.
        self.sources = python_op_sources(gm)

    def _variant(self, absent: Tuple[int, ...]) -> Tuple[Callable[..., Any], List[int], Optional[List[int]]]:
        """The specialisation for ``absent``: its callable, the absent gradients it still reads
        (zeros), and the inputs it takes (None: all). The absent gradients it no longer reads leave
        its signature: compiled code checks every input it was compiled for (inductor's CUDA
        wrapper asserts each one's alignment, then its size and stride: a None or a stand-in fails;
        seen with executor="auto" on an H200)."""
        if absent not in self.variants:
            gm, needs_zeros = _eliminate(self.gm, absent)
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            dropped = {i for i in absent if not placeholders[i].users}
            for i in dropped:
                gm.graph.erase_node(placeholders[i])
            gm.recompile()
            logger.debug("backward specialised for %d absent output gradient(s); %d still materialised",
                         len(absent), len(needs_zeros))
            keep = [i for i in range(len(placeholders)) if i not in dropped] if dropped else None
            self.variants[absent] = (self.compile(gm), needs_zeros, keep)
        return self.variants[absent]

    def compile_full(self) -> Callable[[List[Any]], Any]:
        if self._full is None:
            self._full = self.compile(self.gm)
        return self._full

    def compile_ahead(self) -> None:
        """Compile, before the first backward, the pattern a training loop almost always gives:
        every output's gradient absent but the one-element ones (``loss.backward()`` on a model that
        also returns its logits), else the full backward (every output is a loss, or none is, or
        absent gradients reach this node as zeros: not ``accepts_none``). Other patterns compile when they first occur: an executor that compiles ahead
        keeps code generation off the training loop's path, and off autograd's device thread, which
        runs a CUDA backward.

        One pattern, not the full backward beside it: a loop whose loss is one of several outputs
        never runs the full one, and its compile cost as much as the pattern's (dense GPT-2 tiny,
        logits returned, ``executor="inductor"``: first step 51.3 / 43.5 s compiling both, 41.7 /
        37.1 s compiling the pattern only; two alternating rounds on a 2-core CPU)."""
        vals = {i: self.placeholders[i].meta.get("val") for i in self.tangents}
        absent = tuple(i for i, v in vals.items() if not (isinstance(v, torch.Tensor) and v.numel() == 1))
        if self.accepts_none and absent and len(absent) < len(self.tangents):
            self._variant(absent)
        else:
            self.compile_full()

    def __call__(self, args: List[Any]) -> Any:
        """Boxed call: the list is handed on and cleared, so values die after their last use."""
        if not self.sources:
            return self._call(args)
        absent: set = set()
        log = _python_op_log()
        previous = log(absent)
        try:
            out = self._call(args)
        finally:
            log(previous)
        return _drop_absent(out, self.sources, absent)

    def _call(self, args: List[Any]) -> Any:
        absent = tuple(i for i in self.tangents if args[i] is None)
        if not absent:
            run = self.compile_full()
        else:
            run, needs_zeros, keep = self._variant(absent)
            self._materialize(args, needs_zeros)
            if keep is not None:
                kept = [args[i] for i in keep]
                args.clear()
                return run(kept)
        return run(args)

    def _materialize(self, args: List[Any], needs_zeros: List[int]) -> None:
        for i in needs_zeros:
            info = value_info(self.placeholders[i])
            assert info is not None and info.shape is not None
            args[i] = torch.zeros(self.solver.solve(info.shape, args), dtype=info.dtype, device=info.device)

    def split_call(self, args: List[Any], weights: Tuple[int, ...]) -> Tuple[List[Any], Optional[Callable[[], List[Any]]]]:
        """Boxed call of B only: every output's gradient (None at ``weights``, the parameter
        gradients) and W, a callable that returns those (``runtime/weight_split.py``). B and W are
        cut from the same specialisation the whole call would run, so their sum is that call.
        A graph that cannot be cut runs whole: all gradients, and None for W."""
        from .weight_split import CompiledSplit, NotSplittable, split_backward
        absent = tuple(i for i in self.tangents if args[i] is None)
        key = (absent, weights)
        if key not in self.splits:
            gm, needs_zeros = _eliminate(self.gm, absent) if absent else (self.gm, [])
            try:
                parts = split_backward(gm, weights)
            except NotSplittable as e:
                logger.info("backward not split into input and weight parts: %s", e)
                self.splits[key] = (None, needs_zeros)
            else:
                logger.debug("backward split for %d weight gradient(s): B %d nodes, W %d nodes, %d carried",
                             len(weights), parts.input_nodes, parts.weight_nodes, parts.n_carried)
                self.splits[key] = (CompiledSplit(parts, self.compile), needs_zeros)
        compiled, needs_zeros = self.splits[key]
        if compiled is None:
            return list(self(args)), None
        self._materialize(args, needs_zeros)
        if not self.sources:
            return compiled(args)
        # The PythonOps of either part may give no gradient: each part's outputs are checked
        # against what both parts' runs logged so far.
        seen: set = set()
        log = _python_op_log()
        previous = log(seen)
        try:
            grads, run_weights = compiled(args)
        finally:
            log(previous)
        grads = _drop_absent(grads, self.sources, seen)
        sources, positions = self.sources, compiled.split.weight_outputs

        def run_checked_weights() -> List[Any]:
            before = log(seen)
            try:
                weights = run_weights()
            finally:
                log(before)
            return _drop_absent(weights, sources, seen, positions)
        return grads, run_checked_weights

    def boxed(self) -> Callable[[List[Any]], Any]:
        def run(args: List[Any]) -> Any:
            return self(args)
        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def release_materialization(outputs: Any) -> None:
    """Let our AOT nodes receive ``None`` for outputs that get no gradient (see module docstring)."""
    from .deferred import DeferredTensor
    stack = [outputs]
    seen = set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if isinstance(x, DeferredTensor):
                continue  # reading its grad_fn would compute it; its inputs are outputs seen here
            fn = x.grad_fn
            for _ in range(3):  # outputs AOT regenerates as views hang one or two nodes below
                if fn is None or id(fn) in seen:
                    break
                seen.add(id(fn))
                fwd = getattr(type(fn), "_forward_cls", None)
                accepts = getattr(getattr(fwd, "compiled_fw", None), "fxtrain_accepts_none", None)
                if accepts is not None and accepts():
                    fn.materialize_grads = False
                    break
                nxt = fn.next_functions
                fn = nxt[0][0] if len(nxt) == 1 else None
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "to_tuple"):
            stack.extend(x.to_tuple())
