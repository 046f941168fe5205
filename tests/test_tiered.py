"""executor="auto" (runtime/tiered.py): each capture starts on the eager executor and moves to the
graphs a worker process compiled with inductor. Eager PyTorch is the oracle before, at and after the
switch; ``CaptureInfo.wait_for_compiles`` makes the switch happen at a known step."""
import contextlib
import logging
import time

import pytest
import torch
from torch import nn

import fxtrain
from fxtrain.runtime.tiered import TRIAL_STEPS
from utils import to_device, wrap_pair

# Inductor fuses and so reorders float sums (conftest.INDUCTOR_TOLERANCE: ten times the defaults).
COMPILED = dict(rtol=1.3e-5, atol=1e-4)


class Head(nn.Module):
    """Returns the logits beside the loss: the backward runs with the logits' gradient absent, the
    pattern the worker compiles ahead of the full backward."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 32), nn.Linear(32, 8), nn.Dropout(dropout)

    def forward(self, x, y):
        logits = self.b(self.drop(torch.tanh(self.a(x))))
        return nn.functional.cross_entropy(logits, y), logits


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return to_device((torch.randn(rows, 16, generator=g), torch.randint(0, 8, (rows,), generator=g)))


def _step(tm, ref, opts, batch, tolerance):
    losses = []
    seed = int(torch.randint(2 ** 31, ()))   # each model draws the same dropout masks, on any device
    for model, opt in zip((tm, ref), opts):
        torch.manual_seed(seed)
        opt.zero_grad()
        loss, _ = model(*batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], **tolerance)
    for (name, p), q in zip(tm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m: f"{name}: {m}")
    for opt in opts:
        opt.step()
    for p, q in zip(tm.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **tolerance)


EXACT = dict(rtol=1.3e-6, atol=1e-5)


def _switch(tm, ref, opts):
    """Two steps, the compile awaited, TRIAL_STEPS steps timed on the eager executor, then three
    on the compiled graphs (fewer than TRIAL_STEPS: no step time compared, no going back to eager)."""
    info = tm.capture_info()
    _step(tm, ref, opts, _batch(8, 0), EXACT)
    _step(tm, ref, opts, _batch(8, 1), EXACT)       # still eager unless the compile won the race
    assert info.wait_for_compiles(600), info.tiers
    tier = info.records[0].tier
    assert str(tier) == "eager, compiled graphs ready for the next step", str(tier)
    for seed in range(2, 2 + TRIAL_STEPS):
        _step(tm, ref, opts, _batch(8, seed), EXACT)
    assert tier.state == "compiling", str(tier)
    for seed in range(10, 13):
        _step(tm, ref, opts, _batch(8, seed), COMPILED)
    assert tier.state == "compiled" and tier.since_step == 2 + TRIAL_STEPS, str(tier)
    assert info.tiers[0].startswith(f"graph 0 (train): inductor since step {2 + TRIAL_STEPS} (compiled in "), info.tiers
    return tier


@pytest.mark.extended   # make test switches in the tests of symbolic sizes and of the warm start
def test_switch_is_exact():
    tm, ref = wrap_pair(Head(), executor="auto", dynamic=False)
    _switch(tm, ref, [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)])


@pytest.mark.extended   # 90 s; make test switches in the tests below (sparse symbolic, guards, warm start)
def test_each_capture_has_its_own_tier():
    """The switch, exact, dropout included (eager's masks on both sides of it); then another batch
    size: a new (static) capture, with a tier of its own, compiling while the first stays compiled,
    and switching at its own step."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(Head(dropout=0.5), executor="auto", dynamic=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    info = tm.capture_info()
    tier = _switch(tm, ref, opts)
    _step(tm, ref, opts, _batch(5, 5), EXACT)
    # Its compile waits for Options.compile_after (10 s) unless awaited, as below. (Its tier comes
    # with its partition, which capture_info() waits for: runtime/pending.py.)
    info = tm.capture_info()
    assert info.graphs == 2 and info.records[1].tier.state == "eager", info.tiers
    assert "compile starts 10 s after its first call" in str(info.records[1].tier), info.tiers
    assert tier.state == "compiled"
    _step(tm, ref, opts, _batch(8, 6), COMPILED)
    assert info.wait_for_compiles(600), info.tiers
    for seed in range(20, 20 + TRIAL_STEPS):
        _step(tm, ref, opts, _batch(5, seed), EXACT)
    _step(tm, ref, opts, _batch(5, 30), COMPILED)
    assert info.records[1].tier.since_step == 1 + TRIAL_STEPS, info.tiers
    assert f"tier graph 1 (train): inductor since step {1 + TRIAL_STEPS}" in str(info)


def test_failed_compile_stays_eager_and_logs_once(caplog):
    """A compile past Options.compile_timeout (the worker is stopped) is one WARNING; the capture
    keeps the eager executor's exact numbers."""
    tm, ref = wrap_pair(Head(), executor="auto", dynamic=False, compile_timeout=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        _step(tm, ref, opts, _batch(8, 0), EXACT)
        assert tm.capture_info().wait_for_compiles(60)
        for seed in (1, 2, 3):
            _step(tm, ref, opts, _batch(8, seed), EXACT)
    failed = [r for r in caplog.records if "stays on the eager executor" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]
    tier = tm.capture_info().records[0].tier
    assert tier.state == "eager" and "compile_timeout exceeded" in tier.reason, str(tier)


@pytest.mark.cpu_only(reason="a worker process that fails before it reads a graph: no tensors")
def test_a_failed_worker_is_reported_by_its_exception(tmp_path):
    """The reason a capture stays eager is the worker's exception as Python printed it, not the
    last line of its stderr: torch's errors end with advice ("Use tlparse to see full graph.")."""
    from fxtrain.runtime.tiered import Tier, _exception_line
    with pytest.raises(RuntimeError, match=r"^worker exited with 1: FileNotFoundError: .*absent"):
        Tier._run_worker(tmp_path / "absent", tmp_path / "made", False, 120.0, lambda: True)
    printed = ["Traceback (most recent call last):", '  File "decompositions.py", line 4702, in put',
               "    if x.numel() == 0:",
               "torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode: Could not guard on Eq(u4, 0)",
               "Caused by: (_decomp/decompositions.py:4702 in put)", "While executing %edb : [num_users=1] = ...",
               "Original traceback:", "Use tlparse to see full graph. (https://github.com/pytorch/tlparse)"]
    assert _exception_line(printed) == printed[3]
    assert _exception_line(["Killed"]) == "Killed" and _exception_line([]) == "no message"


@pytest.mark.parametrize("after", [0.0, 2.0])
def test_compile_starts_compile_after_seconds_after_the_first_call(after):
    """The default executor is "auto"; a capture's worker starts at its first call
    Options.compile_after seconds after its first (at the second call for 0), never before: a short
    run pays nothing for a compile. (compile_timeout stops the worker at once: whether it started is
    what is tested.)"""
    assert fxtrain.Options().executor == "auto" and fxtrain.Options().compile_after == 10.0
    tm, ref = wrap_pair(Head(), dynamic=False, compile_timeout=0.001, compile_after=after)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    tier = lambda: tm.capture_info().records[0].tier   # noqa: E731
    _step(tm, ref, opts, _batch(8, 0), EXACT)
    assert tier().state == "eager" and f"compile starts {after:g} s after its first call" in str(tier())
    _step(tm, ref, opts, _batch(8, 1), EXACT)
    if after:
        assert tier().state == "eager" and "Options.compile_after" in str(tier()), str(tier())
        time.sleep(after)
        _step(tm, ref, opts, _batch(8, 2), EXACT)
    assert "Options.compile_after" not in str(tier()), str(tier())   # started (waiting would start it)
    assert tm.capture_info().wait_for_compiles(60)
    assert "compile_timeout exceeded" in tier().reason, str(tier())
    _step(tm, ref, opts, _batch(8, 3), EXACT)


@pytest.mark.parametrize("when", ["queued", "running"])
def test_a_dropped_module_compiles_nothing(when):
    """A TrainModule the user dropped runs no compile: dynamo's code cache keeps its Tier alive, and
    a compile for it would hold the one worker from captures still in use (a long run's later
    models waited minutes behind dead ones). Queued behind the worker lock, it is skipped; running,
    its worker is stopped within a second."""
    import gc

    from fxtrain.runtime import tiered
    tm, ref = wrap_pair(Head(), executor="auto", dynamic=False, compile_after=0.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    with tiered._one_worker if when == "queued" else contextlib.nullcontext():
        _step(tm, ref, opts, _batch(8, 0), EXACT)
        tier = tm.capture_info().records[0].tier      # waits for the partition, which brings the tier
        _step(tm, ref, opts, _batch(8, 1), EXACT)    # starts the compile thread
        assert tier.state == "compiling", str(tier)
        if when == "running":
            deadline = time.monotonic() + 60
            while not tiered._workers and time.monotonic() < deadline:
                time.sleep(0.05)
            assert tiered._workers, "the worker never started"
            worker = next(iter(tiered._workers))
        del tm, opts
        gc.collect()
    assert tier.wait(60), str(tier)
    assert tier.state == "eager" and "TrainModule is gone" in tier.reason, str(tier)
    if when == "running":
        assert worker.returncode is not None and worker.returncode < 0, worker.returncode   # killed


@pytest.mark.extended   # as test_each_capture_has_its_own_tier (extended too) switches with dropout
def test_dropout_switches_with_eagers_masks():
    """A chain of dropouts runs eager's own kernel in the compiled graphs (inductor's fallback_random):
    the same masks as eager's, before and after the switch."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(Head(dropout=0.5), executor="auto", dynamic=False)
    _switch(tm, ref, [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)])


class TwoDropouts(Head):
    """Two dropouts of one tensor: neither depends on the other, so a scheduler could swap them."""

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        logits = self.b(self.drop(h) + self.drop(h * 2))
        return nn.functional.cross_entropy(logits, y), logits


class RandomNoise(Head):
    def forward(self, x, y):
        logits = self.b(torch.tanh(self.a(x)) + torch.randn(x.shape[0], 32, device=x.device) * 0.1)
        return nn.functional.cross_entropy(logits, y), logits


@pytest.mark.parametrize("model,reason", [
    (TwoDropouts, "random op aten.native_dropout.default does not depend on the one before it: inductor "
                  "could reorder their draws, which would not give eager's numbers"),
    (RandomNoise, "random op aten.randn.default: inductor's generator would not give eager's numbers")])
def test_random_ops_that_compiled_code_would_draw_otherwise_stay_eager(model, reason):
    tm, ref = wrap_pair(model(dropout=0.5), executor="auto", dynamic=False, compile_after=0.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    torch.manual_seed(0)
    for seed in range(3):
        _step(tm, ref, opts, _batch(8, seed), EXACT)
    info = tm.capture_info()
    assert info.wait_for_compiles(0)   # nothing to wait for: no worker was started
    assert info.tiers == [f"graph 0 (train): eager: {reason}"], info.tiers


@pytest.mark.cpu_only(reason="option parsing: no tensors")
def test_auto_is_an_option_and_an_environment_override(monkeypatch):
    monkeypatch.setenv("FXTRAIN_EXECUTOR", "auto")
    assert fxtrain.Options().with_env().executor == "auto"


def test_warm_start_runs_the_stored_compiled_graphs_from_the_first_step(tmp_path, monkeypatch):
    """With cache_dir, the graphs the compiled tier kept after its trial are stored beside the entry;
    a later TrainModule loads them from inductor's cache while its first step runs the eager
    executor's cache hit, and runs them from its second step, with no worker and no second trial."""
    import fxtrain.runtime.tiered as tiered
    monkeypatch.setattr(tiered, "SLOWER", float("inf"))   # the trial keeps them whatever the timings
    model = Head()
    tm, ref = wrap_pair(model, executor="auto", dynamic=False, cache_dir=str(tmp_path))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    tier = _switch(tm, ref, opts)
    for seed in range(40, 40 + TRIAL_STEPS):
        _step(tm, ref, opts, _batch(8, seed), COMPILED)
    assert tier.state == "compiled" and tier.step_seconds is not None, str(tier)
    assert any("stored the compiled graphs" in line for line in tm.capture_info().cache_log), tm.capture_info().cache_log

    later, ref2 = wrap_pair(Head(), executor="auto", dynamic=False, cache_dir=str(tmp_path))
    later.load_state_dict(ref.state_dict())
    ref2.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (later, ref2)]
    _step(later, ref2, opts, _batch(8, 50), EXACT)    # the first step is the eager executor's cache hit
    info = later.capture_info()
    assert info.cache_hits == 1 and info.graphs == 1, info.cache_log
    warm = info.records[0].tier
    assert str(warm) == "eager, loading an earlier run's compiled graphs", str(warm)
    _step(later, ref2, opts, _batch(8, 51), EXACT)    # the load starts at the second call
    assert info.wait_for_compiles(600), info.tiers
    assert str(warm) == "eager, compiled graphs ready for the next step", str(warm)
    for seed in range(52, 54):
        _step(later, ref2, opts, _batch(8, seed), COMPILED)
    assert warm.state == "compiled" and warm.from_cache and warm.since_step == 2, str(warm)
    assert info.tiers[0].startswith("graph 0 (train): inductor since step 2 (an earlier run's"), info.tiers

    # Stored for another entry (its digest differs): ignored, compiled in the background again.
    store = next(tmp_path.glob("*-tier.fxc"))
    key = store.name[:-len("-tier.fxc")]
    from fxtrain.cache.store import Store
    header, payload = Store(tmp_path).read(key + "-tier")
    Store(tmp_path).write(key + "-tier", dict(header, entry="0" * 64), payload)
    third, ref3 = wrap_pair(Head(), executor="auto", dynamic=False, cache_dir=str(tmp_path))
    third.load_state_dict(ref.state_dict())
    ref3.load_state_dict(ref.state_dict())
    _step(third, ref3, [torch.optim.SGD(m.parameters(), lr=0.1) for m in (third, ref3)], _batch(8, 60), EXACT)
    assert third.capture_info().cache_hits == 1
    assert third.capture_info().records[0].tier.from_cache is False, third.capture_info().tiers
    assert "Options.compile_after" in third.capture_info().tiers[0], third.capture_info().tiers


def _sizes_step(tm, ref, opts, batch, tolerance):
    """One training step on a batch of keyword inputs (an HF model's), eager's loss, gradients and
    weights (NaN positions included)."""
    losses = []
    for model, opt in zip((tm, ref), opts):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], equal_nan=True, **tolerance)
    for (name, p), q in zip(tm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, **tolerance, msg=lambda m: f"{name}: {m}")
    for opt in opts:
        opt.step()


