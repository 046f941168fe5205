"""Differential fuzzing of edge batches: fxtrain against eager PyTorch, batch by batch.

The sparsity passes are decided on the capturing batch and must stay exact on every later one,
whatever it looks like. A case here is a small HF model (built from a config, random weights) with
a loss, trained by ``fxtrain.TrainModule`` with default options and by an untouched eager copy. Its
first batch makes the passes fire (asserted); later batches roam over the edges a real loop meets:
batch sizes 1..8, lengths 1..the model's positions, padding 0-100% per row (all-padding rows
included) on either side, label densities from none through exactly one to all, labels on padding,
a padding id among real tokens, attention masks as long/bool/float, and, for losses computed by
``ModuleWithLoss``, ``ignore_index`` other than -100, ``label_smoothing`` and ``reduction="sum"``.
An image classifier (HF Swin) roams over batch sizes 1..8 and a second image size: the sizes policy's
recaptures, where no sparsity pass applies.

A tier case (``Case.tier``, ``--tier-switch``) trains with ``executor="auto"`` and crosses the
switch to inductor's graphs at a known batch: its capture is made on a dense batch (no pass fires:
a sparsity pass's data-dependent sizes keep a capture on the eager executor), the batches up to and
past the switch keep that shape (their padding and labels roam), the compile is awaited before
batch ``TIER_WAIT`` (``CaptureInfo.wait_for_compiles``: the switch step does not depend on how fast
the machine compiles), and which tier ran each batch is read from the capture's ``Tier``. Batches
the compiled graphs ran are held to the inductor tolerance (fusion reorders float sums).

Per batch the oracle is eager: loss, returned tensors (read before or after the optimizer step),
every gradient (NaN positions included), parameters after an AdamW step. Both copies are then
re-synchronised so a difference is charged to the batch that made it. The bookkeeping also flags a
fallback to eager and a capture on an input signature already seen. Every finding carries its seed
and a one-line command that replays the case up to the failing batch.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import models
from .capture.backend import Plugins
from .cost.step import loss_of
from .errors import Error
from .extras import require
from .module import TrainModule
from .module_with_loss import ModuleWithLoss
from .options import ENV_PREFIX, Options
from .runtime.tiered import TRIAL_STEPS

VOCAB = 300          # above cross_entropy_grad's 256-class floor, so that backward pass fires too
POSITIONS = 64
MODELS: Dict[str, Tuple[Callable[[], torch.nn.Module], str, int]] = {
    # name: (build, batch kind, padding id)
    "bert-mlm": (lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=VOCAB, max_positions=POSITIONS),
                 "mlm", 0),
    "distilbert-mlm": (lambda: _distilbert(), "mlm", 0),
    "gpt2-clm": (lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=VOCAB, positions=POSITIONS), "clm", 0),
    "roberta-cls": (lambda: _roberta_cls(), "cls", 1),
    # Batch sizes 1..8 and now and then another image size: HF Swin's window partition is where a
    # symbolic recapture once stalled (issue #31); no sparsity pass applies to it.
    "swin-image": (lambda: _swin(), "image", 0),
}
# By name only: Longformer is slow to capture (dozens of graphs: its attention graph-breaks); the
# Llama (rotary embeddings, 4 query heads on 2 key/value heads) keeps the default run's time.
EXTRA_MODELS: Dict[str, Tuple[Callable[[], torch.nn.Module], str, int]] = {
    "longformer-mlm": (lambda: _longformer(), "mlm", 1),
    "llama-clm": (lambda: models.llama_lm(hidden=32, layers=2, heads=4, vocab=VOCAB, kv_heads=2), "clm", 0),
    # Attention inputs that pass through more than layout ops (docs/sparsity.md): Qwen3's per-head
    # q/k norm before the head transpose, Phi-3's fused q/k/v and gate/up projections, Mistral's
    # sliding-window cache, GLM-4's interleaved rotary embedding. Not Gemma 4: its gradients are
    # large (scaled embeddings), and varlen attention's float noise on them (2.5x eager's own against
    # float64) passes ATOL now and then (1.6e-5 on one embedding element in 16 batches of seed 301).
    "qwen3-clm": (lambda: _hf_clm("Qwen3"), "clm", 0),
    "phi3-clm": (lambda: _hf_clm("Phi3"), "clm", 0),
    "mistral-clm": (lambda: _hf_clm("Mistral"), "clm", 0),
    "glm4-clm": (lambda: _hf_clm("Glm4"), "clm", 0),
    # A mixture of experts: its expert block as one row op for padding elimination (passes/expert_blocks.py).
    "mixtral-clm": (lambda: _hf_clm("Mixtral", num_local_experts=4, num_experts_per_tok=2), "clm", 0),
    # Attention in eager ops (passes/eager_attention.py), re-padded around: Gemma 2's softcapped
    # scores; gpt-oss's sink column, its sliding-window cache and its experts' in-place biases.
    "gemma2-clm": (lambda: _hf_clm("Gemma2"), "clm", 0),
    "gptoss-clm": (lambda: _hf_clm("GptOss", num_local_experts=4, num_experts_per_tok=2), "clm", 0),
    # A plain eager block is the SDPA it computes and runs on the real tokens sequence by sequence.
    "llama-eager-clm": (lambda: _hf_clm("Llama", attn_implementation="eager"), "clm", 0),
    # Heads 3 * dim features apart in one fused projection, a partial rotary embedding (GPT-NeoX).
    "gptneox-clm": (lambda: _hf_clm("GPTNeoX", rotary_pct=0.5), "clm", 0),
}
IMAGE_LABELS = 5
# Models the passes are checked to fire on (on the capturing batch).
FIRES = (*(name for name, (_, kind, _) in MODELS.items() if kind != "image"), "llama-clm", "qwen3-clm", "phi3-clm",
         "mistral-clm", "glm4-clm", "mixtral-clm", "gemma2-clm", "llama-eager-clm", "gptneox-clm",
         "gptoss-clm")
LOSSES = ("model", "custom")   # the model's own loss from `labels`, or one given to ModuleWithLoss
PASSES_FIRING = {"mlm": ("label_sparsity", "padding_elimination"), "clm": ("label_sparsity", "padding_elimination"),
                 "cls": ("upstream_slicing", "padding_elimination"), "image": ()}
ATOL, RTOL = 1e-5, 1e-4
COMPILED_ATOL = ATOL * 10   # the suite's inductor tolerance (tests/conftest.py): fused sums reorder
# Tier cases: the compile is awaited before this batch; the capture then times TRIAL_STEPS steps on
# the eager executor and the next runs the compiled graphs (runtime/tiered.py: Tier._tick).
TIER_WAIT = 2
TIER_SWITCH = TIER_WAIT + TRIAL_STEPS
# The compiled graphs then run the capture's next TRIAL_STEPS calls whatever their step time (at
# the next one a capture they measured slower on goes back to eager: timing, so no batch of a tier
# case calls it); from there the batches roam to other shapes (recaptures with tiers of their own).
TIER_ROAM_FROM = TIER_SWITCH + TRIAL_STEPS


def _distilbert() -> torch.nn.Module:
    require("transformers", "the fuzzer's models")
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=128, pad_token_id=0,
                           max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0)
    return DistilBertForMaskedLM(cfg)


def _longformer() -> torch.nn.Module:
    require("transformers", "the fuzzer's models")
    from transformers import LongformerConfig, LongformerForMaskedLM
    cfg = LongformerConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, attention_window=4, max_position_embeddings=POSITIONS + 2,
                           pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return LongformerForMaskedLM(cfg)


def _hf_clm(family: str, **extra: Any) -> torch.nn.Module:
    require("transformers", "the fuzzer's models")
    import transformers
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=POSITIONS, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attention_dropout=0.0, **extra)
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


def _swin() -> torch.nn.Module:
    # problem_type set up front, as for the RoBERTa: left None, HF writes it on the first call, and
    # any capture made before the write (ours or torch.compile's) is made again on the same sizes
    # (a guard on the model's own config; found as a capture on a signature already seen).
    model = models.swin_cls(labels=IMAGE_LABELS)
    model.config.problem_type = "single_label_classification"
    return model


def _roberta_cls() -> torch.nn.Module:
    require("transformers", "the fuzzer's models")
    from transformers import RobertaConfig, RobertaForSequenceClassification
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=POSITIONS + 2, pad_token_id=1, num_labels=3,
                        problem_type="single_label_classification", hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return RobertaForSequenceClassification(cfg)


@dataclass(frozen=True)
class LossSpec:
    """The loss of a case: the model's own (ignore -100, mean) or cross_entropy with these settings."""

    custom: bool
    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"

    def describe(self) -> str:
        if not self.custom:
            return "model's own loss"
        return (f"cross_entropy(ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r})")


