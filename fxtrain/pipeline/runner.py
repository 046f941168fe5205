"""Run this rank's stages of a plan on torch.distributed.pipelining, one training step at a time.

Each process captures the model again at microbatch shape (static shapes: what the pipeline's
send/receive buffers are made from), cuts it with the same plan, keeps its own stages as fxtrain
``TrainModule``s (so graph passes such as label sparsity run inside stages) and hands each to
torch's ``PipelineStage`` with its input and output metadata (static mode: no shape-inference pass).
The schedule is torch's own class (``SCHEDULES``). A plan of S stages on a group of p ranks puts
S/p stages on each rank: looped (stage s on rank s mod p) for the interleaved schedules, V-shaped
(rank r holds stages r and 2p-1-r) for ZBV and DualPipeV, as torch's schedules expect.

Zero-bubble schedules split each stage's backward into B (input gradients) and W (weight
gradients). ``_Stage`` does it on fxtrain's own aten backward graph (``runtime/weight_split.py``)
instead of torch's autograd-graph walk, which loses weight gradients through custom Functions
(pytorch#166577) and counts a parameter reached twice twice (pytorch#180952).

What torch's own pipeline gets wrong and this runner gets right:
- custom autograd Functions stay opaque PythonOps in the stage graph, so their own backward runs;
- a parameter held by several stages (tied weights) gets each holder's contribution summed over a
  subgroup of exactly those ranks after the schedule, so every holder ends with the full gradient;
- the 1/M of the microbatch mean is applied to each microbatch loss before its backward (never by
  dividing ``.grad`` afterwards, which would also scale gradients accumulated before the step and
  scale twice a parameter that appears twice on one rank).
Failures: P2P runs on a process group of its own with the configured timeout; a stage that raises
records why in the rendezvous store before re-raising, and a peer that loses contact raises a
``PipelineError`` naming the failed stage instead of hanging.
The pipe (``pipe.py: Pipe``) is what builds a runner (``Pipe.build``), so the runner takes it as a
value and does not import it: the dependency goes one way, pipe -> runner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

from ..module import TrainModule
from ..options import Options, resolve
from ..runtime.weight_split import PendingWeights, defer_weight_gradients
from .capture import fetch, path_text, walk
from .errors import PipelineError, SplitError
from .measure import Target
from .plan import Plan
from .schedules import SCHEDULE_INFO, check_layout, placement
from .stage_module import stage_module
from ..torch_private import default_store, pipeline_stage_class, process_group_timeout

logger = logging.getLogger("fxtrain")

SCHEDULES: Dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                              "interleaved-1f1b": ScheduleInterleaved1F1B, "zb1p": ScheduleInterleavedZeroBubble,
                              "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
_builds: Dict[Tuple[int, ...], Iterator[int]] = {}


def backend_for(device: torch.device) -> Optional[str]:
    """The collective backend for a device: gloo on CPU, NCCL on CUDA (None: the default group's)."""
    return {"cpu": "gloo", "cuda": "nccl"}.get(device.type)


class _Stage(pipeline_stage_class()):  # type: ignore[misc]
    """torch's PipelineStage (``torch_private.pipeline_stage_class``: any dtype between stages), with fxtrain's input/weight backward split and compute timing.

    torch's zero-bubble schedules call ``backward_maybe_with_nosync("input")`` for B and
    ``("weight")`` for W (``stage.py``: ``backward_one_chunk(full_backward=False)`` then
    ``backward_weight_one_chunk``). Here B is torch's ordinary stage backward run inside
    ``defer_weight_gradients``: fxtrain's graph runtime computes the input gradients and queues
    the weight-gradient part of the stage's backward graph, handed to W through the slot torch
    keeps for its ``param_groups``. W runs that queue. Every other backward is torch's.
    (The first stage has no input gradient to send: torch runs its whole backward in W.)
    """

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        self._params = list(submodule.parameters())   # what B defers and W accumulates
        self.busy = 0.0                 # seconds of compute since the last reset
        self.failed_locally = False
        self.weight_parts = 0           # W parts (split backward graphs) run since the last reset
        #: (kind F/B/I/W, microbatch, start, end) of every compute action since the last reset
        self.actions: List[Tuple[str, int, float, float]] = []

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        return self._timed("B" if full else "I", super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("W", super().backward_weight_one_chunk, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict,
                                   last_backward: bool = False) -> Tuple[Tuple[Optional[torch.Tensor], ...], Any]:
        if backward_type == "input":
            output, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
            if grads is None and isinstance(output, tuple) and len(output) == 1:
                # The last stage's loss, which torch wrapped in a tuple for its own input backward.
                bwd_kwargs = dict(bwd_kwargs, stage_output=output[0])
            with defer_weight_gradients(self._params) as pending:
                input_grads, _ = super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward)
            return input_grads, [pending]
        if backward_type == "weight":
            for pending in bwd_kwargs["param_groups"] or ():
                if isinstance(pending, PendingWeights):
                    self.weight_parts += len(pending)
                    pending.run()
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _timed(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.failed_locally = True
            raise
        finally:
            end = time.perf_counter()
            self.busy += end - start
            self.actions.append((kind, int(args[0]) if args else int(kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))),
                                 start, end))


