"""``fxtrain.split``: the user-facing plan object (describe, plot, build)."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..options import Options
from ..report import human_bytes
from .capture import capture
from .costs import CostFn
from .errors import SplitError
from .plan import Plan, SplitPoints, make_plan


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


class Pipe:
    """A model cut into pipeline stages (returned by ``fxtrain.split``).

    The plan is made once here on the example batch; ``build()`` (in each process of a
    ``torch.distributed`` group) makes that rank's stage and a torch pipelining schedule.
    """

    def __init__(self, model: nn.Module, example: Tuple[Tuple[Any, ...], Dict[str, Any], Any],
                 spec: Dict[str, Any], plan: Plan, loss_fn: Optional[Callable[..., Any]] = None,
                 example_is_microbatch: bool = False) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.example = example
        #: True when the example is one microbatch (``split(mb_args=...)``, torch's convention);
        #: False when it is a whole batch, which ``build`` cuts into ``n_microbatches``
        self.example_is_microbatch = example_is_microbatch
        self.spec = spec
        self.plan = plan
        # Per (microbatches, loss_fn): the graph at microbatch shape and its plan; per stage as
        # well: the stage's TrainModule, so building another schedule reuses its captured graphs.
        self._captures: Dict[Any, Any] = {}       # shared with replan()'s pipes
        self._microbatch: Dict[Any, Any] = {}
        self._stage_modules: Dict[Any, Any] = {}

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    def stage_table(self) -> list:
        """One dict per stage: modules covered, parameters, FLOPs, bytes sent to the next stage."""
        return [{"stage": s.index, "first_module": s.first_module or "-", "last_module": s.last_module or "-",
                 "nodes": len(s.nodes), "params": s.param_numel, "flops": s.flops,
                 "forward_flops": s.forward_flops, "weight_flops": s.weight_flops,
                 "send_bytes": s.send_bytes, "cost": s.cost,
                 "sends": len(s.outputs) if s.index < self.num_stages - 1 else 0} for s in self.plan.stages]

    def describe(self, file: Any = None, n_microbatches: int = 4) -> str:
        """Print (and return) the plan: per stage parameters, training FLOPs and activation bytes sent
        on; which example convention was assumed (whole batch or one microbatch); and for every
        schedule that can run these stages, its layout and simulated bubble beside the textbook one."""
        rows = self.stage_table()
        total = sum(r["flops"] for r in rows) or 1
        mean = total / len(rows)
        header = f"{'stage':>5}  {'modules':<58} {'params':>10} {'train FLOPs':>12} {'share':>6} {'sends':>5} {'bytes sent':>11}"
        what = "one microbatch" if self.example_is_microbatch else "the example batch"
        lines = [f"pipeline plan: {self.plan.how}; FLOPs are forward + backward of {what}", self.example_text(),
                 header, "-" * len(header)]
        for r in rows:
            span = r["first_module"] if r["first_module"] == r["last_module"] else f"{r['first_module']} .. {r['last_module']}"
            if len(span) > 58:
                span = span[:27] + "..." + span[-28:]
            lines.append(f"{r['stage']:>5}  {span:<58} {_si(r['params']):>10} {_si(r['flops'], 'FLOP'):>12} "
                         f"{100 * r['flops'] / total:>5.1f}% {r['sends']:>5} {human_bytes(r['send_bytes']) if r['stage'] < len(rows) - 1 else '-':>11}")
        peak = max(r["flops"] for r in rows)
        lines.append(f"balance: max/mean stage FLOPs = {peak / mean:.3f}; parameters total "
                     f"{_si(sum(r['params'] for r in rows))} (shared parameters counted per stage)")
        if self.plan.balance != "flops":
            costs = [r["cost"] for r in rows]
            cmean = sum(costs) / len(costs) or 1
            shown = [f"{c * 1e3:.1f} ms" for c in costs] if self.plan.balance == "measured" else [_si(c) for c in costs]
            lines.append(f"balanced on {self.plan.balance}: " + ", ".join(shown)
                         + f" per stage{' (forward + backward, measured)' if self.plan.balance == 'measured' else ''}, "
                           f"max/mean = {max(costs) / cmean:.3f}")
        lines.extend(self._schedule_lines(n_microbatches))
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def _schedule_lines(self, m: int) -> List[str]:
        """Per schedule this plan can run: its layout and its simulated bubble beside the textbook one."""
        from .schedules import SCHEDULE_INFO
        n = self.num_stages
        source = "measured stage times" if self.plan.balance == "measured" else "stage FLOPs"
        lines = [f"schedules for these {n} stages, {m} microbatches (simulated from {source}, free communication):"]
        for name, info in SCHEDULE_INFO.items():
            v = 1 if info.placement == "single" else 2
            if n % v or (v == 2 and n < 4):
                continue
            p = n // v
            layout = f"{p} ranks x {v}" + ("" if info.placement == "single" else f" ({info.placement})")
            try:
                sim = self.simulate(name, m, ranks=p)
            except (ValueError, AssertionError) as e:   # torch's own limits (e.g. DualPipeV: m >= stages)
                lines.append(f"  {name:<17} {layout:<18} not simulated: {e}")
                continue
            lines.append(f"  {name:<17} {layout:<18} bubble {sim.bubble_fraction:>5.1%}  textbook "
                         f"{info.bubble(p, v, m):>5.1%} {info.textbook}"
                         + ("; B split into I (input grads) + W (weight grads)" if info.split_backward else ""))
        return lines

    def example_text(self) -> str:
        """Which convention the example follows, in words (``describe`` prints it)."""
        rows = _rows(self.example)
        size = f"{rows} rows" if rows is not None else "no batched tensor"
        if self.example_is_microbatch:
            return (f"example: one microbatch ({size}, given as mb_args/mb_kwargs as in torch's pipeline()); "
                    f"a step's batch is n_microbatches times that")
        return (f"example: the whole batch ({size}); build(n_microbatches=m) cuts each step's batch into m "
                f"microbatches (torch's pipeline() takes one microbatch instead: pass it as mb_args=...)")

    def simulate(self, schedule: str = "1f1b", n_microbatches: int = 4, ranks: Optional[int] = None) -> "Any":
        """Simulated timeline of one step (stage times proportional to their FLOPs, free communication).

        ``ranks``: the pipeline group size (default: what ``schedule`` needs for this plan, one
        stage per rank for GPipe/1F1B, two for the others)."""
        from .timeline import simulate
        rows = self.stage_table()
        if self.plan.balance == "measured":
            # Measured forward, backward and (zero bubble) weight part, else the FLOPs' proportion.
            fwd = [st.forward_time for st in self.plan.stages]
            bwd = [st.backward_time for st in self.plan.stages]
            weight = [st.weight_time if st.weight_time > 0 else
                      b * (r["weight_flops"] / (r["flops"] - r["forward_flops"]) if r["flops"] > r["forward_flops"] else 0.5)
                      for st, r, b in zip(self.plan.stages, rows, bwd)]
            return simulate(fwd, bwd, schedule, n_microbatches, weight=weight, ranks=ranks)
        # Time ~ the balanced cost when it is a FLOP count (dense or after sparsity), else FLOPs;
        # split into forward, input-gradient and weight-gradient parts in the dense graph's proportions.
        timed = "cost" if self.plan.balance != "params" else "flops"
        fwd = [r[timed] * (r["forward_flops"] / r["flops"] if r["flops"] else 1 / 3) for r in rows]
        bwd = [r[timed] - f for r, f in zip(rows, fwd)]
        weight = [b * (r["weight_flops"] / (r["flops"] - r["forward_flops"]) if r["flops"] > r["forward_flops"] else 0.5)
                  for r, b in zip(rows, bwd)]
        return simulate(fwd, bwd, schedule, n_microbatches, weight=weight, ranks=ranks)

    def plot(self, path: str, schedule: str = "1f1b", n_microbatches: int = 4, ranks: Optional[int] = None) -> str:
        """Draw the simulated schedule timeline to ``path`` (PNG/SVG/PDF by extension)."""
        from .timeline import plot
        return plot(self.simulate(schedule, n_microbatches, ranks), path)

    def build(self, schedule: str = "1f1b", n_microbatches: int = 4, loss_fn: Optional[Callable[..., Any]] = None,
              *, group: Any = None, timeout: Optional[datetime.timedelta] = None,
              options: Optional[Options] = None) -> "Any":
        """This rank's stage as a runner: ``runner.step(*args, **kwargs)`` trains one batch.

        ``schedule``: "gpipe", "1f1b" (one stage per rank), "interleaved-1f1b", "zb1p" (looped
        placement, any number of stages per rank), "zbv" or "dualpipev" (V-shaped, two stages per
        rank): torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV. The plan's
        ``num_stages`` must be the group size times the stages per rank. ``loss_fn(output,
        target)`` when the model's output holds no loss (``target`` is then passed to ``step``).
        ``timeout`` bounds every wait on a peer (default 5 minutes). ``options`` configure the
        stage TrainModules.
        """
        from .runner import PipelineRunner
        return PipelineRunner(self, schedule, n_microbatches, loss_fn or self.loss_fn, group=group, timeout=timeout, options=options)


    def replan(self, *, num_stages: Optional[int] = None, split_points: Optional[SplitPoints] = None,
               balance: Union[str, CostFn] = "flops") -> "Pipe":
        """The same captured model cut another way (no new capture; microbatch graphs are shared too)."""
        spec: Dict[str, Any] = {"num_stages": num_stages, "split_points": split_points, "balance": balance}
        other = Pipe(self.model, self.example, spec, make_plan(self.plan.captured, **spec), self.loss_fn,
                     self.example_is_microbatch)
        other._captures = self._captures
        return other

    def microbatch_capture(self, n_microbatches: int, loss_fn: Optional[Callable[..., Any]]) -> Any:
        """The model captured at microbatch shape (with ``loss_fn``)."""
        from .runner import chunk0
        key = (n_microbatches, loss_fn)
        if key not in self._captures:
            args, kwargs, example_target = self.example
            m = 1 if self.example_is_microbatch else n_microbatches
            try:
                mb = (chunk0(tuple(args), m), chunk0(dict(kwargs), m), chunk0(example_target, m))
            except SplitError as e:
                raise SplitError(
                    f"{e}: fxtrain.split takes the whole batch as example (what step() will get) and "
                    f"build() cuts it into n_microbatches; if the example is one microbatch (torch's "
                    f"pipeline(mb_args=...) convention), pass it as fxtrain.split(model, mb_args=..., "
                    f"mb_kwargs=...)") from None
            self._captures[key] = capture(self.model, mb[0], mb[1], loss_fn=loss_fn, target=mb[2])
        return self._captures[key]

    def microbatch_plan(self, n_microbatches: int, loss_fn: Optional[Callable[..., Any]],
                        target: Any = None) -> Tuple[Any, Plan]:
        """The model captured at microbatch shape (with ``loss_fn``) and cut by the same spec.

        ``target`` (a ``measure.Target``): the schedule ``build`` runs, which a measured plan is
        cut for (other balances ignore it)."""
        measured = self.spec.get("balance") == "measured"
        key = (n_microbatches, loss_fn) + ((target,) if measured else ())
        if key not in self._microbatch:
            captured = self.microbatch_capture(n_microbatches, loss_fn)
            extra = {"target": target} if measured else {}
            self._microbatch[key] = ((captured, make_plan(captured, **self.spec, **extra)) if captured.has_loss
                                     else (captured, None))
        return self._microbatch[key]

    def step_batch(self, n_microbatches: int) -> Tuple[Tuple[Any, ...], Dict[str, Any], Any]:
        """A batch ``step()`` takes, from the example: itself, or ``n_microbatches`` copies of a
        one-microbatch example (for timing runs)."""
        args, kwargs, target = self.example
        if not self.example_is_microbatch:
            return tuple(args), dict(kwargs), target

        def repeat(v: Any) -> Any:
            return torch.cat([v] * n_microbatches) if isinstance(v, torch.Tensor) and v.dim() else v
        return tuple(repeat(a) for a in args), {k: repeat(v) for k, v in kwargs.items()}, repeat(target)

    def forget_stage_modules(self, n_microbatches: int, loss_fn: Optional[Callable[..., Any]], keep_cuts: Any) -> None:
        """Drop the cached stages of other plans at this microbatch shape (the timing runs' of a
        measured plan, which ``build`` will not run)."""
        for key in [k for k in self._stage_modules if k[0] == n_microbatches and k[1] is loss_fn
                    and k[-1] != tuple(keep_cuts)]:
            del self._stage_modules[key]

    def stage_train_module(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._stage_modules:
            self._stage_modules[key] = make()
        return self._stage_modules[key]


def split(model: nn.Module, example_args: Sequence[Any] = (), example_kwargs: Optional[Dict[str, Any]] = None, *,
          num_stages: Optional[int] = None, split_points: Optional[SplitPoints] = None,
          balance: Union[str, CostFn] = "flops", example_target: Any = None,
          loss_fn: Optional[Callable[..., Any]] = None, mb_args: Optional[Sequence[Any]] = None,
          mb_kwargs: Optional[Dict[str, Any]] = None, mb_target: Any = None) -> Pipe:
    """Cut ``model``'s training graph into pipeline stages.

    Where: ``num_stages=N`` (optimal contiguous min-max partition of ``balance``: "flops", the
    default, "sparse_flops", "time", "params", or a ``CostFn``; or "measured": the stages timed as
    they will run and re-cut until even, which ``build`` redoes for its schedule, see
    ``pipeline.measure``), ``split_points={"qualified.module": "before"|"after"}``
    (or a list of names, meaning before), or, with neither, the ``fxtrain.pipe_split()`` calls in
    ``forward``. ``N`` is the number of stages, not of ranks: ``build`` puts ``N / group size``
    stages on each rank.

    The example fixes the input structure and shapes. ``example_args``/``example_kwargs`` (and
    ``example_target``) are a whole batch, which ``build(n_microbatches=m)`` cuts into ``m``;
    ``mb_args``/``mb_kwargs``/``mb_target`` instead are one microbatch (torch's
    ``pipeline(mb_args=...)`` convention), and a step's batch is ``m`` times that. ``describe()``
    says which was given.
    """
    microbatch = mb_args is not None or mb_kwargs is not None or mb_target is not None
    if microbatch:
        if tuple(example_args) or example_kwargs or example_target is not None:
            raise SplitError("give the example either as a whole batch (example_args/example_kwargs/"
                             "example_target) or as one microbatch (mb_args/mb_kwargs/mb_target), not both")
        example_args, example_kwargs, example_target = tuple(mb_args or ()), mb_kwargs, mb_target
    example_kwargs = dict(example_kwargs or {})
    captured = capture(model, tuple(example_args), example_kwargs, loss_fn=loss_fn, target=example_target,
                       want_loss=True)
    spec: Dict[str, Any] = {"num_stages": num_stages, "split_points": split_points, "balance": balance}
    plan = make_plan(captured, **spec)
    return Pipe(model, (tuple(example_args), example_kwargs, example_target), spec, plan, loss_fn, microbatch)


def _rows(example: Any) -> Optional[int]:
    """The batch size of an example: the first dimension of its first batched tensor."""
    import torch
    from .capture import walk
    for _, leaf in walk({"args": tuple(example[0]), "kwargs": dict(example[1]), "target": example[2]}):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None
