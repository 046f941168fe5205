"""Per-batch conditions a rewrite relies on, checked before the rewritten graph runs.

Padding elimination computes only real tokens, so a label or a kept row on a padding position would
read a value the rewritten graph never computed. Whether a batch has one is known only from its
values. Asserting inside the graph would stop training in the middle of a step; instead the pass
writes each condition into a small graph of its own (a few integer ops over ``[batch, seq]`` inputs)
that the runtime evaluates before the step (``runtime/dense_route.py``), and a batch that fails it
runs through the graph captured before the passes: eager's numbers, never an exception.

The same graph counts the rows each selection of the passes keeps (``counted_index``), the real
tokens of each sequence where attention runs sequence by sequence and reads the document-start
flags of packed rows where it runs document by document (``host_numbers``):
conditions and counts reach the host in one transfer, the step's only device-to-host synchronisation, and the
selections in the step are sized by those counts (``runtime/host_counts.py``) instead of syncing
once per ``nonzero``.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from ..runtime.dense_route import BatchGuard
from ..runtime.host_counts import HOST_COUNT, HOST_DOCUMENT_LENGTHS, HOST_ROW_LENGTHS, new_slot
from ..runtime.step import Plans

Node = torch.fx.Node
_INPLACE_OPERATORS = {getattr(operator, n) for n in ("iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
                                                     "imod", "imul", "ior", "ipow", "irshift", "isub",
                                                     "itruediv", "ixor")}


class GuardBuilder:
    """Builds the guard graph: same inputs as the captured graph; out, one int64 vector (a 0/1 per
    condition, a row count per selection, then per ``row_counts`` slot its length and its numbers).
    One builder per capture: ``store`` keeps it in the capture's ``Plans``, where a later pass finds
    it (``GuardBuilder.of``) and adds to the same guard."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.graph = torch.fx.Graph()
        self.env: Dict[Node, Node] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
                self.env[node].meta = dict(node.meta)
        self.conditions: List[Tuple[Node, str]] = []
        self.counts: List[Tuple[Node, int]] = []       # (0-d int64 node of the guard graph, slot)
        self.vectors: List[Tuple[Node, int]] = []      # (1-d int64 node of the guard graph, slot)
        self.row_slots: Dict[Any, int] = {}            # row_counts' bool node (or ("flags", node)) -> its slot
        self.selections: Dict[Node, Node] = {}         # counted_index's index node -> its bool mask
        self._tail: List[Node] = []                    # what store() added (redone by a later store)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, plans: Plans) -> "GuardBuilder":
        """The builder of this capture's guard: the one an earlier pass stored in ``plans``, else a
        new one (which ``store`` puts there)."""
        builder = plans.guard_builder
        return builder if builder is not None and builder.gm is gm else cls(gm)

    def node(self, source: Node) -> Optional[Node]:
        """``source`` (a node of the captured graph) in the guard graph, with what it is made from.

        None when its computation is not a pure function of the inputs (an in-place op, a module
        call): copying that into the guard would run it twice.
        """
        if source in self.env:
            return self.env[source]
        needed, stack = set(), [source]
        while stack:
            n = stack.pop()
            if n in needed or n in self.env:
                continue
            if not _pure(n):
                return None
            needed.add(n)
            stack.extend(n.all_input_nodes)
        for n in self.gm.graph.nodes:
            if n in needed:
                self.env[n] = self.graph.node_copy(n, lambda a: self.env[a])
        return self.env[source]

    def call(self, target: Any, *args: Any, method: bool = False) -> Node:
        return (self.graph.call_method if method else self.graph.call_function)(target, args)

    def require(self, condition: Node, reason: str) -> None:
        """``condition``: a 0-d bool node of the guard graph that must hold for the rewrite to be exact."""
        self.conditions.append((condition, reason))

    def count(self, valid: Node) -> int:
        """Count ``valid`` (a bool node of the guard graph) for every batch: the slot its number is
        left under before the step (``runtime/host_counts.py``)."""
        slot = new_slot()
        self.counts.append((self.graph.call_method("sum", (valid,)), slot))
        return slot

    def row_counts(self, valid: Node) -> int:
        """Count ``valid`` (a 2-d bool node of the guard graph) along dim 1 for every batch: the slot
        its per-row numbers are left under before the step. One slot per ``valid``: every attention
        of a model reads the same lengths."""
        if valid not in self.row_slots:
            slot = new_slot()
            self.vectors.append((self.graph.call_method("sum", (valid, 1)), slot))
            self.row_slots[valid] = slot
        return self.row_slots[valid]

    def flags(self, valid: Node) -> int:
        """Read ``valid`` (a bool node of the guard graph) itself, flattened to 0/1, for every batch:
        the slot its values are left under. Fixed-size, so a varying number of events (documents
        of a packed row) costs no shape of its own; one slot per ``valid``."""
        key = ("flags", valid)
        if key not in self.row_slots:
            slot = new_slot()
            flat = self.graph.call_method("flatten", (self.graph.call_method("long", (valid,)),))
            self.vectors.append((flat, slot))
            self.row_slots[key] = slot
        return self.row_slots[key]

    def store(self, plans: Plans) -> None:
        """Hand the guard to the runtime through the capture's plans (nothing if it checks and counts
        nothing), and keep this builder there: a later pass of the capture may add to it and store
        again, replacing ``plans.guard`` with one that checks and counts more."""
        if not self.conditions and not self.counts and not self.vectors:
            return
        for node in reversed(self._tail):
            self.graph.erase_node(node)
        nodes = len(self.graph.nodes)
        # One int64 vector, conditions (0/1) then counts: read to the host in one transfer.
        values = [self.graph.call_method("long", (c,)) for c, _ in self.conditions] + [n for n, _ in self.counts]
        pieces = [self.graph.call_function(torch.stack, (values,))] if values else []
        for vector, _ in self.vectors:  # its length first: the batch size is the batch's own
            size = self.graph.call_method("size", (vector, 0))
            pieces += [self.graph.call_method("new_full", (vector, (1,), size)), vector]
        stacked = pieces[0] if len(pieces) == 1 else self.graph.call_function(torch.cat, (pieces,))
        self.graph.output(stacked)
        self._tail = list(self.graph.nodes)[nodes:]
        check = torch.fx.GraphModule(self.gm, _deduplicated(self.graph))
        plans.guard = BatchGuard(check, [r for _, r in self.conditions], [slot for _, slot in self.counts],
                                 [slot for _, slot in self.vectors])
        plans.guard_builder = self


