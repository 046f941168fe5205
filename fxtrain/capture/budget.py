"""Fit a training step into a memory budget: the backward recomputes what the forward stops saving.

``Options(memory_budget=...)`` bounds the peak of the whole step: parameters, gradients, optimizer
state, the batch, activations and temporaries. Of these only the activations saved for the backward
are fxtrain's to choose (the rest is fixed by the model, the batch and the optimizer), so a plan is a
choice of what the forward saves; whatever else the backward reads of the forward it recomputes from
what was saved. The plan is made at capture, on AOTAutograd's joint graph, and costed with the
profiler's cost model on the very graphs and runtime that will run (``cost/graph_step.py``).

How a plan is made:

1. **Baseline.** AOTAutograd's default partition saves every forward value the backward reads: the
   graphs fxtrain runs without a budget. If their step fits, they are the plan (nothing recomputed).
2. **Candidates** are the saved values, grouped by storage (a view is freed with its base, never
   alone). Values alive anyway are never candidates: parameters, inputs, the model's outputs (the
   loop holds them). Nor are values that cannot be recomputed exactly: random ops (their masks are
   saved, ``_rewrite_dropout`` below), in-place and side-effecting ops, data-dependent sizes, and
   anything outside aten (PythonOps run user code).
3. **Order: cheapest recomputation per byte first** (greedy, re-costed as the plan grows). Dropping a
   group costs recomputing it and whatever it needs that is neither saved nor already recomputed,
   up to saved values and primals: FLOPs plus the bytes each recomputed op reads and writes, at
   ``cost/flops.py: FLOPS_PER_BYTE`` (``flop_equivalent``, the pipeline planner's time cost too). Elementwise ops and norms come first (no FLOPs,
   one pass over memory), then attention probabilities, then matmul outputs; the residual stream
   between layers is last, and once a layer's other values are gone, dropping its input means
   recomputing the whole layer from the previous one: whole layers when needed.
4. **Search.** The plan is the shortest prefix of that order whose step fits: each prefix probed is
   split (``torch_private.partition_saving``: recomputation placed just before its first use in the
   backward), fxtrain's backward passes run on it, and its step is costed. A binary search needs
   ``log2(candidates)`` costings. If even the whole order (everything recomputable recomputed) does
   not fit, the budget is below the smallest achievable peak: warn once, or raise under
   ``fallback="raise"``, and run the smallest plan found.

Exactness: recomputed ops are the forward's own ops on the same inputs, so they produce the same
values; random ops are never recomputed. Dropout is the one random op whose output the backward
commonly needs: its output is rewritten as ``input * mask * scale`` from the saved mask, which is
bitwise what ``native_dropout`` computes on CPU (tested), so the output becomes recomputable while the
mask, drawn once, is saved. (AOTAutograd's own answer, functionalised RNG replaying a philox seed, is
CUDA-only in torch 2.13; on CPU its partitioner bans random ops from recomputation.)
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx

from .. import torch_private as tp
from ..graph_walk import descendants
from ..cost.step import optimizer_name
from ..errors import Error, FxtrainWarning

logger = logging.getLogger("fxtrain")
aten = torch.ops.aten

SMALL_BYTES = 4096

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "matmul", "linear"}
_NORM = {"native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
         "_native_batch_norm_legit_no_training", "native_group_norm", "_softmax", "_log_softmax", "_safe_softmax",
         "_fused_rms_norm", "rms_norm"}


class MemoryBudgetError(Error, RuntimeError):
    """The memory budget is below the smallest peak any plan achieves (raised under fallback="raise")."""


class MemoryBudgetWarning(FxtrainWarning):
    """The memory budget is below the smallest peak any plan achieves: the smallest plan runs."""


@dataclass
class MemoryPlan:
    """What a memory budget made of one captured graph (``capture_info().memory_plan``).

    Peaks are the whole step's (parameters, gradients, optimizer state, batch, activations,
    temporaries) as the profiler costs the graphs fxtrain runs, with the loop holding the model's
    outputs through the backward. ``saved_bytes`` is how many bytes of activations the forward no
    longer keeps for the backward; ``extra_flops`` what the backward recomputes instead.
    """

    budget_bytes: int
    planned_peak_bytes: int
    unplanned_peak_bytes: int            # the same step without recomputation (what runs without a budget)
    smallest_peak_bytes: Optional[int]   # everything recomputable recomputed (costed when the search needed it)
    fits: bool
    saved_bytes: int
    extra_flops: int
    recomputed_ops: Dict[str, int] = field(default_factory=dict)   # by kind: matmul, attention, norm, elementwise
    dropped_values: int = 0              # saved values the backward now recomputes
    candidates: int = 0                  # saved values that could be
    optimizer: str = "none"              # whose state the peaks count
    peak_phase: str = ""
    costings: int = 0                    # fake steps costed to find the plan
    seconds: float = 0.0
    note: str = ""

    def __str__(self) -> str:
        from ..report import human_bytes, human_flops
        ops = ", ".join(f"{k} {v}" for k, v in self.recomputed_ops.items() if v) or "nothing"
        lines = [f"budget {human_bytes(self.budget_bytes)}: planned peak {human_bytes(self.planned_peak_bytes)}"
                 f" ({'fits' if self.fits else 'does NOT fit'}; {self.peak_phase}), without recomputation "
                 f"{human_bytes(self.unplanned_peak_bytes)}",
                 f"saves {human_bytes(self.saved_bytes)} of activations for {human_flops(self.extra_flops)} "
                 f"FLOPs recomputed ({self.dropped_values} of {self.candidates} saved values; ops recomputed: {ops})",
                 f"optimizer state counted: {self.optimizer}; planned in {self.seconds:.2f} s "
                 f"({self.costings} fake steps)"]
        if self.smallest_peak_bytes is not None:
            lines.append(f"smallest achievable peak {human_bytes(self.smallest_peak_bytes)}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


# --------------------------------------------------------------------------------- node facts
def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _banned(node: torch.fx.Node) -> Optional[str]:
    """Why ``node`` must not run again in the backward (None: it may)."""
    if node.op != "call_function":
        return f"{node.op} node"
    if _is_getitem(node):
        source = node.args[0]
        return _banned(source) if isinstance(source, torch.fx.Node) else None
    if tp.is_size_node(node) and not hasattr(node.target, "_schema"):
        return None                     # size arithmetic (operator.mul on SymInts)
    target = node.target
    if getattr(target, "namespace", None) not in ("aten", "prims"):
        return "not an aten op"         # PythonOps run user code; fxtrain's host counts read the host
    tags = getattr(target, "tags", ())
    if tp.draws_random_numbers(node):
        return "random"
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return "data-dependent"
    if target._schema.is_mutable:
        return "in-place"
    return None


def _kind(node: torch.fx.Node) -> Optional[str]:
    """How a recomputed op is reported (None: free, a view or a size)."""
    if _is_getitem(node) or tp.is_size_node(node) or getattr(node.target, "is_view", False):
        return None
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", str(node.target))
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if name in _NORM:
        return "norm"
    return "elementwise"


def _val(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _storage_key(node: torch.fx.Node) -> Optional[int]:
    val = _val(node)
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    try:
        return val.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(node: torch.fx.Node) -> int:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return tp.size_hint(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tp.size_hint(val.numel()) * val.element_size()


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return tp.size_hint(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _shaped(value: Any) -> Any:
    """Stand-ins with concrete ``shape`` for the FLOP formulas (no guard on symbolic sizes)."""
    if isinstance(value, torch.Tensor):
        return types.SimpleNamespace(shape=tuple(tp.size_hint(s) for s in value.shape))
    if isinstance(value, (tuple, list)):
        return type(value)(_shaped(v) for v in value)
    return value


def _node_cost(node: torch.fx.Node) -> Tuple[int, int]:
    """(FLOPs, cost) of running ``node`` once more: FLOPs by fxtrain's formulas, cost adding the
    bytes read and written at the cost model's one rate (``FLOPS_PER_BYTE``: measured, where the
    budget's own 16 was a guess; only the order of candidates uses it)."""
    if _kind(node) is None:
        return 0, 0
    from ..cost.flops import flop_equivalent, op_flops

    def value(a: Any) -> Any:
        return _shaped(_val(a)) if isinstance(a, torch.fx.Node) else a
    args = tp.tree_map(value, node.args)
    kwargs = tp.tree_map(value, node.kwargs)
    try:
        flops = op_flops(node.target, args, kwargs, _shaped(_val(node))) or 0
    except Exception:
        flops = 0
    traffic = _tensor_bytes(_val(node)) + sum(_tensor_bytes(_val(a)) for a in node.all_input_nodes)
    return int(flops), int(flop_equivalent(flops, traffic))


