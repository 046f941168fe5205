"""Benchmark harness behind every performance claim: modes interleaved step by step in one process.

The machines this runs on are shared and noisy, so absolute times drift; ratios between modes that
ran in the same steps, in rotating order, do not. Every mode trains its own identical copy of the
model (same seed) with AdamW on the same batches, so the loss columns double as a parity check.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from . import models
from .options import Options
from .report import format_table
from .runtime.tiered import TRIAL_STEPS
from .torch_private import TORCH_VERSION_TEXT

logger = logging.getLogger("fxtrain")

MODES = ("eager", "compile", "compile:reduce-overhead", "dynamo", "fxtrain", "fxtrain:eager", "fxtrain:inductor",
         "fxtrain:auto")


@dataclass
class BenchConfig:
    model: str = "bert-mlm"
    batch: int = 16
    seq: int = 128
    padding: float = 0.54
    label_density: float = 0.07
    padding_side: str = "right"
    labels_at_end: Optional[float] = None
    # Packed rows instead of padded ones: documents of lengths in this range, several per row
    # (models.packed_batch; padding and label_density then do not apply).
    packed: Optional[Tuple[int, int]] = None
    steps: int = 5
    warmup: int = 1
    modes: Sequence[str] = ("eager", "compile", "fxtrain")
    lr: float = 1e-4
    seed: int = 0
    device: str = "cpu"   # where every mode trains ("cuda", "cuda:1", ...); batches are drawn on the CPU
    # executor="auto": wait for the background compiles after the second step (untimed), so that the
    # timed steps show the compiled tier whatever the machine's compile speed.
    await_compiles: bool = False
    # Every mode's forward under torch.autocast(device type, this dtype): "bf16" or "fp16"; None: float32.
    autocast: Optional[str] = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; available: {', '.join(MODES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"unknown autocast {self.autocast!r}; one of: {', '.join(k for k in AUTOCAST if k)}")
        if self.model not in models.PRESETS:
            raise ValueError(f"unknown model {self.model!r}; built-in models: {', '.join(sorted(models.PRESETS))}")
        try:
            torch.device(self.device)  # an unparsable device fails here, before any model is built
        except RuntimeError as e:
            raise ValueError(f"unknown device {self.device!r}: {e}") from None


@dataclass(frozen=True)
class Workload:
    """A named benchmark setting: the numbers docs/benchmarks.md quotes, reproducible by name."""
    description: str
    settings: Dict[str, Any]

    def config(self, **overrides: Any) -> BenchConfig:
        return BenchConfig(**{**self.settings, **overrides})


WORKLOADS: Dict[str, Workload] = {
    "demo": Workload("the demo's BERT-MLM (DESIGN §7): 16 x 128, 54% padding, 7% labels", dict(model="bert-mlm")),
    "distilbert-mlm": Workload("DistilBERT-MLM dim 320, 3 layers: 12 x 160, 50% padding, 15% labels",
                               dict(model="distilbert-320", batch=12, seq=160, padding=0.5, label_density=0.15)),
    "bert-base-mlm": Workload("BERT-base dimensions: 8 x 128, 50% padding, 15% labels",
                              dict(model="bert-base", batch=8, seq=128, padding=0.5, label_density=0.15)),
    "roberta-mlm": Workload("RoBERTa-MLM hidden 256, 4 layers: 16 x 128, 54% padding, 7% labels",
                            dict(model="roberta-mlm")),
    "gpt2-sft": Workload("GPT-2 causal LM, 16 x 128, right padding 30%, loss on the last quarter of each sequence",
                         dict(model="gpt2", batch=16, seq=128, padding=0.3, labels_at_end=0.25)),
    "bert-mlm-long": Workload("long-row BERT-MLM hidden 256, 4 layers: 4 x 1024, 60% padding, 15% labels",
                              dict(model="bert-mlm-1024", batch=4, seq=1024, padding=0.6, label_density=0.15)),
    "llama-sft": Workload("Llama-style causal LM (rotary, SwiGLU; hidden 256, 4 layers, vocab 32000): 16 x 128, "
                          "right padding 50%, loss on the last half of each sequence (the answer)",
                          dict(model="llama-small", batch=16, seq=128, padding=0.5, labels_at_end=0.5)),
    "llama-packed": Workload("Llama-style LM hidden 256, 4 layers: 4 x 1024 packed rows of documents of 32..512 "
                             "tokens (DataCollatorWithFlattening's layout), every label but documents' first",
                             dict(model="llama-small", batch=4, seq=1024, packed=(32, 512))),
    "llama-packed-4k": Workload("the llama-packed model and documents in longer rows: 1 x 4096 packed tokens",
                                dict(model="llama-small", batch=1, seq=4096, packed=(32, 512))),
    "gpt2-dense": Workload("dense GPT-2 LM step: 8 x 128, no padding, every label",
                           dict(model="gpt2", batch=8, seq=128, padding=0.0)),
    # GPU-sized (issue 17): what a GPU user trains. Each runs in float32 and with --autocast bf16.
    "gpu-bert-base-mlm": Workload("BERT-base MLM: 32 x 512, 50% padding, 15% labels",
                                  dict(model="bert-base", batch=32, seq=512, padding=0.5, label_density=0.15)),
    "gpu-gpt2-small-sft": Workload("GPT-2 small SFT: 16 x 1024, right padding 30%, loss on the answer (the last "
                                   "half of each sequence)",
                                   dict(model="gpt2-small", batch=16, seq=1024, padding=0.3, labels_at_end=0.5)),
    "gpu-llama-packed": Workload("Llama-style LM (hidden 1024, 8 layers, 16 heads, vocab 32000) on packed "
                                 "documents of 32..512 tokens: 8 x 4096",
                                 dict(model="llama-1024", batch=8, seq=4096, packed=(32, 512))),
    "gpu-gpt2-small-dense": Workload("dense GPT-2 small: 16 x 1024, no padding, every label",
                                     dict(model="gpt2-small", batch=16, seq=1024, padding=0.0)),
}


def workload_table() -> str:
    return format_table(["workload", "what"], [[name, w.description] for name, w in WORKLOADS.items()])


def flop_ideal_ratio(config: BenchConfig) -> float:
    """Eager's FLOPs over fxtrain's for one step on the benchmark's first batch (costed by the
    profiler, on the batch's real values): the speedup a step would reach if time followed FLOPs.
    Every pass the batch calls for counts, also one an accelerator's launch cost turns off
    (cost/launches.py): if time followed FLOPs, launches would cost nothing."""
    from .profile import profile
    model = models.build(config.model, seed=config.seed)
    batch = _batches(config, 1)[0]
    dense = profile(model, optimizations=False, reuse=False, **batch)
    sparse = profile(model, optimizations="all", reuse=False, **batch)
    uncosted = sorted({u.op for u in sparse.unknown_ops} - {u.op for u in dense.unknown_ops})
    if uncosted:   # an op without a FLOP count makes fxtrain's step look cheaper than it is
        logger.warning("FLOP-ideal ratio is an upper bound: fxtrain's step has ops the profiler cannot cost: %s",
                       ", ".join(uncosted))
    return dense.flops / sparse.flops


@dataclass
class ModeResult:
    mode: str
    first_step_s: float = 0.0
    step_s: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    tier: str = "-"                      # executor="auto": the tier that ran the last step
    tiers: List[str] = field(default_factory=list)   # capture_info().tiers at the end
    runtimes: List[str] = field(default_factory=list)   # capture_info().runtimes at the end: how each step ran
    ops_per_step: Optional[int] = None       # aten ops dispatched by one step after the timed ones
    kernels_per_step: Optional[int] = None   # device kernels it launched (CUDA only)

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.step_s)

    @property
    def min_ms(self) -> float:
        return 1000 * min(self.step_s)


@dataclass
class BenchResult:
    config: BenchConfig
    results: Dict[str, ModeResult]
    densities: Dict[str, float]
    optimizations: Dict[str, Dict[str, str]] = field(default_factory=dict)  # fxtrain mode -> pass -> why
    flop_ideal: Optional[float] = None   # flop_ideal_ratio(config), when asked for

    def ratio(self, mode: str, baseline: str) -> Optional[float]:
        if mode not in self.results or baseline not in self.results:
            return None
        return self.results[baseline].median_ms / self.results[mode].median_ms

    def max_loss_diff(self, mode: str, baseline: str = "eager") -> Optional[float]:
        if baseline not in self.results:
            return None
        a, b = self.results[mode].losses, self.results[baseline].losses
        return max(abs(x - y) for x, y in zip(a, b))

    def table(self) -> str:
        headers = ["mode", "first step s", "median ms", "min ms", "vs eager", "vs compile", "max |loss - eager|",
                   "ops/step", "kernels/step", "tier at end"]
        rows = []
        for name, r in self.results.items():
            vs_eager, vs_compile, diff = self.ratio(name, "eager"), self.ratio(name, "compile"), self.max_loss_diff(name)
            rows.append([name, r.first_step_s, r.median_ms, r.min_ms,
                         f"{vs_eager:.2f}x" if vs_eager else "-", f"{vs_compile:.2f}x" if vs_compile else "-",
                         f"{diff:.2e}" if diff is not None else "-", _count(r.ops_per_step),
                         _count(r.kernels_per_step), r.tier])
        c = self.config
        packed = f"packed documents of {c.packed[0]}..{c.packed[1]} tokens, " if c.packed else ""
        title = (f"{c.model}: batch {c.batch} x seq {c.seq}, {packed}padding {self.densities['padding']:.0%}, "
                 f"labelled {self.densities['labelled']:.1%}; {c.steps} timed steps after {c.warmup} warm-up, "
                 f"modes interleaved, on {c.device}" + (f", under {c.autocast} autocast" if c.autocast else ""))
        lines = [title, format_table(headers, rows)]
        if self.flop_ideal is not None:
            lines.append(f"FLOP-ideal fxtrain vs eager (eager's step FLOPs / fxtrain's, first batch): {self.flop_ideal:.2f}x")
        for mode, passes in self.optimizations.items():
            lines.append(f"Optimizations ({mode}):")
            lines.extend(f"  {name:<20} {why}" for name, why in passes.items())
        for mode, r in self.results.items():
            for what, entries in (("Tiers", r.tiers), ("Runtimes", r.runtimes)):
                if entries:
                    lines.append(f"{what} ({mode}):")
                    lines.extend(f"  {line}" for line in entries)
        return "\n".join(lines)

    def to_json(self) -> Dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config) | {"modes": list(self.config.modes)},
            "densities": self.densities,
            "optimizations": self.optimizations,
            "flop_ideal": self.flop_ideal,
            "torch": TORCH_VERSION_TEXT,
            "modes": {name: {"first_step_s": r.first_step_s, "median_ms": r.median_ms, "min_ms": r.min_ms,
                             "step_s": r.step_s, "losses": r.losses, "vs_eager": self.ratio(name, "eager"),
                             "vs_compile": self.ratio(name, "compile"),
                             "max_loss_diff_vs_eager": self.max_loss_diff(name), "tier": r.tier, "tiers": r.tiers,
                             "runtimes": r.runtimes,
                             "ops_per_step": r.ops_per_step, "kernels_per_step": r.kernels_per_step}
                      for name, r in self.results.items()},
        }


def _count(n: Optional[int]) -> str:
    return "-" if n is None else str(n)


def count_step(fn: Callable[..., Any], opt: torch.optim.Optimizer, batch: Dict[str, torch.Tensor],
               device: torch.device, autocast: Optional[str] = None) -> Tuple[int, Optional[int]]:
    """(aten ops dispatched, device kernels launched) by one training step, from ``torch.profiler``.

    An op counts once where Python or a graph dispatched it: an aten op called inside another aten op
    (``aten::linear`` calling ``aten::addmm``) is that op's work, not a second dispatch. Kernels are
    the profiler's device activities other than copies and fills (CUDA; None elsewhere). On a GPU
    a step that dispatches many small ops is bound by the host, whatever FLOPs it saves: these are
    the numbers that say so. Not timed: the profiler slows the step it watches."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _step(fn, opt, batch, autocast)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::")
              and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    if device.type != "cuda":
        return ops, None
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset", "[memory]")))
    return ops, kernels


