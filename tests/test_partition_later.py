"""A static capture's first calls run in the autograd mode while the partition worker partitions it
(runtime/pending.py, capture/partition_worker.py). Eager PyTorch is the oracle before, at and after
the switch; ``CaptureInfo.wait_for_partitions`` makes the switch happen at a known step."""
import contextlib
import copy
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import fxtrain
from fxtrain import models
from fxtrain import torch_private as tp
from fxtrain.capture import partition_worker
from fxtrain.capture.backend import Backend
from fxtrain.cost import launches
from utils import assert_grads_equal, assert_state_equal, to_device


def _bert():
    torch.manual_seed(0)
    return to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))   # dropout 0.1 as HF's default


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return to_device(models.synthetic_batch("mlm", 4, 32, 1000, padding=0.4, label_density=0.2, generator=g))


def _train(tm, ref, steps, wait_after=None, tol=(1e-5, 1e-4), forward_context=contextlib.nullcontext):
    """Steps of both copies from the same random state; the runtime mode each fxtrain step ran.
    ``forward_context``: entered around each step's forwards (autocast's documented use: one
    context a step, as its cache of cast weights lasts as long as the context)."""
    atol, rtol = tol
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tm, ref)]
    modes = []
    for step in range(steps):
        batch = _batch(step % 2)
        state = torch.get_rng_state()
        modes.append(tm._info.records[0].run.mode if tm._info.records else "capture")
        with forward_context():
            loss = tm(**batch).loss
            torch.set_rng_state(state)
            ref_loss = ref(**batch).loss
        torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=atol, rtol=rtol)
        for opt in opts:
            opt.step(); opt.zero_grad()
        if step == wait_after:
            assert tm._info.wait_for_partitions(300), "the partition did not come back"
    assert_state_equal(tm.module, ref, atol=atol)
    return modes


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_first_calls_run_the_autograd_mode_then_the_workers_partition(monkeypatch):
    # Every backward pass pays here, so the whole step runs the aten graphs: the switch changes mode.
    monkeypatch.setattr(launches, "BYTES_PER_BACKWARD_OP", 0)
    model = _bert()
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    modes = _train(tm, ref, 5, wait_after=1)
    info = tm.capture_info()
    record = info.records[0]
    assert len(info.records) == 1, info.capture_reasons
    # Capture, then the autograd mode until the worker's partition is back (awaited after step 1).
    assert modes[:2] == ["capture", "autograd"], modes
    assert modes[2:] == ["graph"] * 3, (modes, record.runtime)
    assert record.pending.seconds is not None and not record.pending.error, str(record.pending)
    assert record.step.forward_graph is not None and record.step.spec is not None
    assert info.optimizations["cross_entropy_grad"].startswith("on"), info.optimizations
    assert info.optimizations["label_sparsity"].startswith("on"), info.optimizations
    # executor="auto": the tier comes with the whole step, and reads its graphs as a capture's own:
    # the passes' data-dependent sizes do not keep it on the eager executor, Options.compile_after does.
    assert record.tier is not None and "compile starts 10 s after its first call" in str(record.tier), str(record.tier)
    # The worker yields the cores to the loop (nice 19, set before it imports torch).
    if hasattr(os, "getpriority"):
        assert os.getpriority(os.PRIO_PROCESS, partition_worker._proc.pid) == 19


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_under_autocast_the_worker_traces_as_the_capture_would(monkeypatch):
    # AOTAutograd bakes autocast's casts into the aten graphs: the worker must trace under the
    # loop's autocast, giving the graphs a partition at capture gives (and eager's numbers).
    monkeypatch.setattr(launches, "BYTES_PER_BACKWARD_OP", 0)
    device = to_device(torch.zeros(0)).device.type
    model = _bert()
    ref, at_capture = copy.deepcopy(model), copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    bf16 = lambda: torch.autocast(device, dtype=torch.bfloat16)   # noqa: E731
    modes = _train(tm, ref, 4, wait_after=1, tol=(2e-2, 2e-2), forward_context=bf16)
    monkeypatch.setattr(Backend, "partitions_later", lambda *a: False)
    whole = fxtrain.TrainModule(at_capture)
    with bf16():
        loss = whole(**_batch(0)).loss
    loss.backward()
    assert modes == ["capture", "autograd", "graph", "graph"], modes
    later, now = tm.capture_info().records[0], whole.capture_info().records[0]
    assert later.pending is not None and now.pending is None
    assert "torch.bfloat16" in later.step.forward_graph.code
    assert _code(later.step.forward_graph) == _code(now.step.forward_graph)
    assert _code(later.step.backward_graph) == _code(now.step.backward_graph)