# ------------------------------------------------------------------------------------ planner
@dataclass
class _Group:
    """Saved values sharing one storage: dropped together or not at all."""

    nodes: List[torch.fx.Node]
    nbytes: int


@dataclass
class _Step:
    group: _Group
    saves: List[torch.fx.Node]          # values that must be saved from now on (primals, random outputs)
    recomputed: List[torch.fx.Node]     # ops the backward runs again because of this step
    freed: int
    cost: int
    harmful: bool = False               # see Planner._lifetimes


class Planner:
    """The candidates and their greedy order for one joint graph (see the module docstring).

    ``joint`` is a private copy of AOTAutograd's joint graph (this class rewrites its dropouts);
    ``baseline_forward`` the default partition's forward graph, whose outputs past the first
    ``num_fwd_outputs`` are what it saves.
    """

    def __init__(self, joint: torch.fx.GraphModule, baseline_forward: torch.fx.GraphModule,
                 num_fwd_outputs: int, static_lifetime_input_indices: Optional[Sequence[int]] = None) -> None:
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs
        self.static = list(static_lifetime_input_indices or ())
        names = {n.name: n for n in joint.graph.nodes}
        outputs = next(n for n in reversed(baseline_forward.graph.nodes) if n.op == "output").args[0]
        saved = [names[n.name] for n in outputs[num_fwd_outputs:] if isinstance(n, torch.fx.Node)]
        self.saved_sizes = [n for n in saved if tp.is_size_node(n)]
        saved_tensors = [n for n in saved if not tp.is_size_node(n)]
        replaced = self._rewrite_dropout()
        self.saved0 = [replaced.get(n, n) for n in saved_tensors]
        self.order = {n: i for i, n in enumerate(joint.graph.nodes)}
        joint_outputs = next(n for n in reversed(joint.graph.nodes) if n.op == "output").args[0]
        # Storages alive anyway: parameters and inputs (primals), the model's outputs (the loop holds them).
        alive = [n for n in joint.graph.nodes if n.op == "placeholder"]
        alive += [n for n in joint_outputs[:num_fwd_outputs] if isinstance(n, torch.fx.Node)]
        self.alive = {k for k in map(_storage_key, alive) if k is not None}
        groups: Dict[Any, List[torch.fx.Node]] = {}
        for n in self.saved0:
            groups.setdefault(_storage_key(n) or ("node", n.name), []).append(n)
        self.groups: List[_Group] = []
        for key, nodes in groups.items():
            if key in self.alive or any(_banned(n) for n in nodes):
                continue
            self.groups.append(_Group(nodes, max(_storage_bytes(n) for n in nodes)))
        self._steps: Optional[List[_Step]] = None
        # Node facts, memoised: the greedy order asks for the same nodes' at every step.
        self._cost = functools.lru_cache(maxsize=None)(_node_cost)
        self._key = functools.lru_cache(maxsize=None)(_storage_key)
        self._nbytes = functools.lru_cache(maxsize=None)(_storage_bytes)

    # ------------------------------------------------------------------------------ dropout
    def _rewrite_dropout(self) -> Dict[torch.fx.Node, torch.fx.Node]:
        """``out, mask = native_dropout(x, p, True)``: uses of ``out`` read ``x * mask * (1/(1-p))``
        instead, recomputable from the saved mask (the same bits: the CPU kernel computes exactly
        that). Returns {old output node: new node}."""
        replaced: Dict[torch.fx.Node, torch.fx.Node] = {}
        graph = self.joint.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.native_dropout.default:
                continue
            x, p = node.args[0], float(node.args[1])
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            getitems = {u.args[1]: u for u in node.users if _is_getitem(u)}
            if train is False or not 0.0 < p < 1.0 or 0 not in getitems or 1 not in getitems:
                continue
            out, mask = getitems[0], getitems[1]
            with graph.inserting_after(mask):
                masked = graph.call_function(aten.mul.Tensor, (x, mask))
            with graph.inserting_after(masked):
                scaled = graph.call_function(aten.mul.Tensor, (masked, 1.0 / (1.0 - p)))
            val = _val(out)
            fake_mode = tp.detect_fake_mode([val])
            with fake_mode:
                masked.meta["val"] = torch.empty_like(val)
                scaled.meta["val"] = torch.empty_like(val)
            for key in ("nn_module_stack", "stack_trace", "seq_nr", "partitioner_tag"):
                if key in out.meta:
                    masked.meta[key] = scaled.meta[key] = out.meta[key]
            out.replace_all_uses_with(scaled)
            replaced[out] = scaled
        if replaced:
            graph.lint()
            self.joint.recompile()
        return replaced

    # ---------------------------------------------------------------------------- ordering
    def _marginal(self, group: _Group, saved: Set[torch.fx.Node],
                  recomputed: Set[torch.fx.Node]) -> Optional[_Step]:
        """What dropping ``group`` now costs: the ops to recompute, the values to save instead, and
        whether the step helps at all (``harmful``, see ``_lifetimes``)."""
        members = set(group.nodes)
        rec: List[torch.fx.Node] = []
        saves: List[torch.fx.Node] = []
        reused: List[torch.fx.Node] = []
        seen: Set[torch.fx.Node] = set()
        stack = list(group.nodes)
        cost = 0
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in recomputed:
                reused.append(n)
                continue
            if n.op == "get_attr":
                continue                                  # graph constants: in both graphs
            if n.op == "placeholder":
                if "tangents" in str(n.target):
                    return None                           # not a forward value: cannot happen for saved ones
                saves.append(n)                           # a primal: alive anyway
                continue
            if n in saved and n not in members:
                continue
            if _banned(n):
                if n in members:
                    return None
                saves.append(n)                           # must be saved to recompute the rest
                continue
            rec.append(n)
            cost += self._cost(n)[1]
            stack.extend(n.all_input_nodes)
        extra = 0
        new = [s for s in saves if s.op != "placeholder" and not tp.is_size_node(s)]
        new_keys = {self._key(s) for s in new} - self.alive - {None}
        if new_keys:
            new_keys -= {self._key(s) for s in saved if s not in members}
            extra = sum(max(self._nbytes(s) for s in new if self._key(s) == k) for k in new_keys)
        step = _Step(group, saves, rec, group.nbytes - extra, cost)
        step.harmful = self._lifetimes(step, reused, recomputed)
        return step

    # ---------------------------------------------------------------------------- lifetimes
    def _need_times(self) -> None:
        """Where in the backward each forward value is first read: the joint graph's backward part
        is in the order autograd's engine runs it, so positions there are times."""
        tangents = [n for n in self.joint.graph.nodes if n.op == "placeholder" and "tangents" in str(n.target)]
        backward = {n for n in descendants(tangents) if n.op != "output"} - set(tangents)
        inf = len(self.order) + 1
        self.backward_start = min((self.order[n] for n in backward), default=inf)
        self.direct = {n: min((self.order[u] for u in n.users if u in backward), default=inf)
                       for n in self.joint.graph.nodes}

    def _need(self, node: torch.fx.Node, recomputed: Set[torch.fx.Node], memo: Dict[torch.fx.Node, int]) -> int:
        """When the backward first needs ``node`` under the current plan: read directly, or by a
        recomputed op that is needed then."""
        if node in memo:
            return memo[node]
        memo[node] = self.direct[node]   # cycles cannot happen (a DAG); this also bounds recursion
        t = self.direct[node]
        for u in node.users:
            if u in recomputed:
                t = min(t, self._need(u, recomputed, memo))
        memo[node] = t
        return t

    def _lifetimes(self, step: _Step, reused: List[torch.fx.Node], recomputed: Set[torch.fx.Node]) -> bool:
        """Whether dropping the group costs more memory than it saves.

        The backward runs each recomputed op once, when it is first needed. Dropping a group saves
        its bytes from the end of the forward until it is recomputed (at ``t0``); but an op already
        recomputed for a later part of the backward that this recomputation also reads is then made
        at ``t0`` and held until its own use. Dropping a layer's output once the layer's insides are
        recomputed is the typical case: the whole layer would be materialised one layer early, to
        save one hidden-sized tensor. Counted in bytes x backward positions, the step is harmful
        when that cost exceeds the saving."""
        memo: Dict[torch.fx.Node, int] = {}
        t0 = min(min(self.direct[m] for m in step.group.nodes),
                 min((self._need(u, recomputed, memo) for m in step.group.nodes for u in m.users
                      if u in recomputed), default=len(self.order) + 1))
        saving = step.freed * max(0, t0 - self.backward_start)
        # What the reused ops read of other recomputed ops comes forward with them.
        # (An op needed before t0 anyway is made by then: it, and what it reads, move nothing.)
        pulled: Dict[torch.fx.Node, int] = {}
        stack = list(reused)
        while stack:
            r = stack.pop()
            if r in pulled:
                continue
            late = self._need(r, recomputed, memo) - t0
            if late <= 0:
                continue
            pulled[r] = late
            stack.extend(i for i in r.all_input_nodes if i in recomputed)
        # A pulled op is held from t0 to its own use only if something outside this recomputation
        # reads it later (the backward itself, or a recomputed op that is not pulled); an
        # intermediate read only by pulled ops is freed at t0 as it would have been later.
        cost = 0
        for r, late in pulled.items():
            held = self.direct[r] < len(self.order) or any(u in recomputed and u not in pulled for u in r.users)
            if held and _kind(r) is not None:
                cost += self._nbytes(r) * late
        return cost > saving

    def steps(self) -> List[_Step]:
        """The greedy order: each step drops the group cheapest to recompute per byte, given the
        steps before it. Exact greedy: after a step every waiting group is costed again (a step
        changes what others must recompute, and when the backward first needs the ops it
        recomputes, hence other groups' lifetime verdicts); a few hundred groups take well under a
        second (GPT-2 small: 212 groups, 0.7 s)."""
        if self._steps is not None:
            return self._steps
        self._need_times()
        saved = set(self.saved0)
        recomputed: Set[torch.fx.Node] = set()
        current: Dict[int, _Step] = {}
        out: List[_Step] = []
        waiting = set(range(len(self.groups)))
        while waiting:
            current.clear()
            for i in waiting:
                step = self._marginal(self.groups[i], saved, recomputed)
                # Below a few kB a value is not worth a recomputation that costs anything (a loss's
                # normaliser behind a whole nll_loss); free ones (a norm's statistics once the norm
                # itself is recomputed) still go.
                if step is not None and step.freed > 0 and not step.harmful and (
                        step.freed >= SMALL_BYTES or step.cost == 0):
                    current[i] = step
            if not current:
                break
            i = min(current, key=lambda j: (current[j].cost / current[j].freed, j))
            step = current[i]
            waiting.discard(i)
            saved.difference_update(step.group.nodes)
            saved.update(step.saves)
            recomputed.update(step.recomputed)
            out.append(step)
        self._steps = out
        return out

    # ------------------------------------------------------------------------------- plans
    def saved_after(self, k: int) -> Tuple[List[torch.fx.Node], List[torch.fx.Node]]:
        """(tensors, sizes) the forward saves after the first ``k`` steps, in graph order."""
        saved = set(self.saved0)
        sizes = set(self.saved_sizes)
        for step in self.steps()[:k]:
            saved.difference_update(step.group.nodes)
            for s in step.saves:
                (sizes if tp.is_size_node(s) else saved).add(s)
        return sorted(saved, key=self.order.__getitem__), sorted(sizes, key=self.order.__getitem__)

    def graphs(self, k: int) -> Tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        saved, sizes = self.saved_after(k)
        return tp.partition_saving(self.joint, saved, sizes, num_fwd_outputs=self.num_fwd_outputs,
                                   static_lifetime_input_indices=self.static)

    def summary(self, k: int) -> Tuple[Dict[str, int], int, int]:
        """(recomputed ops by kind, FLOPs recomputed by fxtrain's formulas, dropped values) of plan ``k``."""
        kinds: Dict[str, int] = {"elementwise": 0, "norm": 0, "attention": 0, "matmul": 0}
        flops = 0
        dropped = 0
        for step in self.steps()[:k]:
            dropped += len(step.group.nodes)
            for n in step.recomputed:
                kind = _kind(n)
                if kind is not None:
                    kinds[kind] = kinds.get(kind, 0) + 1
                    flops += self._cost(n)[0]
        return kinds, flops, dropped


