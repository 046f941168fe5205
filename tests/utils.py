"""Shared test helpers: eager PyTorch is the oracle."""
from __future__ import annotations

import collections
import contextlib
import copy
import os
from typing import Any, Callable, Dict, Iterable, Iterator, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxtrain

# The device the suite is asked to run on: FXTRAIN_TEST_DEVICE=cuda runs it on a GPU (default "cpu").
# The conftest keeps this variable when it clears FXTRAIN_*. Read it at import time only to decide
# what to collect (tests/test_varlen_attention.py's kernels); a test asks ``current_device()``.
REQUESTED_DEVICE = torch.device(os.environ.get("FXTRAIN_TEST_DEVICE") or "cpu")
_current = REQUESTED_DEVICE  # set per test by tests/conftest.py (``pytest_runtest_setup``)


def current_device() -> torch.device:
    """The device the running test uses: REQUESTED_DEVICE, or the CPU for a test marked
    ``cpu_only(reason)`` (tests/conftest.py sets it before each test's fixtures). ``to_device``,
    ``wrap_pair``, the sync counter and the ``device`` fixture use it; a test that builds tensors
    itself passes ``device=current_device()`` or moves them with ``to_device``."""
    return _current


def to_device(obj: Any, device: Any = None) -> Any:
    """``obj`` (a tensor, a module, or a nest of dicts/lists/tuples of tensors) on the test device."""
    device = current_device() if device is None else torch.device(device)
    if isinstance(obj, torch.nn.Module):
        return obj.to(device)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), obj)


def wrap_pair(model: torch.nn.Module, **options: Any) -> Tuple[fxtrain.TrainModule, torch.nn.Module]:
    """(TrainModule around ``model``, an untouched deep copy for eager), both on the test device."""
    model = to_device(model)
    ref = copy.deepcopy(model)
    options.setdefault("fallback", "raise")
    # Most tests change batch and sequence sizes between steps and check that one capture serves them
    # all: symbolic sizes from the first capture. The default (static first) is tested in test_module.
    options.setdefault("dynamic", True)
    return fxtrain.TrainModule(model, fxtrain.Options(**options)), ref


def assert_grads_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    checked = 0
    for name in pa:
        ga, gb = pa[name].grad, pb[name].grad
        assert (ga is None) == (gb is None), f"{name}: grad presence differs"
        if ga is not None:
            torch.testing.assert_close(ga, gb, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 0, "no gradient was compared"


def assert_state_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=1e-4, msg=lambda m: f"{k}: {m}")


def train_parity(tm: fxtrain.TrainModule, ref: torch.nn.Module, batches: Iterable[Dict[str, Any]],
                 loss_of: Callable[[Any, Dict[str, Any]], torch.Tensor], atol: float = 1e-5,
                 compare_outputs: Callable[[Any, Any], None] | None = None,
                 state_atol: float | None = None) -> None:
    """Train both copies with AdamW step by step; losses, outputs, grads and state must agree."""
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    tm.train(); ref.train()
    for batch in batches:
        batch = to_device(batch)
        out, ref_out = tm(**batch), ref(**batch)
        loss, ref_loss = loss_of(out, batch), loss_of(ref_out, batch)
        torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=1e-4)
        if compare_outputs is not None:
            compare_outputs(out, ref_out)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=atol)
        opt.step(); ref_opt.step()
        opt.zero_grad(); ref_opt.zero_grad()
    assert_state_equal(tm.module, ref, atol=state_atol or atol)



def train_left_padded_gpt2(tm: fxtrain.TrainModule, ref: torch.nn.Module) -> None:
    """Two left-padded causal-LM batches of different shapes, half their labels at the end: the
    batches the varlen attention tests share. Trains both copies to eager's loss, gradients and
    weights and checks that padding elimination ran sequence by sequence in both captures."""
    from fxtrain import models
    g = torch.Generator().manual_seed(3)
    batches = [models.synthetic_batch("clm", b, s, 1000, padding=0.4, padding_side="left", generator=g,
                                      labels_at_end=0.5) for b, s in [(4, 16), (3, 11)]]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    assert why.startswith("on:") and "sequence by sequence: 2 of 2" in why, why

# ------------------------------------------------------------------------ host synchronisations
_aten = torch.ops.aten
# Ops that read a device tensor's value (or a size that depends on values) back to the host.
_READS = {_aten._local_scalar_dense, _aten.item, _aten.nonzero, _aten.is_nonzero, _aten.equal}
# Tensor arguments fxtrain's ops take on the CPU whatever the device: the PythonOp handle is made on
# the CPU (pythonop/op.py ``_new_handle``), and so are the sequence lengths of varlen attention
# (runtime/host_counts.py ``row_lengths``), so reading it is a host read on a GPU too. On a CPU run,
# where every tensor stands for a device tensor, the counter is told which these are.
_HOST_ARGUMENTS = {"fxtrain::python_op_backward": ("handle",),
                   # each sequence's length, made on the host from the batch guard's one read
                   "fxtrain::varlen_attention": ("lengths",), "fxtrain::varlen_attention_backward": ("lengths",)}


