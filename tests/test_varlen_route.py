"""The kernels ``fxtrain::varlen_attention`` runs, per device and dtype (issue 17).

On CUDA the op is one variable-length kernel call per direction (``torch_private.varlen_kernels``:
the memory-efficient kernel for float32, flash for fp16/bf16 on sm80+), fed ``cu_seqlens``; on the
CPU it stays per run of equal lengths. Without a GPU these tests check what can be checked:

- the route chosen for each device type, dtype, head dim and capability;
- the arguments the op passes (cu_seqlens, max length, causal mask type, scale, layouts, the
  log-sum-exp's layout between forward and backward): the aten kernels are replaced by pure-torch
  emulators of their documented semantics, checked against the padded reference (on the test device);
- the fake (``register_fake``) shapes against the shapes the real route gives under FakeTensorMode
  on fake CUDA tensors (torch's meta kernels of the aten ops: what the CUDA kernels return).

With ``FXTRAIN_TEST_DEVICE=cuda`` the kernel-route tests run the real kernels against the padded
reference, and check that the kernel count does not grow with the number of sequences.
"""
import math
import types

import pytest
import torch

from fxtrain import torch_private as tp
from fxtrain.runtime import varlen_attention as va
from utils import REQUESTED_DEVICE, current_device, to_device

ON_CUDA = REQUESTED_DEVICE.type == "cuda"


# ------------------------------------------------------------------------------ route choice
ROUTE_CHOICE = pytest.mark.cpu_only(reason="the route chosen for a given device type: no tensors")


@ROUTE_CHOICE
@pytest.mark.parametrize("dtype,capability,expected", [
    (torch.float32, (9, 0), "efficient"),
    (torch.float32, (7, 0), "efficient"),
    (torch.float32, None, "efficient"),
    (torch.bfloat16, (9, 0), "flash"),
    (torch.float16, (8, 0), "flash"),
    (torch.float16, (7, 5), "efficient"),
    (torch.bfloat16, (7, 5), "blocks"),
    (torch.float64, (9, 0), "blocks"),
])
def test_route_on_cuda(dtype, capability, expected):
    assert va.route("cuda", dtype, 64, capability) == expected


@ROUTE_CHOICE
def test_route_elsewhere():
    """The CPU keeps the per-run route with its log-sum-exp kernel (faster there: no varlen kernel);
    odd head dims, ROCm and unknown devices take the generic per-run route."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert va.route("cpu", dtype, 64) == "blocks_lse"
    assert va.route("cuda", torch.float32, 12, (9, 0)) == "blocks"      # not a multiple of 8
    assert va.route("cuda", torch.float32, 512, (9, 0)) == "blocks"     # above the kernels' 256
    assert va.route("cuda", torch.bfloat16, 64, (9, 0), value_dim=32) == "efficient"
    assert va.route("cuda", torch.float32, 64, (9, 0), hip=True) == "blocks"
    assert va.route("mps", torch.float32, 64) == "blocks"


# ------------------------------------------------------------------- emulated CUDA kernels
def _spans(cu, tokens):
    bounds = cu.tolist()
    assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), cu
    assert bounds[0] == 0 and bounds[-1] == tokens, (bounds, tokens)
    spans = list(zip(bounds, bounds[1:]))
    assert all(e > s for s, e in spans), f"empty sequences reach the kernel: {bounds}"
    return spans


def _scores(q, k, causal, scale):
    """[heads, n, n] scores of one sequence (q, k [n, heads, dim]), masked."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def _forward(q, k, v, spans, causal, scale):
    out, lses = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device), []
    for s, e in spans:
        sc = _scores(q[s:e], k[s:e], causal, scale)
        lse = sc.logsumexp(-1)                                        # [heads, n]
        out[s:e] = torch.einsum("hqk,khd->qhd", (sc - lse[..., None]).exp(), v[s:e])
        lses.append(lse)
    return out, lses