def _custom_loss(kind: str, spec: LossSpec, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    if kind == "clm":   # next-token prediction: HF's shift (of the labels; the logits stay whole)
        labels = F.pad(labels, (0, 1), value=spec.ignore_index)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=spec.ignore_index,
                           label_smoothing=spec.label_smoothing, reduction=spec.reduction)


@dataclass(frozen=True)
class Case:
    model: str
    loss: str
    seed: int
    tier: bool = False   # executor="auto", across the switch to the compiled graphs

    def repro(self, batches: int) -> str:
        return (f"python -m fxtrain.fuzz --model {self.model} --loss {self.loss} --seed {self.seed} --batches {batches}"
                + (" --tier-switch" if self.tier else ""))


@dataclass
class Finding:
    """Everything that differed from eager on one batch."""

    case: Case
    batch: int                          # index in the case's sequence (0: the capturing batch)
    problems: List[Tuple[str, str]]     # (what, detail)
    batch_about: str

    def __str__(self) -> str:
        shown = [f"  {what}: {detail}" for what, detail in self.problems[:3]]
        if len(self.problems) > 3:
            shown.append(f"  ... and {len(self.problems) - 3} more")
        tier = "/tier" if self.case.tier else ""
        return "\n".join([f"{self.case.model}/{self.case.loss}{tier} seed {self.case.seed} batch {self.batch} "
                          f"({self.batch_about}):", *shown, f"  repro: {self.case.repro(self.batch + 1)}"])


