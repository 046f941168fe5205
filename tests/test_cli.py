"""The command line runs end to end on a tiny model and reports real, consistent numbers."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from fxtrain import bench, cli, models
from fxtrain.options import Options
from fxtrain.runtime.tiered import TRIAL_STEPS
from utils import current_device

TINY = ["--model", "bert-tiny", "--batch", "4", "--seq", "16", "--steps", "2", "--warmup", "0", "--no-progress"]


def test_bench_json_has_every_mode_with_parity(tmp_path, capsys):
    """A named workload's settings, overridden by explicit flags (model and sizes here), and the
    FLOP-ideal ratio, costed by the profiler on the first batch. torch.compile's CUDA-graph mode
    trains as eager does too (CUDA graphs on a GPU, torch.compile's default code elsewhere)."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--workload", "distilbert-mlm", *TINY, "--modes",
                     "eager,fxtrain,fxtrain:eager,dynamo,compile:reduce-overhead", "--flop-ideal", "--device", str(current_device()), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["config"]["model"], data["config"]["batch"], data["config"]["padding"],
            data["config"]["label_density"]) == ("bert-tiny", 4, 0.5, 0.15)
    # Half the tokens are padding and 15% carry labels: fxtrain's step costs well under eager's.
    assert 1.3 < data["flop_ideal"] < 20, data["flop_ideal"]
    assert set(data["modes"]) == {"eager", "fxtrain", "fxtrain:eager", "dynamo", "compile:reduce-overhead"}
    for name, m in data["modes"].items():
        assert len(m["step_s"]) == 2 and all(t > 0 for t in m["step_s"]) and m["first_step_s"] > 0
        assert len(m["losses"]) == 3
        assert m["max_loss_diff_vs_eager"] < 1e-4, name
        assert m["ops_per_step"] > 0 and (m["kernels_per_step"] is None) == (current_device().type != "cuda"), name
        if name == "fxtrain":   # the default executor, "auto": two steps run on the eager executor
            assert m["tier"].startswith("eager") and m["tiers"], (name, m["tier"], m["tiers"])
        else:                   # no tiers with executor="eager", nor for PyTorch eager, torch.compile or dynamo
            assert m["tier"] == "-" and m["tiers"] == [], name
        # How fxtrain's steps ran (the runtime's mode and why); nothing for PyTorch's modes.
        assert bool(m["runtimes"]) == name.startswith("fxtrain"), (name, m["runtimes"])
        assert all(line.startswith("graph 0 (train): ") for line in m["runtimes"]), m["runtimes"]
    assert 0.4 < data["densities"]["padding"] < 0.7
    printed = capsys.readouterr().out
    assert "vs eager" in printed and "fxtrain:eager" in printed and "FLOP-ideal" in printed
    assert "tier at end" in printed and "ops/step" in printed and "kernels/step" in printed
    assert "Runtimes (fxtrain:eager):" in printed
    assert cli.main(["bench", "--list-workloads"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in bench.WORKLOADS)


def test_bench_under_bf16_autocast(tmp_path, capsys):
    """--autocast runs every mode's forward under torch.autocast: fxtrain's losses stay eager's
    (both in bf16, so within bf16's rounding), the table and the JSON say so."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", *TINY, "--modes", "eager,fxtrain", "--autocast", "bf16",
                     "--device", str(current_device()), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["autocast"] == "bf16"
    assert data["modes"]["fxtrain"]["max_loss_diff_vs_eager"] < 2e-2, data["modes"]["fxtrain"]
    assert "under bf16 autocast" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown autocast 'fp8'"):
        bench.BenchConfig(autocast="fp8")


@pytest.mark.cpu_only(reason="the settings of the GPU-sized workloads, not a run")
def test_gpu_sized_workloads_are_issue_17s():
    """The workloads a GPU user trains, by name, at the sizes the README gives."""
    w = {name: bench.WORKLOADS[name].config() for name in
         ("gpu-bert-base-mlm", "gpu-gpt2-small-sft", "gpu-llama-packed", "gpu-gpt2-small-dense")}
    assert (w["gpu-bert-base-mlm"].model, w["gpu-bert-base-mlm"].batch, w["gpu-bert-base-mlm"].seq) == ("bert-base", 32, 512)
    assert (w["gpu-bert-base-mlm"].padding, w["gpu-bert-base-mlm"].label_density) == (0.5, 0.15)
    assert (w["gpu-gpt2-small-sft"].batch, w["gpu-gpt2-small-sft"].seq, w["gpu-gpt2-small-sft"].padding) == (16, 1024, 0.3)
    assert w["gpu-gpt2-small-sft"].labels_at_end == 0.5 and w["gpu-gpt2-small-dense"].padding == 0.0
    assert (w["gpu-llama-packed"].batch, w["gpu-llama-packed"].seq, w["gpu-llama-packed"].packed) == (8, 4096, (32, 512))
    assert "hidden 1024, 8 layers, 16 heads, vocab 32000" in models.PRESETS["llama-1024"].about


def test_demo_prints_side_by_side_table(capsys):
    assert cli.main(["demo", *TINY, "--device", str(current_device())]) == 0
    printed = capsys.readouterr().out
    lines = [l for l in printed.splitlines() if l.startswith(("eager", "fxtrain"))]
    assert [l.split()[0] for l in lines] == ["eager", "fxtrain"]


@pytest.mark.cpu_only(reason="CLI argument parsing and listings: no tensors")
def test_options_lists_every_field(capsys):
    assert cli.main(["options"]) == 0
    printed = capsys.readouterr().out
    for f in dataclasses.fields(Options):
        assert f"FXTRAIN_{f.name.upper()}" in printed


def test_bench_runs_on_the_device_it_is_given(tmp_path, capsys):
    """``--device`` (default cpu): the test device here, FXTRAIN_TEST_DEVICE on a GPU machine."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", *TINY, "--modes", "eager,fxtrain", "--device", str(current_device()), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["device"] == str(current_device())
    assert data["modes"]["fxtrain"]["max_loss_diff_vs_eager"] < 1e-4
    assert f"on {current_device()}" in capsys.readouterr().out
    assert cli.main(["bench", *TINY, "--device", "no-such-device"]) == 2


@pytest.mark.cpu_only(reason="CLI argument parsing and listings: no tensors")
def test_bad_mode_is_a_one_line_error(capsys):
    assert cli.main(["bench", *TINY, "--modes", "eager,turbo"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    for device, says in (("no-such-device", "Invalid device string"), ("meta", "name the device it runs on")):
        assert cli.main(["profile", "gpt2-tiny", "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fxtrain profile: error: --device {device}: ") and says in err, err


@pytest.mark.cpu_only(reason="CLI argument parsing and listings: no tensors")
def test_console_script_runs():
    exe = os.path.join(os.path.dirname(sys.executable), "fxtrain")
    done = subprocess.run([exe, "options"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "FXTRAIN_EXECUTOR" in done.stdout
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


@pytest.mark.extended   # waits for a compile at nice 19: minutes while `make test`'s other worker is busy
def test_bench_shows_the_tier_switch(tmp_path, capsys):
    """fxtrain:auto with its compile awaited after the second step (--await-compiles): the progress
    bar and the "tier at end" column say that the compiled graphs ran the last step and since which
    step (a dense batch: no sparsity pass, whose data-dependent sizes would keep it eager); the
    eager mode's column says it has no tiers, and the losses stay eager's."""
    out = tmp_path / "bench.json"
    # The switch comes TRIAL_STEPS steps after the compile is seen ready (step 2), and the compiled
    # graphs then run TRIAL_STEPS steps before their time is compared: end inside them.
    switch = 2 + TRIAL_STEPS
    assert cli.main(["bench", "--model", "bert-tiny", "--batch", "4", "--seq", "16", "--padding", "0",
                     "--label-density", "1", "--warmup", "0", "--steps", str(switch + 2), "--device", str(current_device()),
                     "--modes", "eager,fxtrain:auto", "--await-compiles", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["modes"]
    assert data["fxtrain:auto"]["tier"] == f"inductor since step {switch}", data["fxtrain:auto"]["tiers"]
    assert data["eager"]["tier"] == "-"
    assert data["fxtrain:auto"]["max_loss_diff_vs_eager"] < 1e-3
    printed = capsys.readouterr()
    assert "tier at end" in printed.out and f"inductor since step {switch}" in printed.out
    assert "fxtrain:auto" in printed.err and f"inductor since step {switch}" in printed.err   # the bar


def test_ops_per_step_count_each_dispatch_once():
    """``bench.count_step`` counts what a step dispatches, additively: each extra layer of a stack
    adds the same number of ops (its forward, backward and optimizer update), on eager and fxtrain."""
    import torch
    from fxtrain import TrainModule

    def counts(layers, wrap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                      for _ in range(layers)]).to(current_device())
        fn = TrainModule(model, Options(executor="eager", fallback="raise")) if wrap else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = {"x": torch.randn(4, 8, device=current_device())}
        call = lambda x: {"loss": fn(x).square().mean()}
        for _ in range(2):   # the capture and a replay
            bench._step(call, opt, step)
        return bench.count_step(call, opt, step, current_device())

    for wrap in (False, True):
        (one, k1), (two, k2), (three, k3) = (counts(n, wrap) for n in (1, 2, 3))
        assert 0 < one < two < three and three - two == two - one, (wrap, one, two, three)
        if current_device().type == "cuda":
            assert 0 < k1 < k2 < k3 and k3 - k2 == k2 - k1, (wrap, k1, k2, k3)
