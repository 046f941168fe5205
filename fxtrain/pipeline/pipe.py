"""``fxtrain.split``: the user-facing plan object (describe, plot, build)."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from torch import nn

from ..options import Options
from .capture import capture
from .costs import CostFn
from .plan import Plan, SplitPoints, make_plan


class Pipe:
    """A model cut into pipeline stages (returned by ``fxtrain.split``).

    The plan is made once here on the example batch; ``build()`` (in each process of a
    ``torch.distributed`` group) makes that rank's stage and a torch pipelining schedule.
    """

    def __init__(self, model: nn.Module, example: Tuple[Tuple[Any, ...], Dict[str, Any], Any],
                 spec: Dict[str, Any], plan: Plan, loss_fn: Optional[Callable[..., Any]] = None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.example = example
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
        rows = []
        for s in self.plan.stages:
            rows.append({"stage": s.index, "first_module": s.first_module or "-", "last_module": s.last_module or "-",
                         "nodes": len(s.nodes), "params": s.param_numel, "flops": s.flops,
                         "forward_flops": s.forward_flops, "send_bytes": s.send_bytes, "cost": s.cost,
                         "sends": len(s.outputs) if s.index < self.num_stages - 1 else 0})
        return rows

    def describe(self, file: Any = None) -> str:
        """Print (and return) the plan: per stage parameters, training FLOPs and activation bytes sent on."""
        from .report import describe_plan
        text = describe_plan(self)
        print(text, file=file)
        return text

    def simulate(self, schedule: str = "1f1b", n_microbatches: int = 4) -> "Any":
        """Simulated timeline of one step (stage times proportional to their FLOPs)."""
        from .timeline import simulate
        rows = self.stage_table()
        # Time ~ the balanced cost when it is a FLOP count (dense or after sparsity), else FLOPs;
        # split into forward and backward in the dense graph's proportion.
        timed = "cost" if self.plan.balance != "params" else "flops"
        fwd = [r[timed] * (r["forward_flops"] / r["flops"] if r["flops"] else 1 / 3) for r in rows]
        bwd = [r[timed] - f for r, f in zip(rows, fwd)]
        return simulate(fwd, bwd, schedule, n_microbatches)

    def plot(self, path: str, schedule: str = "1f1b", n_microbatches: int = 4) -> str:
        """Draw the simulated schedule timeline to ``path`` (PNG/SVG/PDF by extension)."""
        from .timeline import plot
        return plot(self.simulate(schedule, n_microbatches), path)

    def build(self, schedule: str = "1f1b", n_microbatches: int = 4, loss_fn: Optional[Callable[..., Any]] = None,
              *, group: Any = None, timeout: Optional[datetime.timedelta] = None,
              options: Optional[Options] = None) -> "Any":
        """This rank's stage as a runner: ``runner.step(*args, **kwargs)`` trains one batch.

        ``schedule``: "gpipe" or "1f1b" (torch's ScheduleGPipe / Schedule1F1B). ``loss_fn(output,
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
        other = Pipe(self.model, self.example, spec, make_plan(self.plan.captured, **spec), self.loss_fn)
        other._captures = self._captures
        return other

    def microbatch_plan(self, n_microbatches: int, loss_fn: Optional[Callable[..., Any]]) -> Tuple[Any, Plan]:
        """The model captured at microbatch shape (with ``loss_fn``) and cut by the same spec."""
        from .runner import chunk0
        key = (n_microbatches, loss_fn)
        if key not in self._microbatch:
            if key not in self._captures:
                args, kwargs, target = self.example
                m = n_microbatches
                self._captures[key] = capture(self.model, chunk0(tuple(args), m), chunk0(dict(kwargs), m),
                                              loss_fn=loss_fn, target=chunk0(target, m))
            captured = self._captures[key]
            self._microbatch[key] = (captured, make_plan(captured, **self.spec)) if captured.has_loss else (captured, None)
        return self._microbatch[key]

    def stage_train_module(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._stage_modules:
            self._stage_modules[key] = make()
        return self._stage_modules[key]


def split(model: nn.Module, example_args: Sequence[Any] = (), example_kwargs: Optional[Dict[str, Any]] = None, *,
          num_stages: Optional[int] = None, split_points: Optional[SplitPoints] = None,
          balance: Union[str, CostFn] = "flops", example_target: Any = None,
          loss_fn: Optional[Callable[..., Any]] = None) -> Pipe:
    """Cut ``model``'s training graph into pipeline stages.

    Where: ``num_stages=N`` (optimal contiguous min-max partition of ``balance``: "flops", the
    default, "params", or a ``CostFn``), ``split_points={"qualified.module": "before"|"after"}``
    (or a list of names, meaning before), or, with neither, the ``fxtrain.pipe_split()`` calls in
    ``forward``. The example batch fixes the input structure; each stage's shapes are fixed at
    ``build`` from it and the number of microbatches.
    """
    example_kwargs = dict(example_kwargs or {})
    captured = capture(model, tuple(example_args), example_kwargs, loss_fn=loss_fn, target=example_target,
                       want_loss=True)
    spec: Dict[str, Any] = {"num_stages": num_stages, "split_points": split_points, "balance": balance}
    plan = make_plan(captured, **spec)
    return Pipe(model, (tuple(example_args), example_kwargs, example_target), spec, plan, loss_fn)