@dataclass
class CaseResult:
    case: Case
    loss: LossSpec
    batches: int = 0
    captures: int = 0
    signatures: int = 0
    dense_batches: Dict[str, int] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)
    seconds: float = 0.0
    tiers: List[str] = field(default_factory=list)   # tier cases: per batch, "eager" or "inductor"


# ------------------------------------------------------------------------------------------- batches
def _loss_spec(case: Case) -> LossSpec:
    if case.loss == "model":
        return LossSpec(custom=False)
    rng = random.Random(f"{case.seed}/loss")
    return LossSpec(custom=True, ignore_index=rng.choice([-100, -1, -7]),
                    label_smoothing=rng.choice([0.0, 0.0, 0.1]), reduction=rng.choice(["mean", "sum"]))


def first_batch(kind: str, pad_id: int, ignore: int, rng: random.Random) -> Tuple[Dict[str, torch.Tensor], str]:
    """A batch the passes fire on: right padding, ~40% padding, ~15% labels, long mask."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    batch = models.synthetic_batch(kind, 4, 32, VOCAB, padding=0.4, label_density=0.15, pad_id=pad_id, generator=g)
    if kind in ("mlm", "clm") and ignore != -100:
        batch["labels"] = batch["labels"].masked_fill(batch["labels"] == -100, ignore)
    return batch, "capturing batch: 4x32, right padding, 40% padding, 15% labels"


def dense_batch(kind: str, pad_id: int, ignore: int, rng: random.Random) -> Tuple[Dict[str, torch.Tensor], str]:
    """No padding, every position labelled, new sizes: the next capture has the passes off, and the
    batches after it roam over a graph that was not rewritten."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    batch = models.synthetic_batch(kind, 3, 24, VOCAB, padding=0.0, label_density=1.0, pad_id=pad_id, generator=g)
    return batch, "dense batch: 3x24, no padding, every position labelled"


