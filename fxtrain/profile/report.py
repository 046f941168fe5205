"""ProfileReport: what a training step costs, in numbers a person can read and a program can parse."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..report import format_table, human_bytes, human_flops
from .session import Session, StepCost
from ..cost.tracker import OPTIMIZER, OUTSIDE, ModuleCost


# What each tracker category holds, for people.
_CATEGORY = {"forward": "made in forward (activations)", "backward": "made in backward (grads, temporaries)",
             "optimizer": "optimizer step temporaries", "setup": "other"}


@dataclass
class UnknownOp:
    op: str
    count: int
    phases: List[str]
    modules: List[str]
    why: str


@dataclass
class BatchFit:
    """peak(batch) = intercept + slope * batch, from two fake runs, checked by a third."""

    points: List[Tuple[int, int]]
    intercept: float
    slope: float
    budget_bytes: int
    batch: int
    checked_peak_bytes: Optional[int]


@dataclass
class ProfileReport:
    """Cost of one training step (forward, backward, optimizer step) of ``model``.

    FLOPs count 2 per multiply-add of matmuls, convolutions and attention (torch's convention,
    with the CPU attention kernels counted); ops that cannot be costed are in ``unknown_ops``.
    ``peak_memory_bytes`` is the most tensor bytes alive at once in a steady-state step:
    parameters, buffers, optimizer state, the batch, activations, gradients and temporaries.
    ``saved_for_backward_bytes`` counts what the forward keeps for the backward, beyond what was
    alive before the step (parameters and inputs are not counted again).

    ``keep_outputs`` is the loop costed: True, the outputs stay alive through the backward
    (``out = model(**b); out.loss.backward()``); False, only the loss does (``loss =
    model(**b).loss``, HF Trainer's loop). ``output_bytes_at_peak`` is how many bytes of the
    outputs' storages (other than the loss; for a deferred output, what it will be computed from)
    are alive at the peak: what the loop holds there, or with the outputs dropped, what of them is
    alive anyway (saved for the backward, or a peak in the forward).
    """

    model: str
    batch: Optional[int]
    optimizations: bool
    optimizer: Optional[str]
    device: str   # the step is costed for this device's kernels, optimizer step and launch rates
    flops_forward: int
    flops_backward: int
    peak_memory_bytes: int
    saved_for_backward_bytes: int
    parameters: int
    parameter_bytes: int
    optimizer_state_bytes: int
    input_bytes: int
    peak_phase: str
    peak_breakdown: Dict[str, int]
    keep_outputs: bool
    output_bytes_at_peak: int
    by_module: Dict[str, ModuleCost]
    unknown_ops: List[UnknownOp]
    assumed_max_sizes: int
    passes: Dict[str, str]
    timeline: List[Tuple[str, int]] = field(repr=False)
    seconds: float = 0.0
    capture_seconds: float = 0.0
    fit: Optional[BatchFit] = None
    # Options.memory_budget's plan of the costed capture (capture/budget.py: MemoryPlan), if any.
    memory_plan: Optional[Any] = None
    # max_batch_recomputed: the fit of the smallest peak (everything worth recomputing recomputed)
    # against the batch, and the plan for the budget at the batch found.
    recompute_fit: Optional[BatchFit] = None
    recompute_plan: Optional[Any] = None
    fallback: Optional[str] = None   # why fxtrain's graph could not be costed (eager costed instead)
    cache: List[str] = field(default_factory=list)  # Options.cache_dir events of the capture (hit, miss, stored)
    _session: Optional[Session] = field(default=None, repr=False, compare=False)
    _cost: Optional[StepCost] = field(default=None, repr=False, compare=False)

    @property
    def flops(self) -> int:
        return self.flops_forward + self.flops_backward

    # ------------------------------------------------------------------------------- outputs
    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f in fields(self):
            if not f.name.startswith("_"):   # the session holds fake tensors: not data
                value = getattr(self, f.name)
                out[f.name] = (asdict(value) if is_dataclass(value)
                               else {k: asdict(v) for k, v in value.items()} if f.name == "by_module"
                               else [asdict(u) for u in value] if f.name == "unknown_ops" else value)
        out["flops_total"] = self.flops
        out["timeline"] = [list(p) for p in self.timeline]
        return out

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def group(self, depth: int) -> Dict[str, ModuleCost]:
        """``by_module`` summed up to module paths of at most ``depth`` components."""
        out: Dict[str, ModuleCost] = {}
        for name, cost in self.by_module.items():
            key = name if name in (OUTSIDE, OPTIMIZER) else ".".join(name.split(".")[:depth])
            acc = out.setdefault(key, ModuleCost())
            acc.params += cost.params
            acc.flops_forward += cost.flops_forward
            acc.flops_backward += cost.flops_backward
            acc.saved_bytes += cost.saved_bytes
        return out

    def module_table(self, rows: int = 20) -> str:
        depth = 1
        while len(self.group(depth + 1)) <= rows and depth < 12 and len(self.group(depth + 1)) > len(self.group(depth)):
            depth += 1
        grouped = self.group(depth)
        ordered = sorted(grouped.items(), key=lambda kv: -(kv[1].flops_forward + kv[1].flops_backward + kv[1].saved_bytes))
        body = [[name or "(root)", f"{c.params:,}", human_flops(c.flops_forward), human_flops(c.flops_backward),
                 human_bytes(c.saved_bytes)] for name, c in ordered[:rows]]
        return format_table(["module", "params", "fwd FLOPs", "bwd FLOPs", "saved"], body)

    def __str__(self) -> str:
        head = [
            ["model", self.model],
            ["batch", "-" if self.batch is None else f"{self.batch:,}"],
            ["device", self.device],
            ["optimizations", "on (fxtrain's graph)" if self.optimizations else "off (eager PyTorch)"],
            ["optimizer", self.optimizer or "none"],
            ["parameters", f"{self.parameters:,} ({human_bytes(self.parameter_bytes)})"],
            ["FLOPs forward", human_flops(self.flops_forward)],
            ["FLOPs backward", human_flops(self.flops_backward)],
            ["peak memory", f"{human_bytes(self.peak_memory_bytes)} (during {self.peak_phase})"],
            ["  at peak", ", ".join(f"{_CATEGORY.get(k, k)} {human_bytes(v)}" for k, v in self.peak_breakdown.items())],
            ["loop", "outputs kept through backward (out = model(...); out.loss.backward())" if self.keep_outputs
             else "outputs dropped before backward (loss = model(...).loss; loss.backward())"],
            ["outputs at peak", f"{human_bytes(self.output_bytes_at_peak)} ("
                                + ("held by the loop" if self.keep_outputs else "alive without the loop holding them")
                                + ")"],
            ["saved for backward", human_bytes(self.saved_for_backward_bytes)],
            ["optimizer state", human_bytes(self.optimizer_state_bytes)],
            ["batch tensors", human_bytes(self.input_bytes)],
            ["unknown ops", ", ".join(f"{u.op} x{u.count}" for u in self.unknown_ops) or "none"],
        ]
        if self.assumed_max_sizes:
            head.append(["assumed sizes", f"{self.assumed_max_sizes} data-dependent size(s) at their maximum "
                                          f"(shapes-only inputs)"])
        on = [k for k, v in self.passes.items() if v.startswith("on")]
        if self.optimizations:
            head.append(["passes on", ", ".join(on) or "none"])
        if self.fit is not None:
            head.append(["max batch", f"{self.fit.batch:,} for {human_bytes(self.fit.budget_bytes)} "
                                      f"(peak {human_bytes(self.fit.checked_peak_bytes or 0)} checked)"])
        if self.recompute_fit is not None:
            plan = self.recompute_plan
            head.append(["max batch, recomputing", f"{self.recompute_fit.batch:,} for "
                         f"{human_bytes(self.recompute_fit.budget_bytes)}" + (
                             f" (planned peak {human_bytes(plan.planned_peak_bytes)}, "
                             f"{human_flops(plan.extra_flops)} FLOPs recomputed)" if plan is not None else "")])
            if plan is not None:
                head.extend([["  plan", line] for line in str(plan).splitlines()])
        if self.memory_plan is not None:
            head.extend([["memory plan", line] for line in str(self.memory_plan).splitlines()])
        if self.fallback:
            head.append(["fallback", f"eager PyTorch costed: {self.fallback}"])
        if self.cache:
            head.append(["cache", "; ".join(self.cache)])
        head.append(["profiled in", f"{self.seconds:.2f} s (capture {self.capture_seconds:.2f} s)"])
        width = max(len(r[0]) for r in head)
        lines = [f"{k.ljust(width)}  {v}" for k, v in head]
        return "\n".join(lines) + "\n\n" + self.module_table()

    def plot(self, path: str) -> str:
        from .plot import plot_report
        return plot_report(path, f"{self.model}: FLOPs per module (batch {self.batch})", self.group, self.timeline,
                           self.peak_memory_bytes)

    # ------------------------------------------------------------------------- memory budgets
    def max_batch_recomputed(self, budget_bytes: int, runs: int = 6) -> int:
        """Largest batch whose step fits ``budget_bytes`` when the backward recomputes activations
        instead of saving them, as ``Options(memory_budget=budget_bytes)`` would plan it.

        The captured graphs are planned again at each batch size probed (no capture): the smallest
        peak (every recomputation worth doing done) is fitted against the batch as ``max_batch``
        fits the plain peak, and the batch found is planned for the budget like a capture with that
        budget would be (``recompute_plan``: the least recomputation that fits). Needs the capture's
        batch axis to be symbolic (the profiler's default, ``dynamic=True``).
        """
        states = self._session.budget_states if self._session is not None else []
        if not states:
            raise RuntimeError("no training capture to plan (the step was costed eagerly, or "
                               "fxtrain's runtime cannot replay its graphs)")
        state = states[-1]
        symbols, capture_batch = state.batch_symbols()
        if not symbols or capture_batch is None:
            raise RuntimeError("the capture has static sizes (Options.dynamic=False): it cannot be planned "
                               "at other batch sizes")

        def sizes(batch: int) -> Dict[Any, int]:
            return {s: batch for s in symbols}

        def smallest(batch: int) -> int:
            return state.cost(state.steps(), sizes(batch)).peak_bytes

        points, intercept, slope = _secant_search(smallest, budget_bytes, self.batch or capture_batch, runs)
        best = max((x for x, y in points if y <= budget_bytes), default=0)
        plan = None
        while best >= 1:
            plan, _ = state.plan(int(budget_bytes), sizes(best))
            if plan.fits:
                break
            best -= max(1, best // 100)
        self.recompute_fit = BatchFit(points=points, intercept=intercept, slope=slope,
                                      budget_bytes=int(budget_bytes), batch=max(best, 0),
                                      checked_peak_bytes=plan.planned_peak_bytes if plan is not None else None)
        self.recompute_plan = plan
        return max(best, 0)

    # --------------------------------------------------------------------------- other batches
    def at_batch(self, batch: int) -> "ProfileReport":
        """The same step at another batch size (leading axis of every input of this batch's size).

        Shapes-only inputs; data-dependent sizes keep the fractions measured here.
        """
        if self._session is None or self._cost is None or self.batch is None:
            raise RuntimeError("this report cannot be re-run at another batch (no session or no batch axis)")
        from .inputs import with_batch
        args = with_batch(self._cost.args, self.batch, batch)
        kwargs = with_batch(self._cost.kwargs, self.batch, batch)
        cost = self._session.run(args, kwargs, hints=self._cost.fractions, keep_outputs=self.keep_outputs)
        return build_report(self._session, cost, self.model, batch, self.optimizer)

    def max_batch(self, budget_bytes: int, runs: int = 6) -> int:
        """Largest batch whose step peak fits ``budget_bytes``: a few fake steps (``_secant_search``)."""
        if self.batch is None:
            raise RuntimeError("no batch axis found among the inputs")
        known = {self.batch: self.peak_memory_bytes}
        points, intercept, slope = _secant_search(
            lambda b: known[b] if b in known else self.at_batch(b).peak_memory_bytes, budget_bytes, self.batch, runs)
        best, best_peak = max(((x, y) for x, y in points if y <= budget_bytes), default=(0, None))
        self.fit = BatchFit(points=points, intercept=intercept, slope=slope, budget_bytes=int(budget_bytes),
                            batch=best, checked_peak_bytes=best_peak)
        return best


def _secant_search(peak_at: Callable[[int], int], budget_bytes: float, base: int,
                   runs: int) -> Tuple[List[Tuple[int, int]], float, float]:
    """Probe batch sizes until the largest one whose peak fits ``budget_bytes`` is pinned down.

    Each probe is a fake step (about a second), so the search must take few: peak memory is close
    to linear in the batch, so a line through the base batch and twice it predicts the answer, and
    the line is redrawn through the two newest probes until a probe fits and the next batch would
    not (attention and rounded data-dependent sizes bend the line a little). Returns the probes
    ``(batch, peak)`` in order and the last line's intercept and slope.
    """
    points = [(base, peak_at(base)), (2 * base, peak_at(2 * base))]
    slope = intercept = 0.0
    for _ in range(runs):
        (xa, ya), (xb, yb) = points[-2], points[-1]
        slope = (yb - ya) / (xb - xa) if xb != xa else slope
        if slope <= 0:
            raise RuntimeError("peak memory does not grow with the batch; no batch limit to find")
        intercept = ya - slope * xa
        guess = int(math.floor((budget_bytes - intercept) / slope))
        if guess < 1 or any(guess == x for x, _ in points):
            break
        points.append((guess, peak_at(guess)))
        if points[-1][1] <= budget_bytes and intercept + slope * (guess + 1) > budget_bytes:
            break
    return points, intercept, slope


def _own_params(model: torch.nn.Module) -> Dict[str, int]:
    seen = set()
    out: Dict[str, int] = {}
    for name, mod in model.named_modules():
        n = 0
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        if n:
            out[name] = n
    return out


def _downsample(timeline: List[Tuple[str, int]], points: int = 2000) -> List[Tuple[str, int]]:
    """Keep the shape (and every local maximum per bucket) of a long timeline."""
    if len(timeline) <= points:
        return list(timeline)
    step = len(timeline) / points
    return [max(timeline[int(i * step):max(int((i + 1) * step), int(i * step) + 1)], key=lambda p: p[1])
            for i in range(points)]


def build_report(session: Session, cost: StepCost, model_name: str, batch: Optional[int],
                 optimizer: Optional[str]) -> ProfileReport:
    tr = cost.tracker
    own = _own_params(session.model)
    modules: Dict[str, ModuleCost] = {name: ModuleCost(params=n) for name, n in own.items()}
    for name, c in tr.modules.items():
        m = modules.setdefault(name, ModuleCost())
        m.flops_forward += c.flops_forward
        m.flops_backward += c.flops_backward
    for name, nbytes in tr.saved_by_module().items():
        modules.setdefault(name, ModuleCost()).saved_bytes += nbytes
    unknown = [UnknownOp(op=k, count=u.count, phases=sorted(u.phases), modules=sorted(u.modules), why=u.why)
               for k, u in sorted(tr.unknown.items())]
    params = {id(p): p for p in session.model.parameters()}
    info = session.tm.capture_info() if session.tm is not None else None
    return ProfileReport(
        model=model_name, batch=batch, optimizations=session.optimizations, optimizer=optimizer,
        device=str(session.device),
        flops_forward=tr.flops.get("forward", 0), flops_backward=tr.flops.get("backward", 0),
        peak_memory_bytes=tr.peak, saved_for_backward_bytes=sum(tr.saved.values()),
        parameters=sum(p.numel() for p in params.values()),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        optimizer_state_bytes=tr.initial.get("optimizer state", 0), input_bytes=tr.initial.get("inputs", 0),
        peak_phase=tr.peak_phase, peak_breakdown=dict(tr.peak_by_category), by_module=modules,
        keep_outputs=cost.keep_outputs, output_bytes_at_peak=tr.output_bytes_at_peak(),
        unknown_ops=unknown, assumed_max_sizes=tr.assumed_max,
        passes=dict(info.optimizations) if info is not None else {},
        timeline=_downsample(tr.timeline), seconds=cost.seconds, capture_seconds=session.capture_seconds,
        fallback=session.fallback_reason, cache=list(info.cache_log) if info is not None else [],
        memory_plan=info.memory_plan if info is not None else None,
        _session=session, _cost=cost)