def _sparse_switch(tm, ref, batches):
    """Train on ``batches`` (their sizes change, and so do their real tokens and labels): one capture
    with symbolic sizes, the compile awaited after two steps, TRIAL_STEPS steps timing the eager
    executor, and every batch after on inductor's graphs, with no recapture."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tm, ref)]
    batches = [to_device(b) for b in batches]
    for batch in batches[:2]:
        _sizes_step(tm, ref, opts, batch, EXACT)
    info = tm.capture_info()
    assert info.graphs == 1, info.capture_reasons
    assert info.wait_for_compiles(600), info.tiers
    tier = info.records[0].tier
    assert str(tier) == "eager, compiled graphs ready for the next step", info.tiers
    for batch in batches[2:3 + TRIAL_STEPS]:
        _sizes_step(tm, ref, opts, batch, EXACT)
    assert tier.state == "compiled", str(tier)
    for batch in batches[3 + TRIAL_STEPS:]:
        _sizes_step(tm, ref, opts, batch, COMPILED)
    assert tier.state == "compiled" and info.graphs == 1, (info.tiers, info.capture_reasons)
    return tier


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_sparse_symbolic_capture_reaches_inductor(monkeypatch):
    """A BERT-MLM capture with symbolic sizes (batch and sequence) and the sparsity passes'
    data-dependent row counts (real tokens, labelled positions) moves to inductor's graphs under
    executor="auto", which then serve batches of other sizes and other row counts every step, with
    no recapture, at eager's losses and gradients."""
    import fxtrain.runtime.tiered as tiered
    from fxtrain import models
    monkeypatch.setattr(tiered, "SLOWER", float("inf"))   # the trial keeps them whatever the timings
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=500), executor="auto", compile_after=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [models.synthetic_batch("mlm", 3 + i % 3, 16 + (5 * i) % 17, 500, padding=0.4, label_density=0.15,
                                      generator=g) for i in range(TRIAL_STEPS + 7)]
    tier = _sparse_switch(tm, ref, batches)
    why = tm.capture_info().optimizations
    assert why["padding_elimination"].startswith("on:") and why["label_sparsity"].startswith("on:"), why
    assert tier.size_guards is None or tier.size_guards.failed == 0, str(tier)
    # The embedding gradients the tied pass left (positions, token types) reach inductor decomposed,
    # to be fused as torch.compile fuses them; of the row gathers', sized by a count only the batch
    # knows, those whose decomposition asks something of that count stay whole (all on torch 2.13
    # and 2.14, none on 2.11).
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
    from fxtrain import torch_private as tp
    edb = torch.ops.aten.embedding_dense_backward.default
    captured = [n for n in tm.capture_info().records[0].step.backward_graph.graph.nodes if n.target is edb]
    _, bw = tp.unpickle_graphs(tier.payload, tp.FakeTensorMode(shape_env=ShapeEnv()))
    left = [n for n in bw.graph.nodes if n.target is edb]
    unbacked = [n for n in captured if free_unbacked_symbols(n.meta["val"])]
    assert len(left) <= len(unbacked) < len(captured), (len(left), len(unbacked), len(captured))


