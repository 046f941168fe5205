"""Where to cut a captured graph, and what crosses each cut.

The graph's nodes that depend on a user input (activations) are kept in program order and cut
into contiguous stages. Nodes computed from parameters, buffers and constants alone (a transposed
weight, a position-id slice, a causal mask) are not activations: every stage that needs one
recomputes it, so such a value never travels between ranks, and a parameter used by two stages
(a tied embedding) is simply held by both. A value crosses the cut between stages ``s`` and
``s+1`` when it is made before the cut and read after it; values read several stages later are
passed through the stages in between. User inputs enter the first stage and travel the same way,
so only the first rank needs the batch.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx

from ..graph_walk import descendants
from .capture import INPUT, PARAM, CapturedGraph, SplitError
from .costs import COST_FUNCTIONS, CostFn, _example, _nbytes, forward_flops_of, flops_of, module_of, weight_flops_of
from .marker import is_marker
from .partition import min_max_partition
from .stage_module import StagePlan, stage_module

if TYPE_CHECKING:
    from .measure import Target

SplitPoints = Union[Mapping[str, str], Sequence[str]]


@dataclasses.dataclass
class Plan:
    captured: CapturedGraph
    stages: List[StagePlan]
    cuts: List[int]                      # positions in the activation sequence
    how: str                             # "markers" | "split_points" | "balanced by flops" ...
    balance: str = "flops"               # name of the cost the stages' ``cost`` is in

    @property
    def num_stages(self) -> int:
        return len(self.stages)


class _Graph:
    """The captured graph in the terms the partitioner needs: a sequence and the values crossing cuts."""

    def __init__(self, captured: CapturedGraph) -> None:
        self.captured = captured
        graph = captured.gm.graph
        kinds = captured.by_node()
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.user_inputs = [n for n in self.placeholders if kinds[n].kind == INPUT]
        self.output = next(n for n in graph.nodes if n.op == "output")
        anchored: Set[torch.fx.Node] = set(self.user_inputs)
        self.sequence: List[torch.fx.Node] = []
        self.markers: List[int] = []
        self.free: List[torch.fx.Node] = []
        for n in graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if is_marker(n):
                self.markers.append(len(self.sequence))
                continue
            if any(a in anchored for a in n.all_input_nodes):
                anchored.add(n)
                self.sequence.append(n)
            else:
                self.free.append(n)
        if not self.sequence:
            raise SplitError("no operation of the graph depends on the model's inputs")
        self.position = {n: i for i, n in enumerate(self.sequence)}
        for n in self.user_inputs:
            self.position[n] = -1
        n_seq = len(self.sequence)
        self.last_use: Dict[torch.fx.Node, int] = {}
        for v in list(self.user_inputs) + self.sequence:
            uses = [self.position[u] for u in v.users if u in self.position]
            if self.output in v.users:
                uses.append(n_seq)
            self.last_use[v] = max(uses) if uses else self.position[v]

    def crossing(self, cut: int) -> List[torch.fx.Node]:
        """Values made before position ``cut`` and read at or after it, inputs first, in program order."""
        return [v for v in list(self.user_inputs) + self.sequence
                if self.position[v] < cut <= self.last_use[v]]

    def cut_tables(self) -> tuple:
        """(allowed, bytes) per cut position 0..n: a cut is allowed when only tensors cross it."""
        n = len(self.sequence)
        nbytes = [0.0] * (n + 2)
        bad = [0] * (n + 2)
        for v in list(self.user_inputs) + self.sequence:
            start, stop = self.position[v] + 1, self.last_use[v]
            if start > stop:
                continue
            size = _nbytes(v)
            is_tensor = isinstance(_example(v), torch.Tensor)
            nbytes[start] += size
            nbytes[stop + 1] -= size
            bad[start] += 0 if is_tensor else 1
            bad[stop + 1] -= 0 if is_tensor else 1
        allowed, weights, acc_b, acc_bad = [], [], 0.0, 0
        for c in range(n + 1):
            acc_b += nbytes[c]
            acc_bad += bad[c]
            allowed.append(acc_bad == 0)
            weights.append(acc_b)
        return allowed, weights

    def free_closure(self, nodes: Sequence[torch.fx.Node]) -> List[torch.fx.Node]:
        """The parameter-only nodes that ``nodes`` read, directly or through each other, in graph order."""
        free = set(self.free)
        need: Set[torch.fx.Node] = set()
        stack = [a for n in nodes for a in n.all_input_nodes if a in free]
        while stack:
            f = stack.pop()
            if f in need:
                continue
            need.add(f)
            stack.extend(a for a in f.all_input_nodes if a in free)
        return [f for f in self.free if f in need]

    def sequence_costs(self, per_node: Sequence[float]) -> List[float]:
        """Node costs on the activation sequence; a parameter-only node's cost goes to its first reader."""
        index = {n: i for i, n in enumerate(self.captured.gm.graph.nodes)}
        costs = [float(per_node[index[n]]) for n in self.sequence]
        for f in self.free:
            c = float(per_node[index[f]])
            if c:
                readers = [self.position[u] for u in descendants(f.users) if u in self.position and u not in self.user_inputs]
                if readers:
                    costs[min(readers)] += c
        return costs