# ------------------------------------------------------------------------------------- search
Candidate = Tuple[torch.fx.GraphModule, torch.fx.GraphModule, Any]   # forward, backward, cost


def search(planner: Planner, budget: int, baseline: Candidate, make: Callable[[int], Candidate],
           max_costings: int = 10) -> Tuple[Candidate, int, Optional[int], bool, int]:
    """The plan: (candidate, steps taken, smallest peak if costed, fits, costings).

    ``make(k)`` builds and costs the plan of the first ``k`` steps; ``baseline`` is the unbudgeted
    step (plan 0, already costed). Wanted: the shortest prefix that fits. The peak falls roughly
    with the bytes the steps free (less what recomputation holds in the backward), so each probe is
    placed by interpolating the peak against those bytes between the closest prefix known not to
    fit and the closest known to fit (by extrapolation while none is), alternating with bisection
    so that a bad guess cannot stall the search; it stops at adjacent prefixes or after
    ``max_costings`` fake steps (keeping the shortest prefix found to fit). If not even the whole
    order fits, the smallest peak is looked for (golden section: the peak rises again once
    recomputation holds more than it frees) and its plan returned.
    """
    p0 = baseline[2].peak_bytes
    if p0 <= budget:
        return baseline, 0, None, True, 1
    steps = planner.steps()
    n = len(steps)
    if n == 0:
        return baseline, 0, p0, False, 1
    freed = [0, *itertools.accumulate(st.freed for st in steps)]
    costed: Dict[int, Candidate] = {0: baseline}

    def peak(k: int) -> int:
        if k not in costed:
            costed[k] = make(k)
        return costed[k][2].peak_bytes

    def first_reaching(target: float) -> int:
        return next((k for k in range(1, n + 1) if freed[k] >= target), n)

    lo, hi = 0, None
    bisect = False
    while len(costed) <= max_costings:
        if hi is None:
            # No prefix known to fit: assume each freed byte lowers the peak, 10% margin.
            slope = 1.0 if lo == 0 else max(0.05, (p0 - peak(lo)) / max(1, freed[lo]))
            k = max(lo + 1, first_reaching(freed[lo] + 1.1 * (peak(lo) - budget) / slope))
        elif hi - lo <= 1:
            break
        elif bisect:
            k = (lo + hi) // 2
        else:
            span = peak(lo) - peak(hi)
            share = (peak(lo) - budget) / span if span > 0 else 0.5
            k = first_reaching(freed[lo] + share * (freed[hi] - freed[lo]))
            k = min(max(k, lo + 1), hi - 1)
        bisect = not bisect
        if peak(k) <= budget:
            hi = k
        else:
            lo = k
            if k == n:
                break
    if hi is not None:
        return costed[hi], hi, None, True, len(costed)
    # Not even the whole order fits: the smallest peak over the order.
    a, b = 0, n
    golden = 0.618
    while b - a > 2 and len(costed) < 2 * max_costings:
        c = int(round(b - golden * (b - a)))
        d = int(round(a + golden * (b - a)))
        if c == d:
            break
        if peak(c) <= peak(d):
            b = d
        else:
            a = c
    best = min(costed, key=lambda k: costed[k][2].peak_bytes)
    fits = costed[best][2].peak_bytes <= budget
    return costed[best], best, costed[best][2].peak_bytes, fits, len(costed)