class SyncCounter(TorchDispatchMode):
    """Counts the device-to-host synchronisations of the ops run under it.

    A synchronisation is an op that reads values to the host (``_READS``) from a device tensor, or a
    copy (``_to_copy``, ``copy_``) to the CPU from another device. On a CPU run every tensor stands
    for a device tensor: the reads count whatever their input, and so do ``_to_copy``s that name the
    CPU as their destination without converting the dtype (a move to the host on a GPU).

    ``ignore_compile_internals``: dynamo skips compiled code while an ordinary dispatch mode is
    active (the step would run eagerly, not from fxtrain's graphs); with it the mode is off while
    dynamo compiles and on while the compiled graphs run, so it sees every op they dispatch.
    Tensors that fxtrain keeps on the CPU by design (``_HOST_ARGUMENTS``) count only from a device.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: "collections.Counter[str]" = collections.Counter()
        self.ops: "collections.Counter[str]" = collections.Counter()
        self._host: list = []  # the host tensors of the custom ops running now (compared by identity)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        self.ops[str(packet)] += 1
        if self._syncs(packet, args, kwargs):
            self.syncs[str(packet)] += 1
        custom = _custom_op_function(func)
        if custom is not None:
            host = _host_arguments(func, args, kwargs)
            self._host.extend(host)
            try:
                with self:  # a Python-defined op's own ops: dispatched below us otherwise, unseen
                    return custom(*args, **kwargs)
            finally:
                del self._host[len(self._host) - len(host):]
        return func(*args, **kwargs)

    def _syncs(self, packet: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        source = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if source is None:
            return False
        on_host = any(source is h for h in self._host)
        # CPU run: a tensor stands for a device tensor, unless fxtrain keeps it on the CPU anyway.
        from_device = source.device.type != "cpu" or (current_device().type == "cpu" and not on_host)
        if packet in _READS:
            return from_device
        if packet is _aten._to_copy:
            to = kwargs.get("device")
            if to is None or torch.device(to).type != "cpu":
                return False
            if source.device.type != "cpu":
                return True
            # CPU run: a copy that only names the CPU is a move to the host; one that converts the
            # dtype too is model code's ``x.to(self.device, dtype)``, a copy on the device on a GPU.
            return current_device().type == "cpu" and kwargs.get("dtype") in (None, source.dtype)
        if packet is _aten.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        return False


def _host_arguments(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> list:
    """The tensors among ``func``'s arguments that ``_HOST_ARGUMENTS`` names."""
    names = _HOST_ARGUMENTS.get(func._schema.name, ())
    if not names:
        return []
    found = [a for spec, a in zip(func._schema.arguments, args) if spec.name in names]
    found += [kwargs[n] for n in names if n in kwargs]
    return [t for t in found if isinstance(t, torch.Tensor)]


def _custom_op_function(func: Any) -> Any:
    """The Python function behind a ``torch.library.custom_op`` (fxtrain's PythonOp and host-count
    ops), or None. Private torch API (``_maybe_get_opdef``, checked on torch 2.13): without it the
    reads such an op makes inside its implementation would not reach the counter."""
    if func.namespace in ("aten", "prim", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef
        opdef = _maybe_get_opdef(func)
    except Exception:
        return None
    return getattr(opdef, "_init_fn", None)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    with SyncCounter() as counter:
        yield counter


# ---------------------------------------------------------------- the toy LM of the pipeline tests
# Custom autograd Functions and an embedding tied to the LM head: the patterns a pipeline and the
# zero-bubble B/W split get wrong when they trace through a Function or count a tied parameter
# once per use. tests/test_pipeline.py trains it in stages; tests/test_weight_split.py cuts its
# backward. Every user backward counts its calls, so a test can check it ran once per microbatch.
CALLS = {"ste": 0, "gate": 0}


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: the true derivative of round() is 0; the user's backward says 1."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        CALLS["ste"] += 1
        return grad


class NumpyGate(torch.autograd.Function):
    """Leaves torch in forward (numpy) and has a hand-written backward no tracer could derive; it
    returns the input's and the weight's gradient from one call."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = np.tanh(x.detach().cpu().numpy()) * w.detach().cpu().numpy()
        return torch.from_numpy(y).to(x.dtype)

    @staticmethod
    def infer_shape(x, w):  # its forward cannot run on fake tensors: shapes for the graph
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        CALLS["gate"] += 1
        x, w = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * (1 - t * t) * w, (grad * t).sum(0).sum(0)


class ToyLM(nn.Module):
    """Embedding tied to the LM head, custom Functions in early and late layers, keyword inputs."""

    def __init__(self, vocab: int = 40, dim: int = 16, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.head_bias = nn.Parameter(torch.zeros(vocab))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.embed.weight, self.head_bias)      # tied to the embedding

    def forward(self, input_ids, labels=None, *, temperature=1.0):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h)) + h
            if i == 0:
                h = RoundSTE.apply(h)
            if i == len(self.layers) - 2:
                h = NumpyGate.apply(h, self.gate)
        logits = self.head(h) / temperature
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ToyLogits(ToyLM):
    """The same model returning logits: the loss comes from build(loss_fn=...) and step(target=...)."""

    def forward(self, input_ids, *, temperature=1.0):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h)) + h
            if i == 0:
                h = RoundSTE.apply(h)
        return self.head(h) / temperature


def toy_model() -> nn.Module:
    torch.manual_seed(0)
    return ToyLM()


def toy_batch(batch: int = 8) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 40, (batch, 5), generator=g),
            "labels": torch.randint(0, 40, (batch, 5), generator=g)}


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def logits_model() -> nn.Module:
    torch.manual_seed(0)
    return ToyLogits()


def long_params(values: Iterable[Any], keep: Iterable[Any]) -> list:
    """Parametrize values, all but ``keep`` marked ``extended``: `make test` runs the kept ones (each
    code path once), `make test-long` the others (more models/sides of the same path)."""
    import pytest
    keep = list(keep)
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.extended)
            for v in values]