def roaming_batch(kind: str, pad_id: int, ignore: int, rng: random.Random, other_mask: torch.dtype,
                  shape: Optional[Tuple[int, int]] = None) -> Tuple[Dict[str, Any], str]:
    """One batch from the edges: every choice is drawn from ``rng`` and summarised in the text.
    ``shape``: this batch size and length, a long mask and the usual outputs (one input signature:
    the same capture runs it), only the contents roam."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    if shape is None:
        b = rng.randint(1, 8)
        s = rng.choice([1, 2, rng.randint(1, 16), rng.randint(1, POSITIONS), POSITIONS])
    else:
        b, s = shape
    side = rng.choice(["right", "left"])
    lengths = []
    for _ in range(b):
        pick = rng.random()
        lengths.append(0 if pick < 0.1 else s if pick < 0.35 else rng.randint(1, s))
    length = torch.tensor(lengths)
    pos = torch.arange(s).expand(b, s)
    real = pos < length[:, None] if side == "right" else pos >= (s - length)[:, None]
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    ids = torch.where(ids == pad_id, (pad_id + 1) % VOCAB, ids)
    notes = [f"{b}x{s}", f"{side} padding", f"rows {lengths}"]
    if rng.random() < 0.25 and bool(real.any()):       # the padding id as a real token
        where = real & (torch.rand(b, s, generator=g) < 0.2)
        ids = torch.where(where, torch.full_like(ids, pad_id), ids)
        notes.append("pad id among real tokens")
    ids = torch.where(real, ids, torch.full_like(ids, pad_id))
    # Mostly long; each case's other dtype now and then (a dtype is a new input schema: a capture).
    mask_dtype = torch.long if shape is not None or rng.random() < 0.8 else other_mask
    batch: Dict[str, Any] = {"input_ids": ids, "attention_mask": real.to(mask_dtype)}
    if mask_dtype != torch.long:
        notes.append(f"{str(mask_dtype).split('.')[-1]} mask")
    if shape is None and rng.random() < 0.05:
        batch["output_hidden_states"] = True    # more returned tensors (and, once, HF's hook-installing break)
        notes.append("output_hidden_states")
    if kind == "cls":
        labels = torch.randint(0, 3, (b,), generator=g)
        if ignore != -100 and rng.random() < 0.3:
            labels = labels.masked_fill(torch.rand(b, generator=g) < 0.5, ignore)
            notes.append("some rows ignored")
        batch["labels"] = labels
        return batch, ", ".join(notes)
    density = rng.choice(["none", "one", "all", "random", "random"])
    on_padding = rng.random() < 0.2
    allowed = torch.ones(b, s, dtype=torch.bool) if on_padding else real
    score = torch.rand(b, s, generator=g).masked_fill(~allowed, 2.0).flatten()
    n_allowed = int(allowed.sum())
    count = {"none": 0, "one": min(1, n_allowed), "all": n_allowed,
             "random": int(rng.random() * n_allowed)}[density]
    labels = torch.full((b * s,), ignore, dtype=torch.long)
    chosen = score.argsort()[:count]
    labels[chosen] = torch.randint(0, VOCAB, (count,), generator=g)
    batch["labels"] = labels.view(b, s)
    notes.append(f"labels: {density} ({count})" + (", on padding too" if on_padding else ""))
    return batch, ", ".join(notes)


def image_batch(first: bool, ignore: int, rng: random.Random) -> Tuple[Dict[str, torch.Tensor], str]:
    """Images: the capturing batch 4 x 32 px, then batch sizes 1..8, a sixth of them at 48 px."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    b, size = (4, 32) if first else (rng.randint(1, 8), 48 if rng.random() < 1 / 6 else 32)
    batch = models.image_batch(b, size, IMAGE_LABELS, generator=g)
    notes = [f"{b} images of {size}x{size}"]
    if ignore != -100 and rng.random() < 0.3:
        batch["labels"] = batch["labels"].masked_fill(torch.rand(b, generator=g) < 0.5, ignore)
        notes.append("some rows ignored")
    return batch, ", ".join(notes)


def batches(case: Case, kind: str, pad_id: int, ignore: int) -> Iterator[Tuple[Dict[str, torch.Tensor], str]]:
    rng = random.Random(f"{case.seed}/{case.model}/{case.loss}/batches")
    if case.tier:
        if kind == "image":
            raise ValueError(f"{case.model}: tier cases are text models' (a dense capturing batch)")
        yield from _tier_batches(kind, pad_id, ignore, rng)
    if kind == "image":
        yield image_batch(True, ignore, rng)
        while True:
            yield image_batch(False, ignore, rng)
    yield first_batch(kind, pad_id, ignore, rng)
    other_mask = rng.choice([torch.bool, torch.float])
    if rng.random() < 0.5:  # the next capture (new sizes: symbolic) is made on a dense batch
        yield dense_batch(kind, pad_id, ignore, rng)
    while True:
        yield roaming_batch(kind, pad_id, ignore, rng, other_mask)