def counted_index(gm: torch.fx.GraphModule, plans: Plans, valid: Node) -> Node:
    """``nonzero(valid).view(-1)`` for a 1-d bool node ``valid`` of ``gm``, inserted at the graph's
    insertion point, sized by a count the batch guard reads ahead (no synchronisation of its own).
    Where the guard cannot compute ``valid`` (an impure input), a plain ``nonzero``."""
    graph = gm.graph
    builder = GuardBuilder.of(gm, plans)
    g_valid = builder.node(valid)
    if g_valid is None:
        return graph.call_method("view", (graph.call_function(torch.nonzero, (valid,)), -1))
    rows = graph.call_function(HOST_COUNT, (valid, builder.count(g_valid)))
    index = graph.call_method("view", (graph.call_function(torch.nonzero_static, (valid,), {"size": rows}), -1))
    builder.selections[index] = valid
    builder.store(plans)
    return index


def host_numbers(gm: torch.fx.GraphModule, plans: Plans, flags: Node, op: Any) -> Node:
    """A node of ``gm`` (at its insertion point) holding on the host what ``op`` makes of ``flags``, a
    ``[batch, seq]`` bool node: ``HOST_ROW_LENGTHS``, ``flags.sum(1)`` (each sequence's real tokens);
    ``HOST_DOCUMENT_LENGTHS``, the lengths of the documents whose first tokens ``flags`` marks
    (``host_counts.document_lengths``). Read ahead by the batch guard with its other numbers (no
    synchronisation of its own); where the guard cannot compute ``flags``, the op reads it itself
    (one synchronisation)."""
    builder = GuardBuilder.of(gm, plans)
    g_flags = builder.node(flags)
    read_ahead = builder.row_counts if op is HOST_ROW_LENGTHS else builder.flags
    slot = read_ahead(g_flags) if g_flags is not None else new_slot()
    builder.store(plans)
    return gm.graph.call_function(op, (flags, slot))


def _deduplicated(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` computing each thing once: a node with the op, target and arguments of
    an earlier one is that one. Models recompute what the guard reads, and each pass adds its own
    reading of it (BERT's guard made ``attention_mask != 0`` three times: a launch each on a GPU,
    and a kernel each step on any device). Random ops stay apart (``Node.is_impure``); a node whose
    arguments cannot be keyed is copied as it is. (The builder keeps its own graph whole: a later
    pass's ``node`` still maps the captured graph's nodes onto it.)"""
    new = torch.fx.Graph()
    env: Dict[Node, Node] = {}
    made: Dict[Tuple[Any, ...], Node] = {}
    for node in graph.nodes:
        key = None
        if node.op in ("call_function", "call_method") and not node.is_impure():
            key = (node.op, node.target, _hashable(torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)))
            try:
                hash(key)
            except TypeError:
                key = None
        if key is not None and key in made:
            env[node] = made[key]
            continue
        env[node] = new.node_copy(node, env.__getitem__)
        if key is not None:
            made[key] = env[node]
    return new


def _hashable(value: Any) -> Any:
    """Node arguments with their lists, tuples, dicts and slices as tuples, to key them."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _hashable(value.start), _hashable(value.stop), _hashable(value.step))
    return value


def _pure(node: Node) -> bool:
    if node.op == "placeholder":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and (node.target in _INPLACE_OPERATORS
                                       or node.target in (HOST_COUNT, HOST_ROW_LENGTHS, HOST_DOCUMENT_LENGTHS)):
        return False  # HOST_COUNT, HOST_ROW_LENGTHS: the guard itself leaves its numbers; it must not consume them
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        return True  # operator.and_, operator.or_: named like in-place methods, but pure (the i* ones are above)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return not (name.endswith("_") and not name.endswith("__"))
