"""User-facing options: one dataclass, overridable by ``FXTRAIN_<FIELD>`` environment variables.

Environment variables win over values passed in code so that a run can be re-configured (for
example ``FXTRAIN_FALLBACK=raise`` in CI) without touching the training script.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Union

logger = logging.getLogger("fxtrain")

ENV_PREFIX = "FXTRAIN_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class Options:
    """Every knob of fxtrain. docs/options.md holds the table generated from these fields
    (``fxtrain options``; tests/test_docs.py checks that it does)."""

    executor: str = field(default="auto", metadata={
        "choices": ("eager", "inductor", "auto"),
        "help": "What runs the captured aten graphs: 'eager' (aten ops one by one; fast first step), "
                "'inductor' (generated kernels; slow first step) or 'auto' (starts as 'eager'; once a "
                "capture has run `compile_after` seconds, a low-priority worker process compiles its "
                "graphs with inductor, and the capture runs them if they measure faster; capture_info() "
                "says per capture which runs and why)."})
    compile_after: float = field(default=10.0, metadata={
        "help": "executor='auto': seconds after a capture's first call before its background compile "
                "starts (0: at its second call). A run shorter than that never pays for a compile: the "
                "worker would take cores from the training loop for a speed-up the run ends before using."})
    compile_timeout: float = field(default=600.0, metadata={
        "help": "executor='auto': seconds a capture's background compile may take; one that takes longer "
                "(or fails) is logged once and that capture stays on the eager executor."})
    backward: str = field(default="auto", metadata={
        "choices": ("auto", "autograd", "graph"),
        "help": "How the eager executor runs a step: 'autograd' runs the rewritten torch-level graph under "
                "PyTorch's autograd engine (fewest Python calls per step); 'graph' replays the aten forward and "
                "backward graphs (where fxtrain's backward passes apply); 'auto' picks 'graph' only where those "
                "passes save more than the replay costs. The inductor executor always runs the aten graphs."})
    fallback: str = field(default="eager", metadata={
        "choices": ("eager", "raise"),
        "help": "When capture fails: warn once and run the model eagerly, or raise."})
    dynamic: Optional[bool] = field(default=None, metadata={
        "help": "Symbolic sizes. None: capture with the first batch's sizes (fastest capture); when a size "
                "changes, capture once more with the input dimensions seen to change symbolic and every other "
                "one static (image height and width: static for the first three distinct sizes; a dimension "
                "whose symbolic reasoning proves expensive stays static: a capture per "
                "size of it), and again only if another dimension changes; True: every size symbolic from the "
                "first capture; False: a capture per size."})
    fullgraph: bool = field(default=False, metadata={
        "help": "Treat any graph break as a capture failure (then `fallback` decides)."})
    custom_autograd: bool = field(default=True, metadata={
        "help": "Keep each custom torch.autograd.Function as an opaque PythonOp running the user's own "
                "forward and backward; False lets dynamo trace (inline) it instead."})
    label_sparsity: str = field(default="auto", metadata={
        "choices": ("auto", "on", "off"),
        "help": "Compute the LM head (and what feeds only it) for labelled positions only; 'auto' turns it "
                "on when the label density of the capturing batch is below `sparsity_threshold`."})
    padding_elimination: str = field(default="auto", metadata={
        "choices": ("auto", "on", "off"),
        "help": "Run token-wise work (projections, FFN, LayerNorm) on non-padding tokens only; 'auto' turns "
                "it on when the token density of the capturing batch is below `sparsity_threshold`."})
    upstream_slicing: str = field(default="auto", metadata={
        "choices": ("auto", "on", "off"),
        "help": "When the model keeps only some rows (e.g. `h[:, 0]` for a classifier), compute the last "
                "layers' token-wise work for those rows only."})
    packed_attention: str = field(default="auto", metadata={
        "choices": ("auto", "on", "off"),
        "help": "Packed batches (several documents per row, `position_ids` restarting, no `attention_mask`; "
                "HF's DataCollatorWithFlattening with use_cache=False): run each attention whose mask keeps "
                "tokens within their document document by document; 'auto' turns it on when the capturing "
                "batch's attention work within documents over whole rows is below `sparsity_threshold`."})
    sparsity_threshold: float = field(default=0.9, metadata={
        "help": "Density (labelled or non-padding fraction, attention work within documents) below which an 'auto' "
                "sparsity pass turns on, only where it shortens the step on its device: the time of the FLOPs it "
                "skips against the host time of the ops it adds, overlapping on an accelerator, adding up on the "
                "CPU (docs/sparsity.md)."})
    sparsity_guard: str = field(default="dense", metadata={
        "choices": ("dense", "raise"),
        "help": "A batch that breaks a sparsity pass's per-batch condition (a label or a kept row on a padding "
                "position): 'dense' runs it through the graph without the passes (eager's numbers, counted in "
                "capture_info().dense_batches); 'raise' raises before anything runs."})
    log_density: bool = field(default=False, metadata={
        "help": "Log the label and token density of every batch at INFO (the inspector watching)."})
    save_graphs_dir: Optional[str] = field(default=None, metadata={
        "help": "Write every captured graph here (dynamo, aten forward and backward as readable FX code, "
                "with the optimizations and PythonOps), one folder per capture, for debugging."})
    cache_dir: Optional[str] = field(default=None, metadata={
        "help": "Directory of the on-disk cache of captured graphs: a later process with the same model, "
                "inputs and options skips capture (`fxtrain cache ls|clear`). The directory must exist and "
                "be writable; otherwise fxtrain warns once and runs without the cache."})
    recompile_limit: int = field(default=64, metadata={
        "help": "Calls of one TrainModule that may capture (a call whose model breaks into several graphs "
                "counts once); one more counts as a capture failure, and `fallback` decides."})
    capture_warning_seconds: float = field(default=60.0, metadata={
        "help": "A single capture (one frame dynamo compiles) taking longer than this logs one WARNING saying "
                "what is being captured, for how long so far, and the option that avoids it."})
    memory_budget: Optional[Union[int, str]] = field(default=None, metadata={
        "help": "Peak memory the whole training step must fit, in bytes or as a size ('6GiB', '512MB'): "
                "parameters, gradients, optimizer state (see `optimizer`), the batch, activations and "
                "temporaries. fxtrain then chooses which activations the backward recomputes instead of "
                "saving (cheapest per byte first), costs the plan with the profiler and runs the aten graphs; "
                "capture_info().memory_plan reports it. A budget below the smallest achievable peak warns "
                "once and runs the smallest plan (`fallback='raise'`: raises)."})
    optimizer: Optional[str] = field(default=None, metadata={
        "help": "The optimizer the training loop steps ('adamw', 'adam', 'sgd', 'adagrad', 'rmsprop'), whose "
                "state and step temporaries `memory_budget` counts; `TrainModule.attach_optimizer(opt)` "
                "attaches an instance instead. None: no optimizer state is counted."})

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"fxtrain.Options.{f.name}={value!r}: expected one of {list(choices)}")
        if not 0.0 <= self.sparsity_threshold <= 1.0:
            raise ValueError(f"fxtrain.Options.sparsity_threshold must be within [0, 1], got {self.sparsity_threshold}")
        if not self.capture_warning_seconds > 0:
            raise ValueError(f"fxtrain.Options.capture_warning_seconds must be positive, got {self.capture_warning_seconds}")
        if not self.compile_after >= 0:
            raise ValueError(f"fxtrain.Options.compile_after must be >= 0, got {self.compile_after}")
        if not self.compile_timeout > 0:
            raise ValueError(f"fxtrain.Options.compile_timeout must be positive, got {self.compile_timeout}")
        if self.recompile_limit < 1:
            raise ValueError(f"fxtrain.Options.recompile_limit must be >= 1, got {self.recompile_limit}")
        if self.memory_budget is not None:
            # One type from here on: a number of bytes, whatever the user wrote.
            self.memory_budget = parse_bytes(self.memory_budget)
            if self.memory_budget <= 0:
                raise ValueError(f"fxtrain.Options.memory_budget must be positive, got {self.memory_budget}")
            if self.backward == "autograd":
                raise ValueError("fxtrain.Options.memory_budget plans the aten graphs' recomputation, which the "
                                 "'autograd' runtime does not run: use backward='auto' or 'graph'")
        if self.optimizer is not None and self.optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"fxtrain.Options.optimizer={self.optimizer!r}: expected one of {list(OPTIMIZERS)}")

    def with_env(self, environ: Optional[Mapping[str, str]] = None) -> "Options":
        """Return a copy with every ``FXTRAIN_<FIELD>`` variable applied on top of these values."""
        environ = os.environ if environ is None else environ
        known = {ENV_PREFIX + f.name.upper(): f for f in fields(self)}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known
                         and k not in _NON_OPTION_ENV)
        if unknown:
            logger.warning("ignoring unknown fxtrain environment variable(s) %s; known: %s",
                           unknown, sorted(known))
        hints = typing.get_type_hints(Options)
        return dataclasses.replace(self, **{f.name: _parse(name, environ[name], hints[f.name])
                                            for name, f in known.items() if name in environ})

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# Optimizers Options.optimizer may name (cost/step.py maps them to torch.optim classes).
OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad", "rmsprop")

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: Union[int, float, str]) -> int:
    """'80GiB', '1.5 TB', '1000000' (or a number) -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# Environment variables fxtrain reads that are not Options fields.