def _tier_batches(kind: str, pad_id: int, ignore: int,
                  rng: random.Random) -> Iterator[Tuple[Dict[str, torch.Tensor], str]]:
    """A dense capturing batch, then its shape with roaming contents up to TIER_ROAM_FROM, then
    batches of any shape."""
    first, about = dense_batch(kind, pad_id, ignore, rng)
    yield first, about.replace("dense batch", "capturing batch (tier)")
    shape = tuple(first["input_ids"].shape)
    other_mask = rng.choice([torch.bool, torch.float])
    for _ in range(1, TIER_ROAM_FROM):
        yield roaming_batch(kind, pad_id, ignore, rng, other_mask, shape=shape)
    while True:
        yield roaming_batch(kind, pad_id, ignore, rng, other_mask)


# ------------------------------------------------------------------------------------------ oracle
def _tensors(out: Any, prefix: str = "out") -> Dict[str, torch.Tensor]:
    """Every tensor an output holds, by path (a ModelOutput, a tuple, a tensor)."""
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    items: Sequence[Tuple[Any, Any]]
    if hasattr(out, "items"):
        items = list(out.items())
    elif hasattr(out, "layers"):   # a transformers Cache: per layer keys and values
        items = [(f"{i}.{kv}", getattr(layer, kv, None)) for i, layer in enumerate(out.layers)
                 for kv in ("keys", "values")]
    elif isinstance(out, (tuple, list)):
        items = list(enumerate(out))
    else:
        return {}
    found: Dict[str, torch.Tensor] = {}
    for k, v in items:
        found.update(_tensors(v, f"{prefix}.{k}"))
    return found


def _adam_slack(opt: torch.optim.Optimizer, p: torch.Tensor, gap: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """How far apart AdamW's step may put two equal weights whose gradients differ by ``gap`` (within
    the gradient tolerance, already checked): the step ``lr * m_hat / (sqrt(v_hat) + eps)`` moves by
    at most ``2 * lr * (1 - beta1) / bias1 / (sqrt(v_hat) + eps)`` per unit of gradient (the first
    term of its derivative, bounded twice over for the second, through v). A gradient near eps makes
    that large: HF Gemma 4's last layer has q/k projection gradients of ~1e-6, where float noise of
    2e-8 moved weights 2e-5 apart after one step. Read after ``opt.step()``."""
    state = opt.state.get(p, {})
    if gap is None or "exp_avg_sq" not in state:
        return None
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    (beta1, beta2), step = group["betas"], float(state["step"])
    v_hat = state["exp_avg_sq"] / (1 - beta2 ** step)
    return 2 * group["lr"] * (1 - beta1) / (1 - beta1 ** step) * gap / (v_hat.sqrt() + group["eps"])


def _differs(a: Any, b: Any, atol: float = ATOL, slack: Optional[torch.Tensor] = None) -> Optional[str]:
    """``slack``: per element, added to the tolerance (:func:`_adam_slack`)."""
    if (a is None) != (b is None):
        return f"present {a is not None} vs eager {b is not None}"
    if a is None:
        return None
    a = a.detach() if isinstance(a, torch.Tensor) else a
    b = b.detach() if isinstance(b, torch.Tensor) else b
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
    if slack is not None and bool(((a - b).abs() <= atol + RTOL * b.abs() + slack).all()):
        return None
    try:
        torch.testing.assert_close(a, b, atol=atol, rtol=RTOL, equal_nan=True)
    except AssertionError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return "; ".join(lines[:3])
    return None


class _Pair:
    """The fxtrain model and its eager twin, with their optimizers."""

    def __init__(self, case: Case, loss: LossSpec, device: torch.device = torch.device("cpu")) -> None:
        build, self.kind, self.pad_id = {**MODELS, **EXTRA_MODELS}[case.model]
        torch.manual_seed(case.seed)
        model = build().to(device)  # built on the CPU (same weights everywhere), trained on ``device``
        self.device = device
        if loss.custom:
            model = ModuleWithLoss(model, functools.partial(_custom_loss, self.kind, loss))
        self.ref = copy.deepcopy(model)
        # The launch model would turn the passes off for models this small (cost/launches.py): the
        # fuzzer keeps them, since what they compute is what it tests (capture/backend.py: Plugins).
        self.tm = TrainModule(model, Options(executor="auto") if case.tier else None,
                              plugins=Plugins(weigh_launches=False))
        self.initial = copy.deepcopy(self.ref.state_dict())
        self.new_optimizers()

    def new_optimizers(self) -> None:
        # eps 1e-6: Adam divides by sqrt(v) + eps, which turns float noise on a zero-true gradient
        # (1e-10 against 0) into a full lr step; real gradients (>= 1e-4 here) are unaffected.
        self.opt = torch.optim.AdamW(self.tm.parameters(), lr=1e-3, eps=1e-6)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=1e-3, eps=1e-6)

    def tier_calls(self) -> Dict[int, int]:
        return {r.index: r.tier.calls for r in self.tm.capture_info().records if r.tier is not None}

    def tier_ran(self, before: Dict[int, int]) -> str:
        """Which code ran the captures called since ``before`` (a Tier's state after a call is the
        one that call ran: the switch, and a switch back, happen before it runs)."""
        ran = {r.tier.state for r in self.tm.capture_info().records
               if r.tier is not None and r.tier.calls > before.get(r.index, 0)}
        return "inductor" if "compiled" in ran else "eager"

    def resync(self) -> None:
        """Copy eager's parameters and optimizer state over: the next batch starts from equal states."""
        params = dict(self.ref.named_parameters())
        finite = all(bool(torch.isfinite(p).all()) for p in params.values())
        with torch.no_grad():
            if not finite:   # a NaN step (eager's too) would make every later comparison trivial
                self.ref.load_state_dict(self.initial)
            for name, p in self.tm.named_parameters():
                p.copy_(params[name])
        if not finite:
            self.new_optimizers()
            return
        mine = dict(self.tm.named_parameters())
        for name, rp in params.items():
            state, ref_state = self.opt.state.get(mine[name]), self.ref_opt.state.get(rp)
            if state and ref_state:
                for k, v in ref_state.items():
                    if isinstance(v, torch.Tensor):
                        state[k].copy_(v)