def test_a_graph_calling_a_librarys_custom_op_is_partitioned_by_the_worker():
    """HF's mixture-of-experts layers call ``transformers::grouped_mm_fallback``, a custom op that
    exists in a process once ``transformers.integrations.moe`` is imported. The worker now imports
    the modules of the custom ops a graph calls before loading it (torch_private.custom_op_modules);
    before, its partition failed ("'_OpNamespace' 'transformers' object has no attribute
    'grouped_mm_fallback'") and the capture stayed in the autograd mode. Losses as eager's."""
    import transformers
    config = transformers.MixtralConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = to_device(transformers.MixtralForCausalLM(config))
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = to_device(models.synthetic_batch("clm", 4, 16, 1000, padding=0.3, generator=g))
        loss, ref_loss = tm(**batch).loss, ref(**batch).loss
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref)
        if step == 0:
            assert tm.capture_info().wait_for_partitions(300), "the partition did not come back"
    (record,) = tm.capture_info().records
    calls = {str(n.target) for n in record.dynamo_graph.graph.nodes if n.op == "call_function"}
    assert any("grouped_mm_fallback" in c for c in calls), sorted(calls)
    assert record.pending is not None and "grouped_mm_fallback" not in record.pending.error, str(record.pending)
    if tp.torch_at_least(2, 13):
        assert record.pending.seconds is not None and not record.pending.error, str(record.pending)
    # 2.11: the op loads, and the retrace then fails on the routing's data-dependent sizes
    # ("Could not guard on data-dependent expression Eq(u0, 0)"): the capture keeps the autograd mode.


@pytest.mark.cpu_only(reason="checks a process's exit: the worker's pipes are the same whatever the device")
def test_a_process_that_used_the_worker_exits_without_resource_warnings():
    # Python's development mode shows every ResourceWarning; the worker's two pipes, left open,
    # printed "sys:1: ResourceWarning: unclosed file <_io.BufferedReader ...>" at every such exit.
    script = textwrap.dedent("""
        import torch, fxtrain
        from fxtrain import models
        from fxtrain.capture import partition_worker
        tm = fxtrain.TrainModule(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
        batch = models.synthetic_batch("mlm", 4, 16, 1000, padding=0.3, label_density=0.2)
        tm(**batch).loss.backward()
        assert tm.capture_info().wait_for_partitions(300)
        print("worker used:", partition_worker._proc is not None)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXTRAIN_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-X", "dev", "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker used: True" in done.stdout, done.stdout
    assert "ResourceWarning" not in done.stderr, done.stderr[-3000:]


def _code(gm):
    """A graph's code without the per-capture keys of its host-count ops (runtime/host_counts.py)."""
    return re.sub(r"(fxtrain_host\.\w+\.default\(\w+), -?\d+\)", r"\1, KEY)", gm.code)


def test_a_failed_partition_keeps_the_autograd_mode(monkeypatch, caplog):
    def fails(request, timeout=None):
        raise RuntimeError("no worker today")
    monkeypatch.setattr(partition_worker, "partition", fails)
    model = _bert()
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        modes = _train(tm, ref, 4, wait_after=1)
    assert modes == ["capture", "autograd", "autograd", "autograd"], modes
    record = tm.capture_info().records[0]
    assert "no worker today" in record.pending.error
    failed = [r.message for r in caplog.records if "its partition failed (no worker today)" in r.message]
    assert len(failed) == 1 and failed[0].endswith("it keeps running in the autograd mode"), failed


# The inductor case (36 s, inductor compiling BERT) runs in make test-long: make test keeps the
# other two captures that need their partition first, and test_module's inductor executor parity.
@pytest.mark.parametrize("options", [dict(dynamic=True), dict(backward="graph"),
                                     pytest.param(dict(executor="inductor"), marks=pytest.mark.extended)],
                         ids=["symbolic", "graph-mode", "inductor"])
def test_captures_that_need_their_partition_first_make_it_at_capture(options):
    tm = fxtrain.TrainModule(_bert(), fxtrain.Options(**options))
    tm(**_batch(0)).loss.backward()
    record = tm._info.records[0]
    assert record.pending is None and record.step.forward_graph is not None


def test_the_first_size_change_captures_without_waiting_for_the_workers_partition(monkeypatch):
    """Step 2 with new sizes sends the first capture's request and captures symbolically beside it:
    the symbolic capture's sympy budget, which counts that partition, is read once it is back
    (capture/sizes.py: sympy_budget). It used to wait for the worker first (bert-mlm step 2 14.65 s)."""
    release = threading.Event()
    real = partition_worker.partition

    def held(request, timeout=partition_worker.TIMEOUT):
        assert release.wait(300), "never released"
        return real(request, timeout)
    monkeypatch.setattr(partition_worker, "partition", held)
    model = _bert()
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    g = torch.Generator().manual_seed(3)
    batches = [to_device(models.synthetic_batch("mlm", b, s, 1000, padding=0.4, label_density=0.2, generator=g))
               for b, s in [(4, 32), (3, 24), (5, 40)]]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tm, ref)]
    for step, batch in enumerate(batches):
        state = torch.get_rng_state()
        loss = tm(**batch).loss
        torch.set_rng_state(state)
        ref_loss = ref(**batch).loss
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=1e-5, rtol=1e-4)
        for opt in opts:
            opt.step(); opt.zero_grad()
        if step == 1:
            first = tm._info.records[0].pending
            # The symbolic capture is made and ran while the first capture's partition is still out.
            assert len(tm._info.records) == 2 and not first.done, tm._info.capture_reasons
            assert tm._sizes.later_partitions() is None
            release.set()
    assert tm.capture_info().wait_for_partitions(300)
    assert len(tm._info.records) == 2, tm._info.capture_reasons   # step 3's sizes: the symbolic graph
    assert tm._sizes.later_partitions() == pytest.approx(tm._info.records[0].pending.cpu_seconds)
    assert tm._info.records[0].pending.cpu_seconds > 0 and not tm._info.records[0].pending.error
    assert_state_equal(tm.module, ref, atol=1e-5)