@pytest.mark.extended   # the same switch as the BERT-MLM test above, on packed documents
@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_packed_llama_capture_reaches_inductor(monkeypatch):
    """Packed rows of one shape, documents of other lengths every step: inductor's graphs serve
    them all. The worker pins the rows' sizes (the causal-LM loss pads the labels, and
    ``constant_pad_nd`` reads a whole size()): a batch of another shape runs on the eager executor,
    at eager's numbers, and capture_info() says so."""
    import fxtrain.runtime.tiered as tiered
    from fxtrain import models
    monkeypatch.setattr(tiered, "SLOWER", float("inf"))
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.llama_lm(hidden=32, layers=2, heads=2, vocab=500), executor="auto", compile_after=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [models.packed_batch(2, 32, 500, documents=(3, 12), generator=g) for i in range(TRIAL_STEPS + 7)]
    tier = _sparse_switch(tm, ref, batches + [models.packed_batch(3, 24, 500, documents=(3, 12), generator=g)])
    assert tm.capture_info().optimizations["packed_attention"].startswith("on:"), tm.capture_info().optimizations
    assert tier.size_guards is not None and tier.size_guards.failed == 1, str(tier)


def test_a_size_inductor_specialised_runs_eagerly(monkeypatch):
    """Where loading the compiled graphs records a guard on a size (as inductor does when it
    specialises one: here the batch size made 8 by hand), calls whose sizes meet it run inductor's
    graphs, the others the eager executor's, each at eager's numbers, and capture_info() says so."""
    import fxtrain.runtime.tiered as tiered
    compile_all = tiered._compile_all

    def specialising(fw, *args, **kwargs):
        out = compile_all(fw, *args, **kwargs)
        x = next(n for n in fw.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                 and isinstance(n.meta["val"].shape[0], torch.SymInt))
        assert bool(x.meta["val"].shape[0] == 8)   # records Eq(s, 8) in the graphs' ShapeEnv
        return out
    monkeypatch.setattr(tiered, "_compile_all", specialising)
    monkeypatch.setattr(tiered, "SLOWER", float("inf"))
    tm, ref = wrap_pair(Head(), executor="auto", compile_after=0.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    _step(tm, ref, opts, _batch(8, 0), EXACT)      # a capture with symbolic sizes, its sample size 8
    _step(tm, ref, opts, _batch(8, 1), EXACT)
    info = tm.capture_info()
    assert info.wait_for_compiles(600), info.tiers
    tier = info.records[0].tier
    for seed in range(2, 3 + TRIAL_STEPS):
        _step(tm, ref, opts, _batch(8, seed), EXACT)
    assert tier.state == "compiled" and tier.size_guards is not None, str(tier)
    _step(tm, ref, opts, _batch(8, 20), COMPILED)
    _step(tm, ref, opts, _batch(7, 21), EXACT)     # fails the guard: the eager executor's exact numbers
    _step(tm, ref, opts, _batch(5, 22), EXACT)
    _step(tm, ref, opts, _batch(8, 23), COMPILED)
    assert tier.size_guards.failed == 2 and info.graphs == 1, str(tier)
    assert "sizes outside its guards (" in info.tiers[0] and "Eq(s" in info.tiers[0] and "run eagerly: 2 call(s) so far" in info.tiers[0], info.tiers


class PaddedHead(Head):
    """Pads its hidden rows by 0 (HF Swin pads its feature maps to whole windows: by 0 where they fit)."""

    def forward(self, x, y):
        h = nn.functional.pad(torch.tanh(self.a(x)), (0, 0))
        logits = self.b(h * h.sum(0, keepdim=True))   # a sum over the batch: the backward reads its size
        return nn.functional.cross_entropy(logits, y), logits


def test_a_zero_pad_leaves_the_compiled_batch_symbolic(monkeypatch):
    """``constant_pad_nd`` kept whole in the worker's retrace reads its input's sizes as integers,
    which pinned a symbolic batch to the sample's (HF Swin's symbolic capture then failed to compile:
    a pinned size the backward takes came out as an int). Padding by 0 is a copy, retraced as one:
    the compiled graphs serve every batch size, at eager's numbers."""
    import fxtrain.runtime.tiered as tiered
    monkeypatch.setattr(tiered, "SLOWER", float("inf"))
    torch.manual_seed(0)
    tm, ref = wrap_pair(PaddedHead(), executor="auto", compile_after=0.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, ref)]
    _step(tm, ref, opts, _batch(8, 0), EXACT)
    _step(tm, ref, opts, _batch(8, 1), EXACT)
    info = tm.capture_info()
    assert info.wait_for_compiles(600), info.tiers
    tier = info.records[0].tier
    assert tier.state != "eager" and "Eq(" not in str(tier), str(tier)   # compiled, no batch size pinned
    for seed in range(2, 3 + TRIAL_STEPS):
        _step(tm, ref, opts, _batch(8, seed), EXACT)
    for rows, seed in ((6, 20), (8, 21), (5, 22)):
        _step(tm, ref, opts, _batch(rows, seed), COMPILED)
    assert tier.state == "compiled" and info.graphs == 1, str(tier)
    assert tier.size_guards is None or tier.size_guards.failed == 0, str(tier)


