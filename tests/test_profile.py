"""fxtrain.profile: FLOPs against analytic counts, peak memory against real steps, batch scaling, CLI.

Oracles: closed-form FLOP counts of the contractions, and the live tensor bytes of the same step run
for real (fxtrain/profile/measure.py counts every storage the real step allocates, PythonOp
internals included). Models are tiny so the real runs are cheap; the fake runs do not care.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from fxtrain import models
from fxtrain.capture import pipeline
from fxtrain.cost.launches import ACCELERATOR
from fxtrain.cost.flops import attention_backward_flops, attention_flops
from fxtrain.profile.measure import measure_step
from fxtrain.profile import ProfileError
from utils import current_device, long_params, to_device

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ------------------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 128, d_out: int = 10) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(F.gelu(self.fc1(x))))
        return F.cross_entropy(self.fc3(h), y)


class Attention(nn.Module):
    """Projections plus torch's scaled_dot_product_attention (the CPU flash kernel runs it)."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum()


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 8, 5, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x))).square().mean()


class ScaledSquare(torch.autograd.Function):
    """A custom Function fxtrain keeps as a PythonOp: allocates and saves inside its forward."""

    @staticmethod
    def forward(ctx, x, w):
        h = x @ w
        ctx.save_for_backward(x, w, h)
        return h * h

    @staticmethod
    def backward(ctx, g):
        x, w, h = ctx.saved_tensors
        gh = 2 * g * h
        return gh @ w.t(), x.t() @ gh

    @staticmethod
    def flops(x, w):
        m, k = x.shape
        n = w.shape[1]
        return 2 * m * k * n, 4 * m * k * n