def _wrap(mode: str, model: torch.nn.Module) -> Callable[..., Any]:
    """The callable a mode trains: the model itself, torch.compile of it, or a TrainModule.

    ``compile:reduce-overhead`` is torch.compile's CUDA-graph mode: on a GPU its row says what
    replaying a step's launches as CUDA graphs gains where the host bounds the step (the demo), the
    measure issue 17 asks for before fxtrain's compiled tier gets CUDA graphs; elsewhere it is
    torch.compile's default. ``dynamo`` is torch.compile with the "eager" backend: dynamo's trace,
    whose graph then runs as eager does. Its first step is what every capture pays before fxtrain's own work (a sizeable part
    of fxtrain's first step on a deep model: BERT-base's 12 layers), so the two first steps side by
    side say which of them a slow start is."""
    from .module import TrainModule

    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model)
    if mode == "compile:reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if mode == "dynamo":
        return torch.compile(model, backend="eager")
    return TrainModule(model, Options(executor=mode.split(":", 1)[1]) if ":" in mode else Options())


def tier_ran(fn: Any, wait: bool = True) -> str:
    """executor="auto": the tier of the capture most steps ran (others are other shapes), with the
    step it switched at (steps counted from 0, the capturing one); '-' for a mode without tiers.
    ``wait=False`` between steps: waiting for a partition there would hold the loop up (~50 s
    on a loaded machine), which a training loop never does, and change what the next steps run."""
    info = fn.capture_info(wait=wait) if hasattr(fn, "capture_info") else None
    tiered = [r.tier for r in info.records if r.tier is not None] if info is not None else []
    if not tiered:
        return "-"
    tier = max(tiered, key=lambda t: t.calls)
    if tier.state == "compiled":
        return f"inductor since step {tier.since_step}"
    if tier.since_step is not None:   # timed slower than eager's: back on it
        return f"eager (inductor steps {tier.since_step}-{tier.since_step + TRIAL_STEPS - 1})"
    return "eager, compiling" if tier.state == "compiling" else "eager"


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused AdamW (one kernel over all parameters) for every mode alike: the per-tensor loop would
    add the same ~0.5 s to every step of BERT-base on this machine and hide what the modes differ in."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except (RuntimeError, ValueError):  # a device without a fused kernel
        return torch.optim.AdamW(model.parameters(), lr=lr)