def _backward(grad, q, k, v, out, lses, spans, causal, scale):
    """Attention's backward from the given log-sum-exp, as the kernels compute it."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (s, e), lse in zip(spans, lses):
        p = (_scores(q[s:e], k[s:e], causal, scale) - lse[..., None]).exp()
        g = grad[s:e]
        dv[s:e] = torch.einsum("hqk,qhd->khd", p, g)
        dp = torch.einsum("qhd,khd->hqk", g, v[s:e])
        delta = (g * out[s:e]).sum(-1).transpose(0, 1)[..., None]      # [heads, n, 1]
        ds = p * (dp - delta) * scale
        dq[s:e] = torch.einsum("hqk,khd->qhd", ds, k[s:e])
        dk[s:e] = torch.einsum("hqk,qhd->khd", ds, q[s:e])
    return dq, dk, dv


class _Emulated:
    """``aten`` with the four variable-length kernels replaced by emulators that check the call the
    way the CUDA kernels read it (attention.cu / attention_backward.cu, the meta registrations)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    def _efficient_attention_forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, p, mask_type, lse_too,
                                     *, scale):
        self.calls.append("efficient_forward")
        assert q.dim() == 4 and q.shape[0] == 1 and bias is None and cu_q is cu_k and p == 0.0 and lse_too
        assert mask_type in (0, 1) and isinstance(scale, float)
        spans = _spans(cu_q, q.shape[1])
        assert max_q == max_k == max(e - s for s, e in spans)
        out, lses = _forward(q[0], k[0], v[0], spans, mask_type == 1, scale)
        lse = torch.full((len(spans), q.shape[2], math.ceil(max_q / 32) * 32), float("nan"), device=q.device)
        for i, l_ in enumerate(lses):
            lse[i, :, :l_.shape[1]] = l_
        self.mask_type = mask_type
        return out[None], lse, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long), max_q, max_k

    def _efficient_attention_backward(self, grad, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, p, seed,
                                      offset, mask_type, bias_grad, *, scale):
        self.calls.append("efficient_backward")
        spans = _spans(cu_q, q.shape[1])
        assert lse.shape == (len(spans), q.shape[2], math.ceil(max_q / 32) * 32), lse.shape
        assert out.is_contiguous() and grad.dim() == 4 and not bias_grad and p == 0.0
        lses = [lse[i, :, :e - s] for i, (s, e) in enumerate(spans)]
        parts = _backward(grad[0], q[0], k[0], v[0], out[0], lses, spans, mask_type == 1, scale)
        return (*(x[None] for x in parts), torch.empty(0))

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, *, scale):
        self.calls.append("flash_forward")
        assert q.dim() == 3 and cu_q is cu_k and p == 0.0 and not debug and isinstance(scale, float)
        spans = _spans(cu_q, q.shape[0])
        assert max_q == max_k == max(e - s for s, e in spans)
        out, lses = _forward(q, k, v, spans, causal, scale)
        return out, torch.cat(lses, 1), torch.empty(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

    def _flash_attention_backward(self, grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, causal, rng,
                                  unused, *, scale):
        self.calls.append("flash_backward")
        spans = _spans(cu_q, q.shape[0])
        assert lse.shape == (q.shape[1], q.shape[0]) and p == 0.0
        return _backward(grad, q, k, v, out, [lse[:, s:e] for s, e in spans], spans, causal, scale)


@pytest.mark.parametrize("kind", va.VARLEN_ROUTES)
@pytest.mark.parametrize("causal", [False, True])
def test_route_arguments_against_emulated_kernels(kind, causal, monkeypatch):
    """The one-call route, its kernels emulated in plain torch: values and gradients equal SDPA over the
    padded layout; empty sequences never reach the kernel; one call per direction; the efficient
    kernel gets mask type 1 (causal) or 0."""
    aten = _Emulated()
    monkeypatch.setattr(tp, "aten", aten)
    monkeypatch.setattr(va, "_route_of", lambda q, v: kind)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 3, 0, 7, 1, 40]   # an empty sequence; 40 pads the efficient lse to 64
    tokens, heads, dim = sum(lengths), 2, 8
    q, k, v = (to_device(torch.randn(tokens, heads, dim, generator=g, dtype=torch.float64)).requires_grad_()
               for _ in range(3))
    out, lse = va.varlen_attention(q, k, v, torch.tensor(lengths), 0.3, causal)
    expected_lse = (6 * heads * 64,) if kind == "efficient" else (heads, tokens)
    assert tuple(lse.shape) == expected_lse
    ref = va.reference(q, k, v, lengths, 0.3, causal)
    # Wrong arguments (offsets, mask, scale, lse layout) give O(1) errors; the emulator's own
    # rounding (einsum vs the reference's kernels) reaches 2e-7.
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert aten.calls == [f"{kind}_forward", f"{kind}_backward"], aten.calls
    if kind == "efficient":
        assert aten.mask_type == (1 if causal else 0)