# --------------------------------------------------------------------------------- the capture
@dataclass
class BudgetRequest:
    """What the backend asks of a capture: fit ``bytes``; what to do below the smallest peak."""

    bytes: int
    below_minimum: str = "warn"                      # "warn" | "raise"
    warn: Optional[Callable[[str], None]] = None


def replay_spec_for(forward: torch.fx.GraphModule, spec: Any, num_fwd_outputs: int) -> Any:
    """``spec`` (the baseline's ReplaySpec) with the saved-value slices of another split: the forward
    returns its outputs, the tensors saved with a version check, those without, then the sizes
    (AOTAutograd's layout, which ``_extract_fwd_bwd_modules`` produces)."""
    import dataclasses
    outputs = next(n for n in reversed(forward.graph.nodes) if n.op == "output").args[0]
    saved = list(outputs[num_fwd_outputs:])
    sizes = sum(1 for n in saved if isinstance(n, torch.fx.Node) and tp.is_size_node(n))
    no_check = sum(1 for n in saved if isinstance(n, torch.fx.Node) and n.meta.get("saved_tensor_with_no_vc_check"))
    tensors = len(saved) - sizes
    start = num_fwd_outputs
    return dataclasses.replace(spec, saved=slice(start, start + tensors - no_check),
                               saved_no_check=slice(start + tensors - no_check, start + tensors),
                               symints=slice(-sizes, None) if sizes else slice(0, 0))