_NON_OPTION_ENV = {"FXTRAIN_LOG_LEVEL"}


def _parse(name: str, raw: str, typ: Any) -> Any:
    """Parse one environment value into the field's type, failing with the variable's name."""
    optional = typing.get_origin(typ) is typing.Union and type(None) in typing.get_args(typ)
    if optional:
        if raw.strip().lower() in ("", "none"):
            return None
        rest = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(rest) > 1:   # a size: bytes or '6GiB' (Options normalises it to bytes)
            return raw.strip()
        typ = rest[0]
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        return raw
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {typ.__name__}: {e}") from None


def resolve(options: Optional[Options]) -> Options:
    """Effective options: the given (or default) values with the environment applied on top."""
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be fxtrain.Options, got {type(options).__name__}")
    effective = (options or Options()).with_env()
    logger.info("fxtrain options: %s", ", ".join(f"{k}={v!r}" for k, v in effective.as_dict().items()))
    return effective


def options_table() -> str:
    """Markdown table of every option, its environment variable and default (docs/options.md)."""
    rows = ["| option | env var | default | meaning |", "|---|---|---|---|"]
    for f in fields(Options):
        choices = f.metadata.get("choices")
        meaning = f.metadata.get("help", "") + (f" One of {', '.join(choices)}." if choices else "")
        rows.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | `{f.default!r}` | {meaning} |")
    return "\n".join(rows)