def _module_cuts(g: _Graph, split_points: SplitPoints) -> List[int]:
    points = dict.fromkeys(split_points, "before") if not isinstance(split_points, Mapping) else dict(split_points)
    cuts = []
    modules = [module_of(n) for n in g.sequence]
    for name, where in points.items():
        if where not in ("before", "after"):
            raise SplitError(f"split point {name!r}: expected 'before' or 'after', got {where!r}")
        inside = [i for i, m in enumerate(modules) if m == name or m.startswith(name + ".")]
        if not inside:
            known = sorted({m for m in modules if m})
            raise SplitError(f"split point {name!r} names no module that computes activations; modules "
                             f"seen: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}")
        cuts.append(inside[0] if where == "before" else inside[-1] + 1)
    return cuts


def _check_cuts(g: _Graph, cuts: List[int], allowed: Sequence[bool], origin: str) -> List[int]:
    n = len(g.sequence)
    cuts = sorted(set(cuts))
    for c in cuts:
        if c <= 0 or c >= n:
            raise SplitError(f"{origin}: a cut at the very {'start' if c <= 0 else 'end'} of the graph "
                             f"would leave a stage empty")
        if not allowed[c]:
            names = [v.name for v in g.crossing(c) if not isinstance(_example(v), torch.Tensor)]
            raise SplitError(f"{origin}: cannot cut before {g.sequence[c].name}: non-tensor value(s) "
                             f"{', '.join(names)} would cross stages")
    return cuts