def _meta(node: torch.fx.Node, device: torch.device) -> torch.Tensor:
    ex = node.meta["example_value"]
    t = torch.empty(tuple(ex.shape), dtype=ex.dtype, device=device)
    return t.requires_grad_(bool(ex.requires_grad) and (ex.is_floating_point() or ex.is_complex()))


def chunk0(value: Any, m: int) -> Any:
    """The first of ``m`` microbatches of a nested input (tensors split along dim 0)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise SplitError("a scalar tensor input cannot be split into microbatches")
        if value.shape[0] % m:
            raise SplitError(f"batch size {value.shape[0]} is not divisible by n_microbatches={m}")
        return value[: value.shape[0] // m]
    if isinstance(value, tuple):
        return tuple(chunk0(v, m) for v in value)
    if isinstance(value, list):
        return [chunk0(v, m) for v in value]
    if isinstance(value, dict):
        return {k: chunk0(v, m) for k, v in value.items()}
    return value


TIMING_RUN = "timing run of a measured plan"
TIMING_STEPS = 3


def time_in_pipeline(pipe: Any, schedule: str, m: int, loss_fn: Optional[Callable[..., Any]],
                     group: Any, timeout: Optional[datetime.timedelta], options: Optional[Options],
                     cuts: List[int], before: Callable[[], None]) -> List[Tuple[float, float, float]]:
    """Every stage's (forward, backward, weight part) seconds per microbatch, measured by running
    the plan cut at ``cuts`` as this very pipeline: its schedule, on the group's ranks, on the
    example batch (one step to compile, then ``TIMING_STEPS``; medians over microbatches).
    Called by every rank of the group at once (``measure.GroupTimer``). The steps' gradients and
    random draws are undone; the stages' compiled modules stay cached for the plan ``build`` keeps."""
    from .plan import plan_with_times
    captured = pipe.microbatch_capture(m, loss_fn)
    probe = plan_with_times(captured, list(cuts), [(0.0, 0.0, 0.0)] * pipe.num_stages, TIMING_RUN)
    params = list(pipe.model.parameters())
    saved = [p.grad for p in params]
    args, kwargs, target = pipe.step_batch(m)
    device = params[0].device if params else torch.device("cpu")
    samples: Dict[Tuple[int, str], List[float]] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [],
                                   device_type=device.type if device.type != "cpu" else "cuda"):
            runner = PipelineRunner(pipe, schedule, m, loss_fn, group=group, timeout=timeout, options=options,
                                    plan=probe)
            runner.step(*args, target=target, **kwargs)
            before()
            for _ in range(TIMING_STEPS):
                for p in params:
                    # As after a training loop's zero_grad(set_to_none=True): each step allocates
                    # its gradients (a tied 31 MB table's first W then costs 5-8 ms more).
                    p.grad = None
                runner.step(*args, target=target, **kwargs)
                for s, kind, _, a, b in runner.last_actions:
                    samples.setdefault((s, kind), []).append(b - a)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, samples, group=group)
    merged: Dict[Tuple[int, str], List[float]] = {}
    for part in everyone:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)

    def med(s: int, kind: str) -> float:
        return statistics.median(merged[(s, kind)]) if (s, kind) in merged else 0.0
    out = []
    for s in range(pipe.num_stages):
        if (s, "B") in merged:
            out.append((med(s, "F"), med(s, "B"), 0.0))
        else:
            out.append((med(s, "F"), med(s, "I") + med(s, "W"), med(s, "W")))
    return out