def test_route_with_no_tokens(monkeypatch):
    """All sequences empty: no kernel call, empty results of the fake's shapes."""
    aten = _Emulated()
    monkeypatch.setattr(tp, "aten", aten)
    for kind in va.VARLEN_ROUTES:
        monkeypatch.setattr(va, "_route_of", lambda q, v: kind)
        q = torch.zeros(0, 2, 8, device=current_device(), requires_grad=True)
        out, lse = va.varlen_attention(q, q, q, torch.tensor([0, 0]), 1.0, True)
        assert out.shape == (0, 2, 8) and lse.shape == ((0,) if kind == "efficient" else (2, 0))
        out.sum().backward()
    assert not aten.calls


# ------------------------------------------------------------------------ fake shapes
@pytest.mark.cpu_only(reason="fake CUDA tensors: torch's meta kernels, the same with or without a GPU "
                              "(the real ones: test_kernel_route_matches_padded_sdpa)")
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "efficient"), (torch.float16, "efficient"),
                                        (torch.bfloat16, "flash"), (torch.float16, "flash")])
@pytest.mark.parametrize("causal", [False, True])
def test_fake_shapes_match_the_kernels(dtype, kind, causal, monkeypatch):
    """On fake CUDA tensors (no GPU needed), the op's fakes against its real route, whose aten
    kernels then run their meta implementations, i.e. the shapes the CUDA kernels return. The
    efficient lse's size depends on the lengths' values: the fake gives an unbacked size."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    monkeypatch.setattr(va, "_capability", lambda device: (9, 0) if kind == "flash" else (7, 5))
    lengths = torch.tensor([5, 3, 0, 40, 1])
    tokens, heads, dim = int(lengths.sum()), 4, 64
    impl = tp.custom_op_impl_of(torch.ops.fxtrain.varlen_attention.default)
    impl_bwd = tp.custom_op_impl_of(torch.ops.fxtrain.varlen_attention_backward.default)
    with tp.FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        qkv = torch.empty(tokens, 3 * heads * dim, device="cuda", dtype=dtype)   # a fused projection
        q, k, v = (qkv.narrow(1, i * heads * dim, heads * dim).unflatten(1, (heads, dim)) for i in range(3))
        assert va._route_of(q, v) == kind
        fake_out, fake_lse = torch.ops.fxtrain.varlen_attention(q, k, v, lengths, 0.125, causal)
        real_out, real_lse = impl(q, k, v, lengths, 0.125, causal)
        grad = torch.empty(tokens, heads, dim, device="cuda", dtype=dtype)
        fake_grads = torch.ops.fxtrain.varlen_attention_backward(grad, q, k, v, real_out, real_lse, lengths, 0.125,
                                                                 causal)
        # torch's meta of _efficient_attention_backward takes no ``scale`` keyword (TypeError on 2.11
        # to 2.14.1): its CUDA kernel allocates contiguous ``at::empty(query.sizes())`` gradients.
        real_grads = impl_bwd(grad, q, k, v, real_out, real_lse, lengths, 0.125, causal) if kind == "flash" \
            else [torch.empty(tokens, heads, dim, device="cuda", dtype=dtype) for _ in range(3)]
    for fake, real in [(fake_out, real_out), *zip(fake_grads, real_grads)]:
        assert (fake.shape, fake.stride(), fake.dtype, fake.device) == \
            (real.shape, real.stride(), real.dtype, real.device)
        assert real.shape == (tokens, heads, dim) and real.device.type == "cuda"
    assert fake_lse.dtype == real_lse.dtype == torch.float32 and fake_lse.device == real_lse.device
    if kind == "flash":
        assert fake_lse.shape == real_lse.shape == (heads, tokens)
    else:
        assert real_lse.shape == (4 * heads * 64,)   # 4 non-empty sequences, 40 rounded up to 64
        assert fake_lse.dim() == 1 and isinstance(fake_lse.shape[0], torch.SymInt)


# ----------------------------------------------------- the real kernels (FXTRAIN_TEST_DEVICE)
_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if ON_CUDA else [])


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_route_matches_padded_sdpa(dtype, causal):
    """The test device's route for ``dtype`` (CUDA: efficient or flash, one call; CPU: per run)
    against SDPA over the padded layout in float64, values and gradients."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 3, 0, 70, 1, 17]
    tokens, heads, dim = sum(lengths), 4, 64
    q, k, v = (to_device(torch.randn(tokens, heads, dim, generator=g).to(dtype)).requires_grad_() for _ in range(3))
    if ON_CUDA:
        assert va._route_of(q, v) in va.VARLEN_ROUTES
    out, _ = va.varlen_attention(q, k, v, torch.tensor(lengths), 0.125, causal)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = va.reference(*wide, lengths, 0.125, causal)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    grad = torch.randn(out.shape, generator=g).to(out.device)
    ours = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    theirs = torch.autograd.grad(ref, wide, grad.double())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.skipif(not ON_CUDA, reason="kernel launches are counted on CUDA (FXTRAIN_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_launches_do_not_grow_with_sequences(dtype):
    """One kernel call per direction: a forward and backward over 3 sequences launch as many CUDA
    kernels as over 25 of different lengths, and no device-to-host copy (no synchronisation). Both
    have the same longest sequence: the efficient kernel's backward splits the keys of a long one
    over several blocks (``num_splits_key``, from the longest length) and then zeroes a workspace,
    one more kernel (H200, torch 2.11: 8 launches for a longest of 90, 7 for 47)."""
    def launches(lengths):
        q, k, v = (torch.randn(sum(lengths), 4, 64, device=current_device(), dtype=dtype, requires_grad=True) for _ in range(3))
        host = torch.tensor(lengths)
        va.varlen_attention(q, k, v, host, 0.125, True)[0].sum().backward()   # warm-up
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out, _ = va.varlen_attention(q, k, v, torch.tensor(lengths), 0.125, True)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert not [n for n in names if "DtoH" in n or "Device -> Pageable" in n], names
        return [n for n in names if "emcpy" not in n and "emset" not in n]
    few, many = launches([40, 7, 90]), launches(list(range(1, 49, 2)) + [90])
    assert len(few) == len(many), (few, many)
    assert len([n for n in few if "fmha" in n or "flash" in n or "attention" in n.lower()]) >= 2, few


# ------------------------------------------------ the capture pipeline on the one-call route
@pytest.mark.parametrize("kind", va.VARLEN_ROUTES)
@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_capture_with_the_one_call_route(kind, monkeypatch):
    """A whole capture (fake tracing with the route's fakes: the efficient lse's unbacked size
    through partitioning and saving for the backward) and training steps on the one-call route,
    its kernels emulated in plain torch: eager's loss, gradients and weights, and the backward met."""
    from fxtrain import models
    from utils import train_left_padded_gpt2, wrap_pair
    aten = _Emulated()
    monkeypatch.setattr(tp, "aten", aten)
    monkeypatch.setattr(va, "_route_of", lambda q, v: kind)
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64))
    train_left_padded_gpt2(tm, ref)
    assert f"{kind}_forward" in aten.calls and f"{kind}_backward" in aten.calls, aten.calls


@pytest.mark.cpu_only(reason="the CUDA route's fake costed on fake tensors (its kernels never run): the CPU's route is the oracle")
@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_the_profiler_costs_the_efficient_route(monkeypatch):
    """The efficient route's log-sum-exp is sized by the lengths' values: an unbacked size in a
    capture, and in the profiler's fake step (no shape environment) a size its fake cannot give,
    which made the profiler give up the capture and cost eager's step on a GPU. Sized there from
    the batch's lengths: the passes stay on and the FLOPs are those of the CPU's route."""
    from fxtrain import models, profile
    batch = models.preset_batch("bert-tiny", 8, 64, padding=0.5, label_density=0.1)
    cpu = profile(models.build("bert-tiny"), reuse=False, **batch)
    monkeypatch.setattr(va, "_route_of", lambda q, v: "efficient")
    cuda = profile(models.build("bert-tiny"), reuse=False, **batch)
    assert cuda.passes["padding_elimination"].startswith("on:"), cuda.passes
    assert not cuda.unknown_ops, cuda.unknown_ops
    assert (cuda.flops_forward, cuda.flops_backward) == (cpu.flops_forward, cpu.flops_backward)