_OPS_MODULE = '''
import torch

@torch.library.custom_op("{ns}::scale", mutates_args=())
def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s

@scale.register_fake
def _(x, s):
    return torch.empty_like(x)

def _backward(ctx, grad):
    return grad * ctx.s, None

def _setup(ctx, inputs, output):
    ctx.s = inputs[1]

scale.register_autograd(_backward, setup_context=_setup)
'''


class _Scaled(torch.nn.Module):
    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace   # the op by name: a module holding the op itself does not deepcopy
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        scale = getattr(torch.ops, self.namespace).scale
        return self.b(torch.relu(scale(self.a(x), 2.0))).square().mean()


def _train_scaled(namespace, steps=3, wait_after=0):
    torch.manual_seed(0)
    model = to_device(_Scaled(namespace))
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    for step in range(steps):
        x = to_device(torch.randn(8, 16))
        loss, ref_loss = tm(x), ref(x)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref)
        if step == wait_after:
            assert tm.capture_info().wait_for_partitions(300), "the partition did not come back"
    return tm


def test_a_custom_op_from_a_module_beside_the_script_is_partitioned_by_the_worker(tmp_path, monkeypatch):
    """``python scripts/train.py`` puts ``scripts/`` on the path of that process only: a custom op
    defined in ``scripts/my_ops.py`` did not import in the worker, whose partition failed
    ("'_OpNamespace' ... has no attribute 'scale'"), and the capture kept the autograd mode. The
    payload now carries this process's ``sys.path`` (torch_private.pickle_graphs); the worker here
    may have been started by an earlier test, with the path of that time."""
    name = f"fxtrain_beside_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(_OPS_MODULE.format(ns=name))
    monkeypatch.syspath_prepend(str(tmp_path))   # this process's path, not PYTHONPATH
    assert str(tmp_path) not in os.environ.get("PYTHONPATH", "")
    __import__(name)
    tm = _train_scaled(name)
    (record,) = tm.capture_info().records
    assert tp.custom_op_modules(record.dynamo_graph) == [name]
    assert record.pending is not None and record.pending.seconds is not None, str(record.pending)
    assert not record.pending.error, str(record.pending)
    assert record.step.forward_graph is not None   # the worker's aten graphs


def test_a_custom_op_defined_in_main_partitions_at_capture_and_says_why_it_stays_eager():
    """A custom op defined in the user's script (``__main__``) cannot be imported by a worker:
    another process's ``__main__`` is its own. The capture partitions in this process instead of
    failing in the worker, and the compiled tier says why it keeps the eager executor."""
    def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s
    scale.__module__ = "__main__"   # what a definition at a script's top level has
    ns = f"fxtrain_main_{os.getpid()}"
    op = torch.library.custom_op(f"{ns}::scale", scale, mutates_args=())
    op.register_fake(lambda x, s: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: (grad * ctx.s, None),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))
    tm = _train_scaled(ns, wait_after=None)
    (record,) = tm.capture_info().records
    assert record.pending is None and record.step.forward_graph is not None   # partitioned at capture
    (tier,) = tm.capture_info().tiers
    assert f"custom op {ns}::scale defined in __main__" in tier, tier
    with pytest.raises(tp.NotPortable, match="defined in __main__"):
        tp.pickle_graphs(record.step.forward_graph, for_another_process=True)


@pytest.mark.cpu_only(reason="starts a worker process that makes no tensor")
def test_a_worker_imports_this_process_fxtrain_whatever_its_current_directory(tmp_path, monkeypatch):
    """``python -c`` puts the current directory first on a worker's path: started from another
    checkout's root, the worker imported that checkout's fxtrain (an A/B run of bench/overhead.py
    failed every partition with "JSONDecodeError", the other checkout's payload format)."""
    from fxtrain.runtime import threads
    (tmp_path / "fxtrain").mkdir()
    (tmp_path / "fxtrain" / "__init__.py").write_text("raise ImportError('the other checkout')\n")
    (tmp_path / "fxtrain_which_probe.py").write_text("import fxtrain\nprint('imported', fxtrain.__file__)\n")
    monkeypatch.chdir(tmp_path)
    done = subprocess.run(threads.worker_command("fxtrain_which_probe"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"imported {Path(fxtrain.__file__)}" in done.stdout, done.stdout