def make_plan(captured: CapturedGraph, *, num_stages: Optional[int] = None,
              split_points: Optional[SplitPoints] = None,
              balance: Union[str, CostFn] = "flops", target: Optional["Target"] = None) -> Plan:
    """Cut ``captured`` into stages: by ``split_points``, by ``num_stages`` (balanced), or at the markers.

    ``target`` (balance="measured" only): the schedule the plan will run, whose simulated step
    the measured plan minimises (``build`` passes it)."""
    g = _Graph(captured)
    allowed, weights = g.cut_tables()
    if split_points is not None and num_stages is not None:
        raise SplitError("give either num_stages or split_points, not both")
    cost_fn: Optional[CostFn] = None
    if split_points is not None:
        cuts = _check_cuts(g, _module_cuts(g, split_points), allowed, "split_points")
        how = "split points " + ", ".join(f"{k} ({v})" for k, v in (
            split_points.items() if isinstance(split_points, Mapping) else ((p, "before") for p in split_points)))
    elif num_stages is not None:
        if num_stages < 1:
            raise SplitError(f"num_stages must be >= 1, got {num_stages}")
        allowed = _keep_logits_with_loss(g, allowed)
        if balance == "measured":
            return _measured_plan(g, num_stages, allowed, weights, target)
        cost_fn = COST_FUNCTIONS.get(balance) if isinstance(balance, str) else balance
        if cost_fn is None:
            raise SplitError(f"balance must be one of {sorted(COST_FUNCTIONS) + ['measured']} or a cost function, "
                             f"got {balance!r}")
        per_node = cost_fn(captured.gm)
        if len(per_node) != len(captured.gm.graph.nodes):
            raise SplitError("the cost function must return one cost per graph node")
        try:
            cuts, _ = min_max_partition(g.sequence_costs(per_node), num_stages, allowed=allowed, cut_weights=weights)
        except ValueError as e:
            raise SplitError(str(e)) from None
        how = f"{num_stages} stages balanced by {balance if isinstance(balance, str) else getattr(balance, '__name__', 'cost')}"
    elif g.markers:
        cuts = _check_cuts(g, list(g.markers), allowed, "fxtrain.pipe_split()")
        how = f"{len(cuts)} fxtrain.pipe_split() marker(s)"
    else:
        raise SplitError("say where to split: num_stages=N, split_points={...}, or fxtrain.pipe_split() in forward")
    stages = _stages(g, cuts)
    name = "flops"
    if cost_fn is not None and not (isinstance(balance, str) and balance == "flops"):
        name = balance if isinstance(balance, str) else getattr(balance, "__name__", "cost")
        seq = g.sequence_costs(cost_fn(captured.gm))
        bounds = [0] + cuts + [len(g.sequence)]
        for st, (a, b) in zip(stages, zip(bounds, bounds[1:])):
            st.cost = float(sum(seq[a:b]))
    else:
        for st in stages:
            st.cost = float(st.flops)
    return Plan(captured, stages, cuts, how, name)


def _keep_logits_with_loss(g: _Graph, allowed: Sequence[bool]) -> List[bool]:
    """No automatic cut between a label-sparse loss and the last product computing its logits.

    Cut there, the logits (rows x vocabulary) would travel between ranks and label sparsity,
    which needs the loss and the product in one graph, would not fire: the vocabulary projection
    would run on every row (3.6x slower on BERT-MLM's last stage, measured)."""
    from .costs import labelled_share
    out = list(allowed)
    region = [n for n in labelled_share(g.captured.gm) if n in g.position]
    losses = [g.position[n] for n in region if not n.users or all(u.op == "output" or u not in region for u in n.users)]
    heavy = [g.position[n] for n in region if flops_of(n)]
    if heavy and losses:
        for c in range(max(heavy) + 1, max(losses) + 1):
            out[c] = False
    return out


def _measured_plan(g: _Graph, k: int, allowed: Sequence[bool], weights: Sequence[float],
                   target: Optional["Target"]) -> Plan:
    """``balance="measured"`` (see ``measure``): stages timed as they will run, cut until even."""
    from .measure import calibrate
    if k > len(g.sequence):
        raise SplitError(f"cannot cut {len(g.sequence)} operations into {k} stages")
    start = g.sequence_costs(COST_FUNCTIONS["time"](g.captured.gm))
    forward_share, weight_share = [], []
    for n in g.sequence:
        total, forward = flops_of(n), forward_flops_of(n)
        forward_share.append(forward / total if total else 1 / 3)
        weight_share.append(weight_flops_of(n, lambda a: a not in g.position) / (total - forward)
                            if total > forward else 0.0)
    aim = f"the simulated {target.schedule} step" if target is not None else "the slowest stage"

    def plan(measure: Callable[[List[int]], Any]) -> Tuple[List[int], Any, str]:
        try:
            cuts, times, tried = calibrate(start, k, measure, forward_share=forward_share, weight_share=weight_share,
                                           allowed=allowed, cut_weights=weights, target=target)
        except ValueError as e:
            raise SplitError(str(e)) from None
        return cuts, times, f"{k} stages balanced by measured time ({tried} plan(s) timed, minimising {aim})"

    split = target is not None and target.split
    if target is None or target.group is None:
        result = plan(lambda c: time_plan(g.captured, _stages(g, c), split=split))
    else:
        from .measure import GroupTimer, PlanningFailed
        device = next(iter(i.value.device for i in g.captured.inputs if i.kind == PARAM), torch.device("cpu"))
        timer = GroupTimer(target.group, target.time_cuts or (lambda c, before: time_plan(g.captured, _stages(g, c),
                                                                                            before, split)), device)
        if timer.leads:
            try:
                result = timer.finish(plan(timer.measure))
            except BaseException as e:
                timer.fail(e)
                raise
        else:
            try:
                result = timer.follow()
            except PlanningFailed as e:
                raise SplitError(str(e)) from None
    return plan_with_times(g.captured, *result)