def _signature(batch: Dict[str, Any]) -> Tuple[Any, ...]:
    return tuple((k, v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else (k, v)
                 for k, v in sorted(batch.items()))


def run_case(case: Case, n_batches: int, stop_at_first: bool = False, device: Any = "cpu") -> CaseResult:
    """Train one case for ``n_batches`` batches on ``device``; differences from eager become findings.
    Batches are drawn on the CPU (the same ones on every device) and moved."""
    started = time.perf_counter()
    loss = _loss_spec(case)
    pair = _Pair(case, loss, torch.device(device))
    result = CaseResult(case, loss)
    seen: set = set()
    rng = random.Random(f"{case.seed}/reads")
    stream = batches(case, pair.kind, pair.pad_id, loss.ignore_index)
    for index in range(n_batches):
        batch, about = next(stream)
        batch = {k: v.to(pair.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        found = []
        if case.tier and index == TIER_WAIT and not pair.tm.capture_info().wait_for_compiles(600):
            found.append(("the background compile did not finish in 600 s", "; ".join(pair.tm.capture_info().tiers)))
        before = pair.tier_calls()
        found += _one_batch(pair, batch, index, rng.random() < 0.5, seen,
                            lambda: COMPILED_ATOL if pair.tier_ran(before) == "inductor" else ATOL)
        if case.tier:
            result.tiers.append(pair.tier_ran(before))
            found += _tier_expected(result.tiers[-1], index, pair.tm.capture_info().tiers)
        if index == 0 and case.model in FIRES and not case.tier:  # the fuzzer's models are chosen for the passes
            why = pair.tm.capture_info().optimizations
            found += [("a pass did not fire on the capturing batch", f"{name}: {why.get(name)}")
                      for name in PASSES_FIRING[pair.kind] if not why.get(name, "").startswith("on:")]
        if pair.tm.capture_info().fallback_reason:
            found.append(("fell back to eager", str(pair.tm.capture_info().fallback_reason)))
        if found:
            result.findings.append(Finding(case, index, found, about))
        result.batches += 1
        if found and (stop_at_first or pair.tm.capture_info().fallback_reason):
            break
    info = pair.tm.capture_info()
    result.captures, result.signatures = info.graphs, len(seen)
    result.dense_batches = dict(info.dense_batches)
    result.seconds = time.perf_counter() - started
    return result


def _tier_expected(ran: str, index: int, tiers: List[str]) -> List[Tuple[str, str]]:
    """A tier case runs the eager executor up to TIER_SWITCH, the compiled graphs up to
    TIER_ROAM_FROM; the roaming batches after it run whichever tier their capture has."""
    expected = "eager" if index < TIER_SWITCH else "inductor" if index < TIER_ROAM_FROM else ran
    if ran != expected:
        return [(f"batch {index} ran on {ran}, expected {expected} (the switch at batch {TIER_SWITCH})",
                 "; ".join(tiers))]
    return []


def _one_batch(pair: _Pair, batch: Dict[str, torch.Tensor], index: int, read_before_step: bool,
               seen: set, atol: Callable[[], float] = lambda: ATOL) -> List[Tuple[str, str]]:
    """``atol``: read once the forward has run (which tier ran it is known then)."""
    found: List[Tuple[str, str]] = []
    captures = pair.tm.capture_info().graphs
    try:
        ref_out = pair.ref(**batch)
        ref_loss = loss_of(ref_out)
        ref_loss.backward()
    except Exception as e:  # eager refuses the batch: fxtrain must refuse it the same way
        pair.ref.zero_grad(set_to_none=True)
        try:
            pair.tm(**batch)
        except type(e):
            return []
        except Exception as mine:
            return [("raised another error than eager", f"{type(mine).__name__} vs eager {type(e).__name__}: {e}")]
        return [("ran where eager raised", f"eager: {type(e).__name__}: {e}")]
    try:
        out = pair.tm(**batch)
        out_loss = loss_of(out)
        tol = atol()
        problem = _differs(out_loss, ref_loss, tol)
        if problem:
            found.append(("loss differs", problem))
        if read_before_step:
            found.extend(_compare_outputs(out, ref_out, "before the step", tol))
        out_loss.backward()
    except Exception as e:
        pair.tm.zero_grad(set_to_none=True)
        pair.ref.zero_grad(set_to_none=True)
        pair.resync()
        return [("raised where eager ran", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")]
    signature = _signature(batch)
    if pair.tm.capture_info().graphs > captures and signature in seen:
        found.append(("captured again on an input signature already seen",
                      f"{pair.tm.capture_info().graphs - captures} capture(s)"))
    seen.add(signature)
    mine = dict(pair.tm.named_parameters())
    grad_gap: Dict[str, torch.Tensor] = {}
    for name, rp in pair.ref.named_parameters():
        problem = _differs(mine[name].grad, rp.grad, tol)
        if problem:
            found.append((f"gradient of {name} differs", problem))
        elif rp.grad is not None:
            grad_gap[name] = (mine[name].grad - rp.grad).abs().nan_to_num()
    pair.opt.step()
    pair.ref_opt.step()
    if not read_before_step:
        found.extend(_compare_outputs(out, ref_out, "after the step", tol))
    for name, rp in pair.ref.named_parameters():
        problem = _differs(mine[name], rp, tol, _adam_slack(pair.ref_opt, rp, grad_gap.get(name)))
        if problem:
            found.append((f"{name} after the optimizer step differs", problem))
    pair.opt.zero_grad(set_to_none=True)
    pair.ref_opt.zero_grad(set_to_none=True)
    pair.resync()
    return found


def _compare_outputs(out: Any, ref_out: Any, when: str, atol: float = ATOL) -> List[Tuple[str, str]]:
    found = []
    mine, ref = _tensors(out), _tensors(ref_out)
    if mine.keys() != ref.keys():
        return [(f"returned tensors differ {when}", f"{sorted(mine)} vs eager {sorted(ref)}")]
    for path in ref:
        try:
            problem = _differs(mine[path], ref[path], atol)
        except Exception as e:
            problem = f"reading it raised {type(e).__name__}: {e}"
        if problem:
            found.append((f"returned {path} read {when} differs", problem))
    return found


# ------------------------------------------------------------------------------------------ driver
class BadArguments(Error, ValueError):
    """Arguments no fuzz case can run with, found before the first case runs."""


def cases(seeds: Sequence[int], model_names: Optional[Sequence[str]] = None,
          losses: Sequence[str] = LOSSES, tier: bool = False) -> List[Case]:
    """Every (seed, model, loss) case. ``model_names`` None: ``MODELS``, its text models for tier
    cases. An image model among tier cases is refused here, before any case runs: its batch stream
    has no dense text batch to capture on, and it used to end a run minutes in, results lost."""
    every = {**MODELS, **EXTRA_MODELS}
    if model_names is None:
        model_names = [m for m, (_, kind, _) in MODELS.items() if not (tier and kind == "image")]
    unknown = [m for m in model_names if m not in every]
    if unknown:
        raise BadArguments(f"unknown fuzz model(s) {unknown}; known: {sorted(every)}")
    images = [m for m in model_names if every[m][1] == "image"]
    if tier and images:
        raise BadArguments(f"--tier-switch fuzzes text models only (it captures on a dense text batch); "
                           f"drop {', '.join(images)}")
    return [Case(m, l, s, tier) for s in seeds for m in model_names for l in losses]


def run(all_cases: Sequence[Case], n_batches: int, progress: bool = True, device: Any = "cpu") -> List[CaseResult]:
    """Run every case with ``FXTRAIN_*`` variables cleared: the defaults users get are what is fuzzed."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(ENV_PREFIX) and k != "FXTRAIN_LOG_LEVEL"}
    try:
        return [run_case(case, n_batches, device=device)
                for case in tqdm(all_cases, desc="fuzz", unit="case", disable=not progress)]
    finally:
        os.environ.update(saved)


def _tiers_ran(ran: Sequence[str]) -> str:
    if not ran:
        return "-"
    compiled = [i for i, tier in enumerate(ran) if tier == "inductor"]
    return f"inductor from batch {compiled[0]} ({len(compiled)} batches)" if compiled else "eager only"


def summary(results: Sequence[CaseResult]) -> str:
    from .report import format_table
    rows = [[f"{r.case.model}/{r.case.loss}", r.case.seed, r.loss.describe(), r.batches, r.captures, r.signatures,
             sum(r.dense_batches.values()), _tiers_ran(r.tiers), len(r.findings), r.seconds] for r in results]
    table = format_table(["case", "seed", "loss", "batches", "captures", "signatures", "dense route", "tiers",
                          "findings", "s"], rows)
    findings = [str(f) for r in results for f in r.findings]
    return table + ("\n\n" + "\n".join(findings) if findings else "\n\nno difference from eager")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted({**MODELS, **EXTRA_MODELS}), action="append",
                   help=f"default: {', '.join(MODELS)} (add {', '.join(EXTRA_MODELS)} by name)")
    p.add_argument("--loss", choices=LOSSES, action="append", help="default: both")
    p.add_argument("--seed", type=int, action="append", help="default: 0")
    p.add_argument("--seeds", type=int, default=None, help="run seeds 0..N-1 (the long mode)")
    p.add_argument("--batches", type=int, default=40, help="batches per case, the capturing one included")
    p.add_argument("--device", default="cpu", help="torch device the models train on (cuda, ...); default cpu")
    p.add_argument("--tier-switch", action="store_true",
                   help=f'executor="auto", the switch to inductor\'s graphs forced at batch {TIER_SWITCH}')


def run_command(args: argparse.Namespace) -> int:
    """Raises BadArguments for arguments no case could run with, before the first case runs."""
    seeds = list(range(args.seeds)) if args.seeds else (args.seed or [0])
    if args.batches < 1:
        raise BadArguments(f"--batches must be at least 1 (the capturing batch), got {args.batches}")
    results = run(cases(seeds, args.model, args.loss or LOSSES, getattr(args, "tier_switch", False)),
                  args.batches, device=getattr(args, "device", "cpu"))
    print(summary(results))
    return 1 if any(r.findings for r in results) else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxtrain.fuzz", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_command(args)
    except BadArguments as e:
        p.error(str(e))


if __name__ == "__main__":
    raise SystemExit(main())