class NoFlops(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class WithPythonOps(nn.Module):
    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ScaledSquare.apply(self.inp(x), self.w)
        return self.out(NoFlops.apply(h)).mean()


def _linear_flops(rows: int, d_in: int, d_out: int) -> int:
    return 2 * rows * d_in * d_out


# -------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("optimizations", [False, True])
def test_mlp_flops_are_the_analytic_count(optimizations):
    model = to_device(MLP())
    B = 96
    report = fxtrain.profile(model, *to_device((torch.randn(B, 32), torch.randint(0, 10, (B,)))),
                             optimizations=optimizations)
    fwd = _linear_flops(B, 32, 128) + _linear_flops(B, 128, 128) + _linear_flops(B, 128, 10)
    # backward: weight grads for all three layers, input grads for fc2 and fc3 (x needs none)
    bwd = 2 * fwd - 2 * B * 32 * 128
    assert report.flops_forward == fwd
    assert report.flops_backward == bwd
    assert report.by_module["fc1"].flops_forward == _linear_flops(B, 32, 128)
    assert report.by_module["fc1"].flops_backward == _linear_flops(B, 32, 128)
    assert report.by_module["fc2"].flops_backward == 2 * _linear_flops(B, 128, 128)
    assert report.by_module["fc2"].params == 128 * 128 + 128
    assert report.unknown_ops == []


def test_matmul_on_shapes_only_inputs_at_huge_batch():
    model = to_device(MLP())   # shapes-only inputs are costed on the model's device
    B = 10 ** 9  # 128 GB of activations if it were real
    report = fxtrain.profile(model, fxtrain.shapes_only((B, 32)), fxtrain.shapes_only((B,), torch.long),
                             optimizations=False)
    assert report.flops_forward == _linear_flops(B, 32, 128) + _linear_flops(B, 128, 128) + _linear_flops(B, 128, 10)
    assert report.peak_memory_bytes > B * 128 * 4 * 2


@pytest.mark.cpu_only(reason="the CPU's SDPA kernel, which torch's FLOP counter scores 0")
@pytest.mark.parametrize("optimizations", [False, True])
def test_attention_flops_count_the_cpu_sdpa_kernel(optimizations):
    from torch.utils.flop_counter import FlopCounterMode
    B, S, D, H = 3, 40, 64, 4
    model = Attention(D, H)
    x = torch.randn(B, S, D, requires_grad=True)
    report = fxtrain.profile(model, x, optimizations=optimizations)
    proj = _linear_flops(B * S, D, 3 * D)
    E = D // H
    assert attention_flops((B, H, S, E), (B, H, S, E), (B, H, S, E)) == 4 * B * H * S * S * E
    assert attention_backward_flops((B, H, S, E), (B, H, S, E), (B, H, S, E)) == 10 * B * H * S * S * E
    assert report.flops_forward == proj + 4 * B * H * S * S * E
    assert report.flops_backward == 2 * proj + 10 * B * H * S * S * E
    # torch's own counter scores the CPU kernel 0: only the projection is seen there
    with FlopCounterMode(display=False) as counter:
        model(x).backward()
    assert counter.get_total_flops() == 3 * proj


def test_conv_flops_are_the_analytic_count():
    model = to_device(Conv())
    x = to_device(torch.randn(2, 3, 20, 20))
    report = fxtrain.profile(model, x, optimizations=False)
    c1 = 2 * (2 * 16 * 20 * 20) * 3 * 9            # out elements x Cin x kernel
    c2 = 2 * (2 * 8 * 8 * 8) * (16 // 2) * 25      # 20 -> (20 - 5) // 2 + 1 = 8; groups=2
    assert report.flops_forward == c1 + c2
    # conv1: weight grad only (x needs no grad); conv2: weight and input grads
    assert report.flops_backward == c1 + 2 * c2


def test_python_op_flops_come_from_its_flops_method_or_are_unknown():
    torch.manual_seed(0)
    model = to_device(WithPythonOps())
    B, d = 64, 48
    report = fxtrain.profile(model, to_device(torch.randn(B, d)))
    linear = _linear_flops(B, d, d) + _linear_flops(B, d, 1)
    assert report.flops_forward == linear + 2 * B * d * d
    # inp: weight grad (x needs none); out: weight and input grads; ScaledSquare: its own 4mkn
    assert report.flops_backward == _linear_flops(B, d, d) + 2 * _linear_flops(B, d, 1) + 4 * B * d * d
    unknown = {u.op: u for u in report.unknown_ops}
    assert any("NoFlops" in op for op in unknown), unknown
    assert not any("ScaledSquare" in op for op in unknown)
    assert {tuple(u.phases) for u in report.unknown_ops} == {("forward",), ("backward",)}


# ------------------------------------------------------------------------------- peak memory
def _assert_close_peak(estimate: int, measured: int) -> None:
    assert measured * 0.98 <= estimate <= measured * 1.05, (estimate, measured, estimate / measured)


def _hf_batch(name: str):
    return models.preset_batch(name, 4, 32, padding=0.3, label_density=0.2)


CASES = {
    "mlp": (lambda: MLP(), lambda: ((torch.randn(64, 32), torch.randint(0, 10, (64,))), {})),
    "pythonop": (lambda: WithPythonOps(), lambda: ((torch.randn(64, 48),), {})),
    "bert-tiny": (lambda: models.build("bert-tiny"), lambda: ((), _hf_batch("bert-tiny"))),
    "gpt2-tiny": (lambda: models.build("gpt2-tiny"), lambda: ((), _hf_batch("gpt2-tiny"))),
}


@pytest.mark.parametrize("case", long_params(sorted(CASES), keep=["mlp", "pythonop", "bert-tiny"]))
def test_peak_memory_matches_a_real_step(case):
    """Both costings (eager, fxtrain's graph) against the same step run for real, with and without AdamW."""
    build, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = to_device(build())
    args, kwargs = to_device(make_inputs())
    # The profiler costs the aten-graph runtime (profile/capture.py: MarkedExecutor); the default
    # runtime may pick the autograd mode on a model this small, which peaks a few percent higher.
    # Memory is costed as the eager executor allocates (inductor's fused kernels allocate less).
    eager = fxtrain.Options(executor="eager")
    real_tm = fxtrain.TrainModule(model, fxtrain.Options(executor="eager", fallback="raise", backward="graph"))
    for optimizer in (None, torch.optim.AdamW):
        for optimizations in (False, True):
            report = fxtrain.profile(model, *args, optimizer=optimizer, optimizations=optimizations, options=eager,
                                     **kwargs)
            runner = real_tm if optimizations else model
            measured = measure_step(runner, *args, optimizer=optimizer, params_model=model, **kwargs)
            _assert_close_peak(report.peak_memory_bytes, measured.peak_bytes)
            assert report.peak_memory_bytes >= report.parameter_bytes + report.optimizer_state_bytes
            if optimizer is not None:
                assert report.optimizer_state_bytes == 2 * report.parameter_bytes + 4 * len(list(model.parameters()))


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_passes_change_the_cost_as_fxtrain_runs_them():
    model = to_device(models.build("bert-tiny"))
    batch = models.preset_batch("bert-tiny", 8, 64, padding=0.5, label_density=0.1, device=current_device())
    eager = fxtrain.profile(model, optimizations=False, **batch)
    ours = fxtrain.profile(model, optimizations=True, **batch)
    assert ours.passes["label_sparsity"].startswith("on") and ours.passes["padding_elimination"].startswith("on")
    assert ours.flops_forward < 0.6 * eager.flops_forward
    assert ours.peak_memory_bytes < eager.peak_memory_bytes
    assert ours.saved_for_backward_bytes < eager.saved_for_backward_bytes
    assert ours.by_module["cls.predictions.decoder"].flops_forward < eager.by_module["cls.predictions.decoder"].flops_forward


def test_the_profile_costs_the_launch_models_decision_and_all_costs_every_pass(monkeypatch):
    """On an accelerator (its rates given to the test device's graphs here) the tiny model's passes
    cost more launches than they save: TrainModule turns them off, so ``optimizations=True`` costs
    the dense step; ``"all"`` keeps them (the FLOP-ideal: time following FLOPs, launches free)."""
    monkeypatch.setattr(pipeline, "rates_for", lambda device_type: ACCELERATOR)
    model = to_device(models.build("bert-tiny"))
    batch = models.preset_batch("bert-tiny", 8, 64, padding=0.5, label_density=0.1, device=current_device())
    runs = fxtrain.profile(model, optimizations=True, **batch)
    every = fxtrain.profile(model, optimizations="all", **batch)
    for name in ("label_sparsity", "padding_elimination"):
        assert runs.passes[name].startswith("off: on accelerator the step is bound by the host"), runs.passes
        assert every.passes[name].startswith("on"), every.passes
    assert every.flops_forward < 0.6 * runs.flops_forward   # the dense step's, as eager's in the test above
    with pytest.raises(ValueError, match="optimizations takes True, False or 'all'"):
        fxtrain.profile(model, optimizations="some", **batch)


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_a_capture_from_the_cache_costs_the_same_without_capturing(tmp_path):
    """Options.cache_dir serves the profiler as it serves TrainModule: the second costing loads the
    graphs (marked for attribution) instead of capturing, and every number is the same."""
    batch = models.preset_batch("bert-tiny", 8, 64, padding=0.5, label_density=0.1, device=current_device())
    options = fxtrain.Options(cache_dir=str(tmp_path))
    first = fxtrain.profile(to_device(models.build("bert-tiny")), optimizer="adamw", options=options, **batch)
    second = fxtrain.profile(to_device(models.build("bert-tiny")), optimizer="adamw", options=options, **batch)
    assert any(e.startswith("stored") for e in first.cache), first.cache
    assert len(second.cache) == 1 and second.cache[0].startswith("hit"), second.cache
    for field in ("flops_forward", "flops_backward", "peak_memory_bytes", "saved_for_backward_bytes",
                  "optimizer_state_bytes", "passes"):
        assert getattr(second, field) == getattr(first, field), field
    assert second.by_module == first.by_module and "cls.predictions.decoder" in second.by_module
    assert second.passes["label_sparsity"].startswith("on")
    assert "cache" in str(second)


# ------------------------------------------------------------------------------------ batches
def test_memory_fit_finds_the_largest_batch_for_a_budget():
    model = to_device(models.build("bert-tiny"))
    batch = models.preset_batch("bert-tiny", 4, 32, padding=0.3, label_density=0.2, device=current_device())
    report = fxtrain.profile(model, optimizer="adamw", **batch)
    budget = 64 * 2 ** 20
    best = report.max_batch(budget)
    assert best > 4
    fit = report.fit
    assert fit is not None and fit.batch == best and fit.checked_peak_bytes <= budget
    assert len(fit.points) >= 3
    # the third (checking) run is a real fake run, and one more row would not fit by the fit
    assert fit.intercept + fit.slope * (best + 1) > budget * 0.99
    # scaled runs keep the batch's densities: FLOPs grow linearly with the batch
    double = report.at_batch(8)
    assert double.flops_forward == pytest.approx(2 * report.flops_forward, rel=0.05)


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_equal_options_reuse_the_capture_and_other_options_do_not(caplog):
    """A second costing with equal (not identical) Options costs another batch without capturing;
    options that change the graph (a pass turned off) get their own capture and their own numbers."""
    model = to_device(models.build("bert-tiny"))
    small = models.preset_batch("bert-tiny", 4, 32, padding=0.3, label_density=0.2, device=current_device())
    large = models.preset_batch("bert-tiny", 8, 32, padding=0.3, label_density=0.2, device=current_device())
    with caplog.at_level("INFO", logger="fxtrain"):
        first = fxtrain.profile(model, optimizer="adamw", options=fxtrain.Options(upstream_slicing="off"), **small)
        captures = sum("captured graph" in r.getMessage() for r in caplog.records)
        again = fxtrain.profile(model, optimizer="adamw", options=fxtrain.Options(upstream_slicing="off"), **large)
        assert sum("captured graph" in r.getMessage() for r in caplog.records) == captures > 0
        off = fxtrain.profile(model, optimizer="adamw", options=fxtrain.Options(label_sparsity="off"), **small)
        assert sum("captured graph" in r.getMessage() for r in caplog.records) > captures
    fresh = fxtrain.profile(to_device(models.build("bert-tiny")), optimizer="adamw",
                            options=fxtrain.Options(upstream_slicing="off"), **large)
    assert first.passes["label_sparsity"].startswith("on") and off.passes["label_sparsity"].startswith("off")
    assert off.flops_forward > first.flops_forward
    for field in ("flops_forward", "flops_backward", "peak_memory_bytes", "saved_for_backward_bytes"):
        assert getattr(again, field) == getattr(fresh, field), field


def test_a_step_that_captures_is_measured_again():
    """With static sizes each batch size captures; that capture happens inside the costed step of
    the second batch. Its tracing must not count: the numbers equal a fresh model's at that batch."""
    static = fxtrain.Options(dynamic=False)
    small = models.preset_batch("bert-tiny", 4, 32, padding=0.3, label_density=0.2, device=current_device())
    large = models.preset_batch("bert-tiny", 12, 32, padding=0.3, label_density=0.2, device=current_device())
    model = to_device(models.build("bert-tiny"))
    fxtrain.profile(model, optimizer="adamw", options=static, **small)
    second = fxtrain.profile(model, optimizer="adamw", options=static, **large)
    fresh = fxtrain.profile(to_device(models.build("bert-tiny")), optimizer="adamw", options=static, **large)
    for field in ("flops_forward", "flops_backward", "peak_memory_bytes", "saved_for_backward_bytes",
                  "optimizer_state_bytes"):
        assert getattr(second, field) == getattr(fresh, field), field
    assert second.by_module == fresh.by_module
    assert second.timeline == fresh.timeline      # the plotted step holds no tracing of the capture


class RecapturesEveryCall(nn.Module):
    """Each call adds a dict key its output depends on: every call fails dynamo's guards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[f"call{len(self.seen)}"] = True
        return (self.lin(x) * len(self.seen)).sum()


def test_a_model_that_never_reaches_a_steady_state_is_refused():
    with pytest.raises(ProfileError, match="captures a new graph on every call"):
        fxtrain.profile(to_device(RecapturesEveryCall()), to_device(torch.randn(4, 8)), optimizer="adamw")


def test_profiling_memory_stays_flat_as_batch_grows():
    model = to_device(MLP())
    small = fxtrain.profile(model, fxtrain.shapes_only((10, 32)), fxtrain.shapes_only((10,), torch.long),
                            optimizer="adamw", optimizations=False)
    before = _rss_bytes()
    big = small.at_batch(10 ** 10)       # ~5 TB of activations
    after = _rss_bytes()
    assert big.peak_memory_bytes > 10 ** 12
    assert after - before < 64 * 2 ** 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_meta_model_and_inputs():
    with torch.device("meta"):
        model = models.PRESETS["bert-tiny"].build()
    B, S = 10 ** 5, 64
    inputs = fxtrain.fake_inputs(input_ids=((B, S), torch.long), attention_mask=((B, S), torch.long),
                                 labels=((B, S), torch.long))
    with torch.device(current_device()):   # nothing real: costed on torch's default device
        report = fxtrain.profile(model, optimizations=False, **inputs)
    real_model = to_device(models.build("bert-tiny"))
    small = fxtrain.profile(real_model, optimizations=False, **models.preset_batch(
        "bert-tiny", 10, S, padding=0.0, label_density=1.0, device=current_device()))
    assert report.flops_forward == small.flops_forward * 10 ** 4
    assert report.flops_backward == small.flops_backward * 10 ** 4


# ------------------------------------------------------------------------------------ outputs
def test_report_outputs(tmp_path):
    model = to_device(MLP())
    report = fxtrain.profile(model, *to_device((torch.randn(16, 32), torch.randint(0, 10, (16,)))),
                             optimizer=torch.optim.AdamW, optimizations=False)
    data = json.loads(report.to_json())
    assert data["flops_forward"] == report.flops_forward and data["peak_memory_bytes"] == report.peak_memory_bytes
    assert set(data["by_module"]) >= {"fc1", "fc2", "fc3"}
    assert torch.device(data["device"]).type == current_device().type   # what the step is costed for
    text = str(report)
    assert "peak memory" in text and "fc2" in text and "FLOPs forward" in text
    assert [line.split()[1] for line in text.splitlines() if line.startswith("device ")] == [data["device"]]
    import matplotlib  # noqa: F401  (a pinned dependency: its absence is a failure, not a skip)
    path = report.plot(str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cpu_only(reason="a fresh process whose factory builds its own CPU model")
def test_cli_profiles_a_factory_file(tmp_path):
    factory = tmp_path / "model.py"
    factory.write_text(textwrap.dedent("""
        import torch
        def make(batch, seq):
            model = torch.nn.Sequential(torch.nn.Linear(seq, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
            return model, (torch.randn(batch, seq),)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(fxtrain.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "fxtrain.cli", "profile", f"{factory}:make", "--batch", "1000",
                          "--seq", "16", "--optimizer", "adamw", "--budget", "1GiB", "--json", "--no-progress",
                          "--plot", str(tmp_path / "x.png")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["flops_forward"] == 2 * 1000 * (16 * 64 + 64 * 1)
    assert data["fit"]["batch"] > 1000 and data["fit"]["checked_peak_bytes"] <= 2 ** 30
    assert os.path.getsize(tmp_path / "x.png") > 0


def test_inputs_may_be_fake_tensors_of_another_mode_and_model_a_train_module():
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = to_device(MLP())
    B = 10 ** 7
    with FakeTensorMode():
        x, y = torch.empty(B, 32, device=current_device()), torch.empty(B, dtype=torch.long, device=current_device())
    report = fxtrain.profile(fxtrain.TrainModule(model), x, y)
    assert report.flops_forward == _linear_flops(B, 32, 128) + _linear_flops(B, 128, 128) + _linear_flops(B, 128, 10)
    assert report.by_module["fc3"].params == 128 * 10 + 10


class NumpyTanh(torch.autograd.Function):
    """Leaves torch (numpy): cannot run on fake tensors, so its infer_shape gives the outputs."""

    @staticmethod
    def forward(ctx, x):
        y = torch.from_numpy(__import__("numpy").tanh(x.detach().cpu().numpy())).to(x.device)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)

    @staticmethod
    def infer_shape(x):
        return torch.empty_like(x)


class WithNumpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.b(NumpyTanh.apply(self.a(x))).mean()


def test_python_op_leaving_torch_is_costed_from_infer_shape():
    model = to_device(WithNumpy())
    B = 50
    report = fxtrain.profile(model, to_device(torch.randn(B, 16)))
    assert report.flops_forward == _linear_flops(B, 16, 32) + _linear_flops(B, 32, 1)
    assert report.flops_backward == _linear_flops(B, 16, 32) + 2 * _linear_flops(B, 32, 1)
    assert any("NumpyTanh" in u.op for u in report.unknown_ops)
    big = report.at_batch(10 ** 8)   # the numpy Function never runs: only its infer_shape
    assert big.flops_forward == report.flops_forward * (10 ** 8 // B)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:              # a Python branch on data: needs the input's values
            return self.fc(x).sum()
        return self.fc(x * 2).square().sum()


def test_data_dependent_branch_reads_real_inputs_and_refuses_shapes_only():
    model = to_device(Branchy())
    report = fxtrain.profile(model, to_device(torch.ones(4, 8)), optimizations=False)
    assert report.flops_forward == _linear_flops(4, 8, 8)
    with pytest.raises(ProfileError):
        fxtrain.profile(model, fxtrain.shapes_only((4, 8)), optimizations=False, reuse=False)


def test_cli_builtin_model_table(capsys):
    from fxtrain.cli import main
    code = main(["profile", "llama-tiny", "--batch", "100000", "--seq", "64", "--optimizer", "adamw",
                 "--no-optimizations", "--no-progress", "--device", str(current_device())])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "LlamaForCausalLM" not in out and "llama-tiny" in out
    # shapes-only inputs on meta weights: costed for the device named, as the report says
    assert [torch.device(line.split()[1]).type for line in out.splitlines() if line.startswith("device ")] == \
        [current_device().type]
    assert "model.layers" in out and "peak memory" in out and "unknown ops" in out


class Uncapturable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.fc(x).sum()


def test_module_fxtrain_cannot_capture_is_costed_as_the_eager_fallback():
    # fullgraph=True turns the graph break into a capture failure; fxtrain would then run eagerly
    report = fxtrain.profile(to_device(Uncapturable()), to_device(torch.randn(4, 8)),
                             options=fxtrain.Options(fullgraph=True))
    assert report.fallback is not None and "capture" in report.fallback
    assert report.flops_forward == _linear_flops(4, 8, 8)


def test_profiled_models_are_let_go(caplog):
    """Sessions (graphs) are reused for the last few models profiled; an older model is not kept
    alive by them (a cache keyed weakly by the model, whose sessions hold the model, kept every
    profiled model alive for good)."""
    import gc
    import weakref
    from fxtrain.profile import entry
    first = to_device(MLP())
    x, y = to_device((torch.randn(4, 32), torch.randint(0, 10, (4,))))
    with caplog.at_level("INFO", logger="fxtrain"):
        fxtrain.profile(first, x, y)
        captures = sum("captured graph" in r.getMessage() for r in caplog.records)
        fxtrain.profile(first, x, y)
        assert sum("captured graph" in r.getMessage() for r in caplog.records) == captures > 0
    gone = weakref.ref(first)
    for _ in range(entry.MAX_MODELS_KEPT):
        fxtrain.profile(to_device(MLP()), x, y)
    del first
    torch._dynamo.reset()   # dynamo keeps every compile backend (hence its TrainModule) until a reset
    gc.collect()
    assert gone() is None


@pytest.mark.cpu_only(reason="fake CUDA parameters: the step torch picks for a device type, with or without a GPU")
def test_costed_optimizer_steps_as_torch_does_on_the_parameters_device():
    """Torch's optimizers default to the multi-tensor (foreach) step for plain parameters on a GPU,
    never for fake tensors: the profiler's optimizer over fake copies takes the real parameters'
    choice (a CPU run made to choose as a GPU does put a BERT-tiny step's peak 8% above the cost).
    A choice the user made (foreach, fused) is theirs."""
    from fxtrain.cost.step import optimizer_over
    from fxtrain.torch_private import FakeTensorMode
    with FakeTensorMode():
        for device, expected in (("cuda", True), ("cpu", False)):
            params = [nn.Parameter(torch.empty(4, 4, device=device)), nn.Parameter(torch.empty(4, device=device))]
            assert optimizer_over("adamw", params).param_groups[0]["foreach"] is expected, device
            user = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "foreach": False}], lr=0.1)
            rebuilt = optimizer_over(user, params, dict(zip(params, params)))
            assert [g["foreach"] for g in rebuilt.param_groups] == [expected, False], device
        fused = optimizer_over(lambda ps: torch.optim.AdamW(ps, fused=True), params)
        assert fused.param_groups[0]["foreach"] is None and fused.param_groups[0]["fused"]