class BudgetState:
    """What planning a capture for a budget needs, kept so that it can be planned again.

    The partition stage plans a capture with a budget once, for its own sizes. The profiler observes
    this object on each capture (``CaptureContext.on_budget_state``) to plan at other sizes without
    capturing again (``plan(budget, sizes)``: the largest batch that fits with recomputation). The
    greedy order is made once, at the capture's sizes: batch and sequence scale every candidate
    alike, so the order holds; each plan is still costed at its own sizes.
    """

    def __init__(self, split: Any, spec: Any, example_inputs: Sequence[Any], optimizer: Any = None,
                 executor: Any = None) -> None:
        """``split``: the baseline partition (capture/aot.py: Split, with its joint graph); ``spec``
        its ReplaySpec."""
        self.joint = split.joint
        self.executor = executor   # whose backward passes run on each plan's graphs
        self.num = int(split.partition_kwargs["num_fwd_outputs"])
        self.static = split.partition_kwargs.get("static_lifetime_input_indices")
        from ..cost.graph_step import graph_inputs
        self.inputs = graph_inputs(split.forward_graph, example_inputs)
        self.optimizer = optimizer
        self.spec = spec
        self.baseline_graphs = (split.forward_graph, split.backward_graph)
        self.baseline_reports = list(split.backward_reports)
        self._planner: Optional[Planner] = None
        self._graphs: Dict[int, Tuple[torch.fx.GraphModule, torch.fx.GraphModule, List[Any]]] = {}
        self._costers: Dict[Any, Any] = {}

    def set_optimizer(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._costers.clear()

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self.joint, self.baseline_graphs[0], self.num, self.static)
        return self._planner

    def graphs(self, k: int) -> Tuple[torch.fx.GraphModule, torch.fx.GraphModule, List[Any]]:
        """(forward, backward, backward-pass reports) of plan ``k`` (0: the baseline)."""
        from ..passes import FORWARD_GRAPH_PASSES, JOINT_GRAPH_PASSES, run_backward_passes
        if k == 0:
            return self.baseline_graphs[0], self.baseline_graphs[1], self.baseline_reports
        if k not in self._graphs:
            fw, bw = self.planner.graphs(k)
            # the passes that ran on the baseline's graphs run on the plan's (capture/aot.py); the
            # joint graph's ran before the copy the plans cut
            for forward_pass in FORWARD_GRAPH_PASSES:
                forward_pass(fw)
            joint = {p.__name__ for p in JOINT_GRAPH_PASSES}
            reports = [r for r in self.baseline_reports if r.name in joint] + run_backward_passes(bw, self.executor)
            self._graphs[k] = (fw, bw, reports)
        return self._graphs[k]

    def spec_for(self, forward: torch.fx.GraphModule) -> Any:
        return replay_spec_for(forward, self.spec, self.num)

    def cost(self, k: int, sizes: Optional[Dict[Any, int]] = None) -> Any:
        """The profiler's cost (``GraphStepCost``) of plan ``k``'s step at ``sizes``."""
        from ..cost.graph_step import GraphStepCoster
        key = tuple(sorted((str(s), v) for s, v in (sizes or {}).items()))
        if key not in self._costers:
            self._costers[key] = GraphStepCoster(self.inputs, self.optimizer, sizes)
        fw, bw, _ = self.graphs(k)
        return self._costers[key].cost(fw, bw, self.spec_for(fw))

    def steps(self) -> int:
        return len(self.planner.steps())

    def batch_symbols(self) -> Tuple[List[Any], Optional[int]]:
        """(size symbols of the batch axis, the capture's batch): the leading sizes of inputs that
        take no gradient (not parameters) with the most common capturing value, as
        ``profile/inputs.py: batch_size`` finds the batch. None when the sizes are static."""
        by_hint: Dict[int, List[Any]] = {}
        for x, grad in self.inputs:
            if isinstance(x, torch.Tensor) and not grad and x.dim() >= 1:
                sym = tp.size_symbol(x.shape[0])
                if sym is not None:
                    found = by_hint.setdefault(tp.size_hint(x.shape[0]), [])
                    if sym not in found:
                        found.append(sym)
        if not by_hint:
            return [], None
        batch = max(by_hint, key=lambda h: len(by_hint[h]))
        return by_hint[batch], batch

    def plan(self, budget: int, sizes: Optional[Dict[Any, int]] = None) -> Tuple[MemoryPlan, int]:
        """The plan for ``budget`` at ``sizes`` (the capture's own by default) and its step count."""
        started = time.perf_counter()
        baseline = self.cost(0, sizes)
        candidates = 0
        if baseline.peak_bytes <= budget:
            k, chosen, smallest, fits, costings = 0, baseline, None, True, 1
        else:
            candidates = len(self.planner.groups)

            def make(j: int) -> Candidate:
                fw, bw, _ = self.graphs(j)
                return fw, bw, self.cost(j, sizes)
            found, k, smallest, fits, costings = search(self.planner, budget, (*self.baseline_graphs, baseline), make)
            chosen = found[2]
        kinds, _, dropped = self.planner.summary(k) if k else ({}, 0, 0)
        plan = MemoryPlan(
            budget_bytes=int(budget), planned_peak_bytes=chosen.peak_bytes,
            unplanned_peak_bytes=baseline.peak_bytes, smallest_peak_bytes=smallest, fits=fits,
            saved_bytes=max(0, baseline.saved_bytes - chosen.saved_bytes),
            extra_flops=max(0, chosen.flops_backward - baseline.flops_backward),
            recomputed_ops=kinds, dropped_values=dropped, candidates=candidates,
            optimizer=optimizer_name(self.optimizer) or "none", peak_phase=chosen.peak_phase, costings=costings)
        plan.seconds = time.perf_counter() - started
        return plan, k


def below_minimum_message(plan: MemoryPlan) -> str:
    from ..report import human_bytes
    return (f"fxtrain: memory budget {human_bytes(plan.budget_bytes)} is below the smallest peak this training "
            f"step reaches by recomputing in the backward, {human_bytes(plan.smallest_peak_bytes or 0)} "
            f"(without recomputation {human_bytes(plan.unplanned_peak_bytes)}; optimizer state counted: "
            f"{plan.optimizer})")


def plan_budget(state: BudgetState, request: BudgetRequest) -> Tuple[MemoryPlan, int]:
    """The plan that fits ``request.bytes`` and its step count (``state.graphs(k)`` are its graphs).
    Below the smallest peak: raise (MemoryBudgetError) or warn, then the smallest plan."""
    plan, k = state.plan(request.bytes)
    if not plan.fits:
        plan.note = below_minimum_message(plan) + "; running the smallest plan"
        if request.below_minimum == "raise":
            raise MemoryBudgetError(below_minimum_message(plan))
        if request.warn is not None:
            request.warn(plan.note)
    logger.info("memory plan: %s", str(plan).replace("\n", "; "))
    return plan, k