class PipelineRunner:
    """This rank's stages of a pipeline; ``step(*args, **kwargs)`` trains one batch (see ``Pipe.build``).

    ``stage_indices`` are the stages this rank runs (one, or several for the interleaved and V
    schedules), ``modules`` their ``TrainModule``s by stage index; ``stage_index`` and ``module``
    are the first of them.
    """

    def __init__(self, pipe: Any, schedule: str, n_microbatches: int, loss_fn: Optional[Callable[..., Any]],
                 group: Optional[dist.ProcessGroup] = None, timeout: Optional[datetime.timedelta] = None,
                 options: Optional[Options] = None, plan: Optional[Plan] = None) -> None:
        """``plan``: run these cuts instead of the pipe's plan at microbatch size (timing runs of
        a measured plan)."""
        if not dist.is_available() or not dist.is_initialized():
            raise PipelineError("Pipe.build needs torch.distributed initialised (torchrun, or "
                                "init_process_group in each torch.multiprocessing worker)")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        info = SCHEDULE_INFO[schedule]
        self.schedule_name = schedule
        self.n_microbatches = m = n_microbatches
        base = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(base)
        self.device = next(pipe.model.parameters()).device
        timeout = timeout or datetime.timedelta(minutes=5)
        self.timeout = timeout
        self.rank = dist.get_rank()
        if self.rank not in ranks:
            raise PipelineError(f"rank {self.rank} is not in the pipeline group {ranks}")
        try:
            self.stages_per_rank = check_layout(schedule, pipe.num_stages, len(ranks))
        except ValueError as e:
            raise PipelineError(str(e)) from None
        self.num_stages = pipe.num_stages
        self.group_rank = ranks.index(self.rank)
        #: rank (position in the pipeline group) of every stage
        self.placement = placement(self.num_stages, len(ranks), info.placement)
        self.stage_indices = [s for s, r in enumerate(self.placement) if r == self.group_rank]
        self.stage_index = self.stage_indices[0]
        self._ranks = ranks
        # Every rank captures and plans the whole model (deterministic), so all agree on the cuts
        # and on which stages share a parameter without exchanging anything. A measured plan
        # (balance="measured") is cut for this schedule and timed by the group together, the
        # first rank deciding (``measure.GroupTimer``).
        if plan is not None:
            captured = plan.captured
        else:
            target = None
            if pipe.spec.get("balance") == "measured":
                def time_cuts(cuts: List[int], before: Callable[[], None]) -> List[Tuple[float, float, float]]:
                    return time_in_pipeline(pipe, schedule, m, loss_fn, base, timeout, options, cuts, before)
                target = Target(schedule, m, len(ranks), base, time_cuts)
            captured, plan = pipe.microbatch_plan(m, loss_fn, target)
            if target is not None and plan is not None:
                pipe.forget_stage_modules(m, loss_fn, plan.cuts)
        if plan is None:
            raise SplitError("the model's output holds no scalar loss (no tensor, `.loss` or first element); "
                             "pass loss_fn=lambda output, target: ... to build()")
        if plan.num_stages != pipe.num_stages:
            raise SplitError(f"the plan at microbatch size has {plan.num_stages} stages, not {pipe.num_stages}")
        if plan.cuts != pipe.plan.cuts and plan.how != TIMING_RUN:
            logger.warning("fxtrain.split: cuts at microbatch size %s differ from the split-time plan %s",
                           plan.cuts, pipe.plan.cuts)
        self.plan: Plan = plan
        self._inputs = captured.user_inputs()
        self._example_root = {"args": tuple(pipe.example[0]), "kwargs": dict(pipe.example[1]), "target": pipe.example[2]}
        self._example_is_microbatch = pipe.example_is_microbatch
        self._mb_shapes = [tuple(i.value.shape) for i in self._inputs]
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        if info.split_backward:
            # B/W is cut from the aten backward graph, which fxtrain's graph runtime runs.
            options = dataclasses.replace(options or Options(), backward="graph")
        #: this rank's stages as TrainModules, by stage index
        self.modules: Dict[int, TrainModule] = {}
        for s in self.stage_indices:
            stage_plan, last = plan.stages[s], s == self.num_stages - 1
            self.modules[s] = pipe.stage_train_module(
                (m, loss_fn, s, repr(options), tuple(plan.cuts)),
                lambda stage_plan=stage_plan, last=last: TrainModule(stage_module(captured, stage_plan, last=last), options))
        self.module = self.modules[self.stage_index]
        #: custom autograd Functions of the whole model kept as opaque PythonOps, and how many of
        #: their calls this rank's stages run
        self.python_ops = list(captured.python_ops)
        self.python_op_calls = sum(1 for mod in self.modules.values() for n in mod.module.graph.nodes
                                   if n.target in (torch.ops.fxtrain.python_op, torch.ops.fxtrain.python_op.default))
        if info.split_backward and resolve(options).backward != "graph":
            logger.warning("fxtrain pipeline: FXTRAIN_BACKWARD=%s keeps the stages off fxtrain's graph runtime: "
                           "%s runs each backward whole in its B step (exact, no weight/input split)",
                           resolve(options).backward, schedule)
        if group is None:
            # A group of our own carries the configured timeout (collective over the world: every
            # rank calls build, as with any torch.distributed group creation).
            self._group = dist.new_group(ranks, timeout=timeout, backend=backend_for(self.device))
        else:
            self._group = group  # the caller's group, with the timeout it was created with
            self.timeout = _or_none(process_group_timeout, group) or timeout
        self._uid = (tuple(ranks), next(_builds.setdefault(tuple(ranks), itertools.count())))
        self._shared = self._shared_parameters(plan, captured)
        self._stages: List[_Stage] = []
        for s in self.stage_indices:
            st = plan.stages[s]
            stage = _Stage(self.modules[s], s, self.num_stages, self.device,
                           input_args=tuple(_meta(v, self.device) for v in st.inputs),
                           output_args=tuple(_meta(v, self.device) for v in st.outputs),
                           group=self._group)
            self._stages.append(stage)
        cls = SCHEDULES[schedule]
        try:
            stages = self._stages[0] if info.placement == "single" else self._stages
            self._schedule = cls(stages, m, loss_fn=self._microbatch_loss, scale_grads=False)
        except ValueError as e:  # torch's own constraints (microbatches per round, ...)
            raise PipelineError(f"torch's {cls.__name__} refuses this layout: {e}") from None
        self.last_stats: Dict[str, float] = {}
        self.last_actions: List[Tuple[int, str, int, float, float]] = []
        logger.info("fxtrain pipeline: rank %d runs stage(s) %s of %d (%d parameters, %s, %d microbatches)",
                    self.rank, self.stage_indices, self.num_stages, sum(1 for _ in self.parameters()), schedule, m)

    # ------------------------------------------------------------------------------- public API
    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """This rank's parameters (of all its stages, each once) under the original model's names."""
        seen: set = set()
        for module in self.modules.values():
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> Optional[torch.Tensor]:
        """Train one batch: the mean microbatch loss on the last stage (None elsewhere), grads in place.

        Every rank may pass the batch (then all validate it); only the first stage reads its values,
        so other ranks may call ``step()`` without arguments.
        """
        flat = self._flatten(args, kwargs, target)
        shared = self._snapshot_shared()
        for stage in self._stages:
            stage.busy, stage.failed_locally, stage.weight_parts = 0.0, False, 0
            stage.actions.clear()
        losses: List[torch.Tensor] = []
        start = time.perf_counter()
        try:
            if self.is_first and self.is_last:
                self._schedule.step(*flat, target=self._dummy_target(), losses=losses, return_outputs=False)
            elif self.is_first:
                self._schedule.step(*flat, return_outputs=False)
            elif self.is_last:
                self._schedule.step(target=self._dummy_target(), losses=losses, return_outputs=False)
            else:
                self._schedule.step(return_outputs=False)
            reduce_start = time.perf_counter()
            self._reduce_shared(shared)
        except Exception as e:
            raise self._failure(e) from e
        end = time.perf_counter()
        elapsed = end - start
        busy = sum(stage.busy for stage in self._stages)
        #: step time, this rank's compute time (forward, backward, W), the idle share, the time of
        #: the shared-parameter all-reduce after the schedule, and how many weight-gradient parts
        #: (W) of split backward graphs ran
        self.last_stats = {"step_time": elapsed, "busy_time": busy, "step_start": start,
                           "bubble_fraction": max(0.0, 1.0 - busy / elapsed) if elapsed else 0.0,
                           "reduce_time": end - reduce_start,
                           "weight_parts": float(sum(stage.weight_parts for stage in self._stages))}
        #: this rank's compute actions of the step: (stage, kind F/B/I/W, microbatch, start, end),
        #: seconds from the step's start (``timeline.measured`` assembles all ranks' into a Timeline)
        self.last_actions = sorted((st.stage_index, kind, mb, a - start, b - start)
                                   for st in self._stages for kind, mb, a, b in st.actions)
        if not self.is_last:
            return None
        return torch.stack([l.detach() for l in losses]).sum()

    # ---------------------------------------------------------------------------------- helpers
    def _microbatch_loss(self, output: torch.Tensor, _target: Any) -> torch.Tensor:
        # Scaling the loss (not .grad afterwards) keeps gradients accumulated before the step intact.
        return output / self.n_microbatches

    def _dummy_target(self) -> torch.Tensor:
        # torch's schedule splits a target per microbatch for its loss_fn; ours lives in the graph.
        return torch.zeros(self.n_microbatches, device=self.device)

    def _flatten(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], target: Any) -> List[torch.Tensor]:
        if not args and not kwargs and target is None:
            if self.is_first:
                raise PipelineError("the first stage needs the batch: call step(*args, **kwargs) on its rank")
            return []
        root = {"args": tuple(args), "kwargs": dict(kwargs), "target": target}
        flat = []
        m = self.n_microbatches
        for info, shape in zip(self._inputs, self._mb_shapes):
            try:
                t = fetch(root, info.path)
            except (KeyError, IndexError, TypeError):
                raise PipelineError(f"step() is missing input {info.name}, which the model was split with") from None
            if not isinstance(t, torch.Tensor):
                raise PipelineError(f"step() input {info.name} is a {type(t).__name__}, expected a tensor")
            convention = ""   # the example conventions confused (whole batch vs one microbatch)?
            if t.dim() and tuple(t.shape[1:]) == shape[1:]:
                if not self._example_is_microbatch and t.shape[0] == m * m * shape[0]:
                    convention = (f"; the batch is n_microbatches times the example given to fxtrain.split, which "
                                  f"takes the whole batch as example (build() cuts it into {m}); to give one "
                                  f"microbatch instead (torch's pipeline(mb_args=...) convention), use "
                                  f"fxtrain.split(model, mb_args=..., mb_kwargs=...)")
                elif self._example_is_microbatch and t.shape[0] == shape[0]:
                    convention = (f"; the example was one microbatch (mb_args/mb_kwargs), so a step takes "
                                  f"n_microbatches={m} of them: a batch of {shape[0] * m}")
            if t.dim() == 0 or t.shape[0] % m:
                raise PipelineError(f"batch size {t.shape[0] if t.dim() else 'of a scalar'} of input {info.name} "
                                    f"is not divisible by n_microbatches={m}{convention}")
            if (t.shape[0] // m,) + tuple(t.shape[1:]) != shape:
                raise PipelineError(f"input {info.name} has shape {tuple(t.shape)}; this runner was built for "
                                    f"microbatches of {shape} ({m} per step, batch {shape[0] * m}); "
                                    f"{convention[2:] or 'pipeline stages have static shapes: build a runner for the new shape'}")
            flat.append(t.to(self.device))
        known = {path_text(i.path) for i in self._inputs}
        for path, leaf in walk(root):
            if isinstance(leaf, torch.Tensor):
                if path_text(path) not in known:
                    raise PipelineError(f"step() got tensor {path_text(path)}, which the model was not split with")
                continue
            # Non-tensor arguments were constants of the captured graph: a different value would
            # silently run the old one.
            try:
                expected = fetch(self._example_root, path)
            except (KeyError, IndexError, TypeError):
                expected = _MISSING
            if expected is _MISSING or type(expected) is not type(leaf) or expected != leaf:
                raise PipelineError(f"step() argument {path_text(path)}={leaf!r} differs from the value the model "
                                    f"was split with ({'absent' if expected is _MISSING else repr(expected)}); "
                                    f"stages are fixed graphs: split again for another value")
        return flat

    def _shared_parameters(self, plan: Plan, captured: Any) -> List[Tuple[str, torch.Size, torch.dtype, bool]]:
        """Parameters held by stages on more than one rank: (name, shape, dtype, held here), in one agreed order.

        Stages on one rank share the very parameter tensor, so their contributions already add up
        in its ``.grad``; only holders on several ranks need the all-reduce.
        """
        holders: Dict[str, List[int]] = {}
        for st in plan.stages:
            for name in st.params:
                holders.setdefault(name, []).append(st.index)
        values = {i.name: i.value for i in captured.inputs}
        shared = []
        for name in sorted(holders):
            stages = holders[name]
            ranks = {self.placement[s] for s in stages}
            if len(stages) > 1:
                logger.info("fxtrain pipeline: stages %s (ranks %s) share %s%s", stages, sorted(ranks), name,
                            "; their gradients are summed after each step" if len(ranks) > 1 else "")
            if len(ranks) > 1:
                shared.append((name, values[name].shape, values[name].dtype, self.group_rank in ranks))
        return shared

    def _snapshot_shared(self) -> List[Optional[torch.Tensor]]:
        params = dict(self.named_parameters())
        out = []
        for name, _, _, here in self._shared:
            g = params[name].grad if here else None
            out.append(None if g is None else g.clone())
        return out

    def _reduce_shared(self, before: List[Optional[torch.Tensor]]) -> None:
        """Sum this step's contribution of every holder of a shared parameter into each holder's grad.

        One all-reduce over the pipeline group; ranks that do not hold a parameter contribute zeros
        (no subgroups to create, so building stays a plain collective over the pipeline's ranks).
        Only this step's contribution is summed, so gradients accumulated before it stay single.
        """
        if not self._shared:
            return
        params = dict(self.named_parameters())
        if len(self._shared) == 1 and before[0] is None:
            # One tensor, no earlier gradient (the usual tied embedding after zero_grad): reduce it
            # in place instead of through a flat copy (tens of MB for a vocabulary-sized weight).
            name, shape, dtype, here = self._shared[0]
            g = params[name].grad if here else None
            if g is None:
                g = torch.zeros(shape, device=self.device, dtype=dtype)
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self._group)
            if here:
                params[name].grad = g
            return
        parts = []
        for (name, shape, dtype, here), prev in zip(self._shared, before):
            if here and params[name].grad is not None:
                g = params[name].grad
                parts.append((g - prev if prev is not None else g).reshape(-1))
            else:
                parts.append(torch.zeros(shape.numel(), device=self.device, dtype=dtype))
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
        offset = 0
        for (name, shape, _, here), prev in zip(self._shared, before):
            n = shape.numel()
            if here:
                p = params[name]
                total = flat[offset:offset + n].view(shape)
                p.grad = total if prev is None else prev + total
            offset += n

    def _store_key(self, rank: int) -> str:
        return f"fxtrain_pipeline/{self._uid}/failed/{rank}"

    def _failure(self, exc: Exception) -> PipelineError:
        """Record a local failure for peers; for a lost peer, say which stage failed if it told us."""
        from ..module import root_cause
        cause = root_cause(exc)
        failed = [st.stage_index for st in self._stages if st.failed_locally]
        index = failed[0] if failed else self.stage_index
        stages = f"stage {index}" if failed or len(self._stages) == 1 else \
            f"stages {', '.join(map(str, self.stage_indices))}"
        here = f"pipeline {stages} (rank {self.rank}, {self.schedule_name})"
        store = _or_none(default_store)
        if failed:
            if store is not None:
                with contextlib.suppress(Exception):
                    store.set(self._store_key(self.rank), f"stage {index} (rank {self.rank}) raised {cause}")
            return PipelineError(f"{here} failed: {cause}")
        peer = None
        if store is not None:
            deadline = time.monotonic() + 2.0
            while peer is None and time.monotonic() < deadline:
                for r in self._ranks:
                    if r != self.rank:
                        try:
                            if store.check([self._store_key(r)]):
                                peer = store.get(self._store_key(r)).decode()
                                break
                        except Exception:
                            deadline = 0
                            break
                else:
                    time.sleep(0.1)
        if peer:
            why = f"peer {peer}"
        elif any(w in cause.lower() for w in ("connection reset", "connection closed", "broken pipe", "closed by peer")):
            why = "a peer rank's process ended without reporting an error (it probably died)"
        else:
            why = "a peer rank did not answer within the timeout (it hangs, or failed without reporting)"
        return PipelineError(f"{here} stopped: {why} (here: {cause}; timeout {self.timeout.total_seconds():g} s)")


_MISSING = object()


def _or_none(read: Callable[..., Any], *args: Any) -> Any:
    try:
        return read(*args)
    except Exception:
        return None