def plan_with_times(captured: CapturedGraph, cuts: List[int], times: Sequence[Tuple[float, float, float]],
                    how: str) -> Plan:
    """The plan cut at ``cuts`` whose stages were measured at ``times`` (forward, backward, and the
    backward's weight part, seconds; 0 where it was not timed apart)."""
    stages = _stages(_Graph(captured), list(cuts))
    for st, (f, b, w) in zip(stages, times):
        st.forward_time, st.backward_time, st.weight_time, st.cost = float(f), float(b), float(w), float(f + b)
    return Plan(captured, stages, list(cuts), how, "measured")


def time_plan(captured: CapturedGraph, stages: Sequence[StagePlan], before: Optional[Callable[[], None]] = None,
              split: bool = False) -> List[Tuple[float, float, float]]:
    """(forward, backward, weight part) seconds of each stage, run as the ``TrainModule`` the
    runner builds; ``split``: the backward split as the zero-bubble schedules run it (``before``
    and ``split``: see ``measure.time_stages``)."""
    from ..module import TrainModule
    from ..options import Options
    from .measure import time_stages
    kinds = captured.by_node()
    options = Options(backward="graph") if split else None
    modules = [TrainModule(stage_module(captured, st, last=st.index == len(stages) - 1), options) for st in stages]
    first = [kinds[p].value for p in stages[0].inputs]
    params = [i.value for i in captured.inputs if i.kind == PARAM]
    return time_stages(modules, first, params, before=before, split=split)


def _stages(g: _Graph, cuts: List[int]) -> List[StagePlan]:
    captured = g.captured
    kinds = captured.by_node()
    bounds = [0] + cuts + [len(g.sequence)]
    out_values = g.output.args[0] if isinstance(g.output.args[0], (tuple, list)) else (g.output.args[0],)
    stages = []
    last = len(bounds) - 2
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        nodes = g.sequence[a:b]
        replicated = g.free_closure(nodes + ([g.output] if s == last else []))
        inputs = list(g.user_inputs) if s == 0 else g.crossing(a)
        outputs = [v for v in out_values if isinstance(v, torch.fx.Node)] if s == last else g.crossing(b)
        used = {p for n in nodes + replicated for p in n.all_input_nodes if p in kinds and kinds[p].kind == PARAM}
        params = [kinds[p].name for p in g.placeholders if p in used]
        modules = [m for m in (module_of(n) for n in nodes) if m]
        stage = StagePlan(index=s, nodes=nodes, replicated=replicated, inputs=inputs, outputs=outputs, params=params,
                          param_numel=sum(kinds[p].value.numel() for p in used),
                          flops=sum(flops_of(n) for n in nodes + replicated),
                          forward_flops=sum(forward_flops_of(n) for n in nodes + replicated),
                          weight_flops=sum(weight_flops_of(n, lambda a: a not in g.position) for n in nodes + replicated),
                          send_bytes=0 if s == last else sum(_nbytes(v) for v in outputs),
                          first_module=modules[0] if modules else "", last_module=modules[-1] if modules else "")
        stages.append(stage)
    return stages
