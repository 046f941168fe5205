"""Zero-bubble backward: one aten backward graph cut into B (input gradients) and W (weight gradients).

Zero-bubble pipeline schedules run a stage's backward in two steps: B computes the gradients of
the stage's inputs (what the previous stage waits for) and W, later, the gradients of its
parameters (which nobody waits for, so W fills the schedule's bubbles). torch's own split
(``stage_backward_input`` / ``stage_backward_weight``) walks the autograd graph and calls
``torch.autograd.grad`` twice; through a custom ``autograd.Function`` that yields no weight
gradient (pytorch#166577), and a parameter reached from two places is counted twice
(pytorch#180952). fxtrain has the stage's backward as one aten graph, so it cuts the graph itself:

- **B** is every node the input gradients need (their backward slice). A node several outputs
  share (the gradient flowing into a linear layer, a PythonOp's backward) is computed here once.
- **W** is every other node: what only parameter gradients need (``mm(grad_out.T, x)``, bias
  sums, the tied embedding's summed gradient). W reads the saved tensors it needs and, as extra
  outputs of B, the B values it needs ("carried"), so nothing is computed twice.
- A PythonOp (a custom Function kept opaque) is one ``python_op_backward`` node returning all its
  input gradients: when B needs any of them the node runs in B (the user's backward runs once) and
  its weight-gradient outputs are carried to W like any other B value; when only weight
  gradients need it, it runs in W. Either way its result is used by both parts, never recomputed.

The sum of B and W is the graph's backward exactly: the same nodes run on the same values, only
in two calls. A parameter the stage reads twice (tied weights) is one graph input, so its one
gradient output is already the sum of both uses; W hands it to the parameter's own
``AccumulateGrad`` node through autograd's engine (torch's accumulation, hooks included), once.

Use: inside ``with defer_weight_gradients(params) as pending:``, a backward through fxtrain's graph
runtime (``runtime/replay.py``) runs only B for these parameters and queues W; ``pending.run()``
runs the queued W parts. Outside the context nothing changes.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx

from ..errors import Error
from ..graph_walk import ancestors


@dataclass
class BackwardSplit:
    """A backward graph cut in two (see the module docstring).

    ``input_graph`` takes the backward graph's own arguments and returns the gradients at
    ``input_outputs`` (positions in the full graph's output) followed by the ``carried`` values;
    ``weight_graph`` takes the full graph's arguments at ``weight_reads`` followed by the carried
    values, and returns the gradients at ``weight_outputs``.
    """

    input_graph: torch.fx.GraphModule
    weight_graph: torch.fx.GraphModule
    n_outputs: int
    input_outputs: Tuple[int, ...]
    weight_outputs: Tuple[int, ...]
    weight_reads: Tuple[int, ...]
    n_carried: int
    input_nodes: int        # compute nodes in each part (reports, tests)
    weight_nodes: int


class NotSplittable(Error):
    """The graph updates a value in place across the cut: it runs whole (exact, not split)."""


def _mutated_args(node: torch.fx.Node) -> List[torch.fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def split_backward(gm: torch.fx.GraphModule, weight_outputs: Iterable[int]) -> BackwardSplit:
    """Cut ``gm`` (an aten backward graph) so that the outputs at ``weight_outputs`` come from W."""
    weights = tuple(sorted(set(weight_outputs)))
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in reversed(nodes) if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    inputs = tuple(i for i in range(len(outs)) if i not in weights)

    # B: the backward slice of the input gradients.
    in_b = {n for n in ancestors(outs[i] for i in inputs if isinstance(outs[i], torch.fx.Node))
            if n.op != "placeholder"}
    # A node returning several values (a PythonOp's backward) hands them out through getitem: those
    # go with it, so only tensors cross from B to W.
    for n in [n for n in nodes if n in in_b and isinstance(n.meta.get("val"), (list, tuple))]:
        in_b.update(u for u in n.users if u.op == "call_function" and u.target is operator.getitem)
    in_w = [n for n in nodes if n.op not in ("placeholder", "output") and n not in in_b]
    w_set = set(in_w)
    # AOTAutograd's graphs are functional; fxtrain's backward passes update only tensors they just
    # made (index_put_ into a fresh gradient). An update whose value is read on both sides of the
    # cut would be seen in another order than the whole graph's: refuse the cut (the caller runs
    # the whole backward instead, exact but not split).
    input_roots = {outs[i] for i in inputs if isinstance(outs[i], torch.fx.Node)}
    for n in nodes:
        for m in _mutated_args(n):
            side = n in w_set
            readers = [u for u in m.users if u.op != "output"] + ([m] if m.op != "placeholder" else [])
            if any((r in w_set) != side for r in readers) or (side and m in input_roots):
                raise NotSplittable(f"{n.name} updates {m.name} in place, and {m.name} is read on both "
                                    f"sides of the input/weight cut")
    w_roots = [outs[i] for i in weights if isinstance(outs[i], torch.fx.Node)]

    def read_by_w(n: torch.fx.Node) -> bool:
        return any(u in w_set for u in n.users) or n in w_roots

    carried = [n for n in nodes if n in in_b and read_by_w(n)]
    reads = [i for i, p in enumerate(placeholders) if read_by_w(p)]

    # B: same arguments as the full graph.
    b_graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" or n in in_b:
            env[n] = b_graph.node_copy(n, lambda a: env[a])
    b_graph.output(tuple(env[outs[i]] if isinstance(outs[i], torch.fx.Node) else outs[i] for i in inputs)
                   + tuple(env[n] for n in carried))

    # W: the saved values it reads, then the carried ones, as placeholders.
    w_graph = torch.fx.Graph()
    wenv: Dict[torch.fx.Node, torch.fx.Node] = {}
    for i in reads:
        p = placeholders[i]
        wenv[p] = w_graph.placeholder(p.name)
        wenv[p].meta = dict(p.meta)
    for n in carried:
        wenv[n] = w_graph.placeholder(f"carried_{n.name}")
        wenv[n].meta = dict(n.meta)
    for n in in_w:
        wenv[n] = w_graph.node_copy(n, lambda a: wenv[a])
    w_graph.output(tuple(wenv[outs[i]] if isinstance(outs[i], torch.fx.Node) else outs[i] for i in weights))
    b_graph.lint()
    w_graph.lint()
    return BackwardSplit(
        input_graph=torch.fx.GraphModule(gm, b_graph), weight_graph=torch.fx.GraphModule(gm, w_graph),
        n_outputs=len(outs), input_outputs=inputs, weight_outputs=weights, weight_reads=tuple(reads),
        n_carried=len(carried), input_nodes=len(in_b), weight_nodes=len(in_w))


class CompiledSplit:
    """A ``BackwardSplit`` with both parts compiled by the executor (boxed callables)."""

    def __init__(self, split: BackwardSplit, compile: Callable[[torch.fx.GraphModule], Callable[[List[Any]], Any]]) -> None:
        self.split = split
        self.input_part = compile(split.input_graph)
        self.weight_part = compile(split.weight_graph)

    def __call__(self, args: List[Any]) -> Tuple[List[Any], Callable[[], List[Any]]]:
        """Run B on ``args`` (boxed: the list is cleared); return every output position's gradient
        (None where W will give it) and W as a callable returning the weight gradients in order."""
        s = self.split
        kept = [args[i] for i in s.weight_reads]   # before B consumes the list
        results = list(self.input_part(args))
        grads: List[Any] = [None] * s.n_outputs
        for k, i in enumerate(s.input_outputs):
            grads[i] = results[k]
        box = [kept + results[len(s.input_outputs):]]
        del kept, results
        weight_part = self.weight_part

        def run_weights() -> List[Any]:
            w_args = box.pop()  # W's saved values die with the call, and W runs once
            return list(weight_part(w_args))
        return grads, run_weights


class PendingWeights:
    """The W parts a backward queued for one microbatch (``defer_weight_gradients``)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = {id(p) for p in params}
        self._queue: List[Tuple[Callable[[], List[Any]], List[Any]]] = []
        self.deferred_graphs = 0   # backward graphs split so far (0: nothing was deferred)

    def wants(self, tensor: Any) -> bool:
        return id(tensor) in self._params

    def defer(self, run: Callable[[], List[Any]], accumulators: List[Any]) -> None:
        self._queue.append((run, accumulators))
        self.deferred_graphs += 1

    def __len__(self) -> int:
        return len(self._queue)

    def run(self) -> None:
        """Compute every queued weight gradient and accumulate it into its parameter's ``.grad``.

        The gradients go through autograd's engine into each parameter's own ``AccumulateGrad``
        node (through a view of the parameter, the one-node path to it), so whatever a backward
        would do to them happens: tensor hooks (``register_hook``), accumulation into an existing
        ``.grad``, post-accumulate-grad hooks."""
        while self._queue:
            run, accumulators = self._queue.pop(0)
            with torch.no_grad():
                grads = run()
            params = [acc.variable for acc, g in zip(accumulators, grads) if g is not None]
            if params:
                with torch.enable_grad():
                    views = [p.view_as(p) for p in params]
                torch.autograd.backward(views, [g for g in grads if g is not None])


_state = threading.local()


def current() -> Optional[PendingWeights]:
    """The innermost active ``defer_weight_gradients`` of this thread (None: run whole backwards)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def defer_weight_gradients(params: Iterable[torch.Tensor]) -> Iterator[PendingWeights]:
    """Backwards run inside compute input gradients only (B); the gradients of ``params`` wait in
    the yielded ``PendingWeights`` until its ``run()`` (W). Graphs fxtrain does not replay (the
    autograd and aot runtime modes) run their whole backward as usual: still exact, not split."""
    pending = PendingWeights(params)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(pending)
    try:
        yield pending
    finally:
        stack.pop()


def weight_positions(ctx: Any, tensor_positions: Sequence[int], pending: PendingWeights) -> Tuple[Tuple[int, ...], List[Any]]:
    """Which of an autograd.Function node's inputs are parameters ``pending`` defers, and their
    ``AccumulateGrad`` nodes. ``next_functions`` has one entry per tensor input, in order
    (``tensor_positions`` maps them back to argument positions)."""
    positions, accumulators = [], []
    for k, (fn, _) in enumerate(ctx.next_functions):
        var = getattr(fn, "variable", None) if fn is not None else None
        if var is not None and pending.wants(var):
            positions.append(tensor_positions[k])
            accumulators.append(fn)
    return tuple(positions), accumulators