AUTOCAST = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _step(fn: Callable[..., Any], opt: torch.optim.Optimizer, batch: Dict[str, torch.Tensor],
          autocast: Optional[str] = None) -> float:
    device_type = next(v for v in batch.values() if isinstance(v, torch.Tensor)).device.type
    with torch.autocast(device_type, dtype=AUTOCAST[autocast], enabled=autocast is not None):
        out = fn(**batch)
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())  # on an accelerator this waits for the step: the timing covers its work


def _batches(config: BenchConfig, n: int) -> List[Dict[str, torch.Tensor]]:
    preset = models.PRESETS[config.model]
    g = torch.Generator().manual_seed(config.seed)
    if config.packed is not None:
        return [models.packed_batch(config.batch, config.seq, preset.vocab, documents=config.packed,
                                    pad_id=preset.pad_id, generator=g) for _ in range(n)]
    return [models.synthetic_batch(preset.kind, config.batch, config.seq, preset.vocab, padding=config.padding,
                                   label_density=config.label_density, pad_id=preset.pad_id,
                                   padding_side=config.padding_side, labels_at_end=config.labels_at_end,
                                   generator=g) for _ in range(n)]


def run_benchmark(config: BenchConfig, progress: bool = True) -> BenchResult:
    device = torch.device(config.device)
    base = models.build(config.model, seed=config.seed).to(device)
    preset = models.PRESETS[config.model]
    n_batches = 1 + config.warmup + config.steps
    batches = _batches(config, n_batches)
    mask = torch.stack([b.get("attention_mask", torch.ones_like(b["input_ids"])) for b in batches])
    labels = torch.stack([b["labels"] for b in batches]) if preset.kind != "cls" else None
    densities = {"padding": 1 - mask.float().mean().item(),
                 "labelled": (labels != -100).float().mean().item() if labels is not None else 1.0}
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]

    runs: Dict[str, Any] = {}
    results = {m: ModeResult(m) for m in config.modes}
    for mode in config.modes:
        model = copy.deepcopy(base)
        runs[mode] = (_wrap(mode, model), _optimizer(model, config.lr))

    total = len(config.modes) * n_batches
    with tqdm(total=total, desc=f"bench {config.model}", disable=not progress, unit="step") as bar:
        for i, batch in enumerate(batches):
            if i == 2 and config.await_compiles:
                bar.set_postfix_str("waiting for the background compiles")
                for fn, _ in runs.values():
                    if hasattr(fn, "capture_info"):
                        fn.capture_info().wait_for_compiles()
            order = list(config.modes)
            k = i % len(order)
            order = order[k:] + order[:k]  # rotate so no mode always runs right after another
            for mode in order:
                fn, opt = runs[mode]
                t0 = time.perf_counter()
                loss = _step(fn, opt, batch, config.autocast)
                dt = time.perf_counter() - t0
                r = results[mode]
                r.losses.append(loss)
                if i == 0:
                    r.first_step_s = dt
                elif i > config.warmup:
                    r.step_s.append(dt)
                r.tier = tier_ran(fn, wait=False)
                tiers = "".join(f"; {m}: {t.tier}" for m, t in results.items() if t.tier != "-")
                bar.set_postfix_str(f"{mode} {dt * 1000:.0f} ms{tiers}")
                bar.update()
    for mode, (fn, opt) in runs.items():   # one more step each, counted, after the timed ones
        results[mode].ops_per_step, results[mode].kernels_per_step = count_step(fn, opt, batches[-1], device, config.autocast)
    optimizations = {mode: dict(fn.capture_info().optimizations) for mode, (fn, _) in runs.items()
                     if hasattr(fn, "capture_info")}
    for mode, (fn, _) in runs.items():
        results[mode].tier = tier_ran(fn)
        results[mode].tiers = list(fn.capture_info().tiers) if hasattr(fn, "capture_info") else []
        results[mode].runtimes = list(fn.capture_info().runtimes) if hasattr(fn, "capture_info") else []
    return BenchResult(config, results, densities, optimizations)


def write_json(result: BenchResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=2)