@pytest.mark.cpu_only(reason="fake tensors stand for a second GPU: the choice is tested, not a compile")
def test_the_worker_and_the_loader_use_the_graphs_device(monkeypatch):
    """Under torchrun/DDP rank r trains on device r: the worker and the loading thread make the
    graphs' device current (not device 0, which every rank's compile would otherwise fill); CPU
    graphs change nothing."""
    import fxtrain.runtime.tiered as tiered
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    # Traced on the CPU, then moved: a fake tensor made on "cuda:1" touches that device where CUDA
    # is available (torch 2.11's FakeTensor initialises its GPU context: no such device on one GPU).
    with FakeTensorMode():
        on_gpu = make_fx(lambda t: (t * 2,))(torch.empty(2, 3))
    for node in on_gpu.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"].fake_device = torch.device("cuda", 1)
    on_cpu = make_fx(lambda t: (t * 2,))(torch.empty(2, 3))
    chosen = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    assert tiered.graphs_device([None, on_cpu]) is None
    tiered.use_graphs_device([on_cpu, None])
    assert chosen == []
    assert tiered.graphs_device([on_cpu, on_gpu]) == torch.device("cuda", 1)
    tiered.use_graphs_device([None, on_gpu])
    assert chosen == [1]


@pytest.mark.cpu_only("temporary directories and processes: no tensors")
def test_the_graphs_a_killed_process_left_for_its_worker_are_removed(tmp_path, monkeypatch):
    """A process SIGKILLed mid-compile cannot remove the directory of graphs it wrote for its worker
    (tests/test_cache.py kills one: the worker removes it as it exits). The next process to compile
    removes those whose process is gone, and leaves a live process's alone."""
    import os
    import subprocess
    import sys
    import tempfile
    from fxtrain.runtime import tiered
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"fxtrain-tier-{dead.pid}-abc"
    alive = tmp_path / f"fxtrain-tier-{os.getpid()}-def"
    other = tmp_path / "fxtrain-tier-notapid"
    for d in (gone, alive, other):
        d.mkdir()
        (d / "graphs.in").write_bytes(b"x")
    tiered._sweep_orphans.__wrapped__()
    assert not gone.exists() and alive.exists() and other.exists()


@pytest.mark.cpu_only("processes and a temporary directory: no tensors")
def test_a_worker_whose_parent_died_before_it_started_still_cleans_up(tmp_path):
    """The worker's parent is known from its command, not from ``os.getppid()`` as it starts: a
    parent killed first (the worker starts at nice 19, slowly on a busy machine) would otherwise
    leave it reading its new parent's pid, never orphaned, running its work to the end and leaving
    its parent's directory behind. Here the launching shell exits at once."""
    import os
    import shlex
    import subprocess
    import sys
    from fxtrain.runtime import threads
    (tmp_path / "slow_work.py").write_text("import time\ntime.sleep(60)\n")
    owned = tmp_path / "owned"
    owned.mkdir()
    (owned / "graphs.in").write_bytes(b"x")
    cmd = " ".join(shlex.quote(a) for a in threads.worker_command("slow_work", owned=str(owned)))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    subprocess.run(["sh", "-c", f"{cmd} >/dev/null 2>&1 &"], env=env, check=True, timeout=30)
    deadline = time.monotonic() + 20
    while owned.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not owned.exists(), "the orphaned worker kept its parent's directory"
