"""TrainModule against eager PyTorch: parity, inputs/outputs, modes, recapture, semantics, errors."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from utils import assert_grads_equal, assert_state_equal, current_device, to_device, train_parity, wrap_pair


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=32, d_out=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x, y=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        if y is None:
            return logits
        return F.cross_entropy(logits, y), logits


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before a BatchNorm (as in real CNNs): its true gradient is zero, so what eager
        # computes for it is rounding noise that AdamW scales up to full steps, and an executor
        # that rounds otherwise (inductor) would differ by a learning rate per step.
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, stride=2, bias=False), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        logits = self.head(h.mean((2, 3)))
        return F.cross_entropy(logits, y), logits


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------- parity
def test_mlp_three_adamw_steps_changing_batch():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP())
    batches = [dict(x=torch.randn(b, 8), y=torch.randint(0, 4, (b,))) for b in (6, 3, 11)]
    train_parity(tm, ref, batches, lambda out, _: out[0], compare_outputs=lambda o, r: _close(o[1], r[1]))
    assert tm.capture_info().graphs == 1
    tm.eval(); ref.eval()
    x = to_device(torch.randn(5, 8))
    _close(tm(x), ref(x))


def test_cnn_batchnorm_running_stats_equal_eager():
    torch.manual_seed(0)
    tm, ref = wrap_pair(CNN())
    batches = [dict(x=torch.randn(b, 3, 12, 12), y=torch.randint(0, 5, (b,))) for b in (4, 6, 3)]
    train_parity(tm, ref, batches, lambda out, _: out[0])
    assert int(tm.module.bn1.num_batches_tracked) == 3
    _close(tm.module.bn2.running_var, ref.bn2.running_var)
    tm.eval(); ref.eval()
    x, y = to_device((torch.randn(2, 3, 12, 12), torch.randint(0, 5, (2,))))
    _close(tm(x, y)[1], ref(x, y)[1])
    assert_state_equal(tm.module, ref)  # eval must not touch running stats


# ------------------------------------------------------------------------------- inputs/outputs
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, pair, cfg, *, scale: float = 1.0, flag: bool = False, mode: str = "sum", extra=None,
                steps: int = 1):
        x, (y, z) = pair
        h = self.a(x) * scale
        for _ in range(steps):
            h = h + self.b(cfg["w"] + y)
        if flag:
            h = h * 2
        if extra is not None:
            h = h + extra[0]
        h = h + z.sum()
        red = h.sum() if mode == "sum" else h.mean()
        return {"out": h, "parts": [red, (h.detach() * 0 + 1,)], "none": None, "n": steps}


def test_nested_inputs_outputs_and_python_args():
    torch.manual_seed(0)
    tm, ref = wrap_pair(Nested())
    for kw in (dict(scale=0.5, flag=True, mode="mean", extra=[to_device(torch.randn(4))], steps=2),
               dict(scale=2.0, flag=False, mode="sum", extra=None, steps=1)):
        x, y, z, w = (to_device(torch.randn(3, 4)) for _ in range(4))
        out = tm((x, (y, z)), {"w": w}, **kw)
        r = ref((x, (y, z)), {"w": w}, **kw)
        assert set(out) == set(r) and out["none"] is None and out["n"] == r["n"]
        assert isinstance(out["parts"], list) and isinstance(out["parts"][1], tuple)
        _close(out["out"], r["out"])
        _close(out["parts"][0], r["parts"][0])
        out["parts"][0].backward(); r["parts"][0].backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()


def test_positional_and_keyword_and_none():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP())
    x, y = to_device((torch.randn(4, 8), torch.randint(0, 4, (4,))))
    _close(tm(x, y)[0], ref(x, y)[0])
    _close(tm(x=x, y=y)[0], ref(x=x, y=y)[0])
    _close(tm(x, None), ref(x, None))


# ------------------------------------------------------------------------------------- modes
def test_train_eval_no_grad_are_separate_captures():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP())
    x = to_device(torch.randn(4, 8))
    _close(tm(x), ref(x))
    assert tm.capture_info().graphs == 1
    tm.eval(); ref.eval()
    _close(tm(x), ref(x))
    assert tm.capture_info().graphs == 2
    with torch.no_grad():
        out = tm(x)
        assert not out.requires_grad
        _close(out, ref(x))
    assert tm.capture_info().graphs == 3
    tm.train(); ref.train()
    _close(tm(x), ref(x))
    assert tm.capture_info().graphs == 3
    assert {r.mode for r in tm.capture_info().records} == {"train", "eval", "no_grad"}


def test_autocast_bf16_matches_eager():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP())
    x, y = to_device((torch.randn(6, 8), torch.randint(0, 4, (6,))))
    with torch.autocast(current_device().type, dtype=torch.bfloat16):
        loss, logits = tm(x, y)
        ref_loss, ref_logits = ref(x, y)
    assert logits.dtype == ref_logits.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    loss.backward(); ref_loss.backward()
    assert_grads_equal(tm.module, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 40], ids=["scaled", "overflowing"])
def test_grad_scaler_fp16_loop_matches_eager(init_scale, passes_whatever_they_cost):
    """The mixed-precision loop a GPU user writes: float16 autocast, ``GradScaler`` scaling the loss,
    unscaling before gradient clipping, skipping a step whose gradients overflowed and lowering the
    scale. On a padded BERT-MLM with the sparsity passes on, the scaled backward runs the captured
    graphs; at 2**40 every step's float16 gradients overflow to inf and each step must be skipped
    as eager skips it (the parameters unchanged, the scale halved each time)."""
    from fxtrain import models
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300))
    device = current_device()
    runs = []
    for model in (tm, ref):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs.append((model, opt, torch.amp.GradScaler(device.type, init_scale=init_scale), []))
    start = copy.deepcopy(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = to_device(models.synthetic_batch("mlm", 6, 24, 300, padding=0.5, label_density=0.15, generator=g))
        for model, opt, scaler, log in runs:
            with torch.autocast(device.type, dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            log.append((loss.detach(), norm, scaler.get_scale()))
    optimizations = tm.capture_info().optimizations
    assert optimizations["padding_elimination"].startswith("on") and optimizations["label_sparsity"].startswith("on")
    (_, _, _, got), (_, _, _, want) = runs
    for (loss, norm, scale), (ref_loss, ref_norm, ref_scale) in zip(got, want):
        torch.testing.assert_close(loss, ref_loss, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(norm, ref_norm, atol=2e-3, rtol=1e-2, equal_nan=True)
        assert scale == ref_scale
    if init_scale > 2.0 ** 16:
        assert [s for _, _, s in want] == [init_scale / 2, init_scale / 4, init_scale / 8]
        assert all(n.isinf() or n.isnan() for _, n, _ in got)
        assert_state_equal(tm.module, ref, atol=0)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(value, start[name], atol=0, rtol=0)
    else:
        assert [s for _, _, s in want] == [init_scale] * 3
        assert_state_equal(tm.module, ref, atol=2e-3)


# --------------------------------------------------------------------------------- recapture
def test_batch_and_length_changes_do_not_recapture():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(50, 8), nn.Linear(8, 8)

        def forward(self, ids):
            return self.lin(self.emb(ids)).softmax(-1).sum()

    tm, ref = wrap_pair(Seq())
    for b, s in ((4, 7), (2, 12), (9, 3), (3, 30)):
        ids = to_device(torch.randint(0, 50, (b, s)))
        _close(tm(ids), ref(ids))
    assert tm.capture_info().graphs == 1


@pytest.mark.parametrize("change", ["dtype", "rank", "kwargs", "requires_grad"])
def test_schema_changes_recapture_correctly(change):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, bias=None):
            h = self.lin(x.float())
            return h if bias is None else h + bias

    torch.manual_seed(0)
    tm, ref = wrap_pair(M())
    x = to_device(torch.randn(3, 4))
    _close(tm(x), ref(x))
    before = tm.capture_info().graphs
    if change == "dtype":
        x2, kw = torch.randn(3, 4, dtype=torch.float64, device=current_device()), {}
    elif change == "rank":
        x2, kw = torch.randn(2, 3, 4, device=current_device()), {}
    elif change == "kwargs":
        x2, kw = x, {"bias": torch.randn(4, device=current_device())}
    else:
        x2, kw = torch.randn(3, 4, device=current_device(), requires_grad=True), {}
    out, r = tm(x2, **kw), ref(x2, **kw)
    _close(out, r)
    assert tm.capture_info().graphs == before + 1
    if change == "requires_grad":
        g, = torch.autograd.grad(out.sum(), x2)
        g_ref, = torch.autograd.grad(r.sum(), x2)
        _close(g, g_ref)


# --------------------------------------------------------------------------- module semantics
def test_parameters_shared_state_dict_to_and_attributes():
    torch.manual_seed(0)
    inner = to_device(MLP())
    tm = fxtrain.TrainModule(inner)
    assert all(p is q for p, q in zip(tm.parameters(), inner.parameters()))
    assert list(tm.state_dict()) == list(inner.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [n for n, _ in tm.named_parameters()] == [n for n, _ in inner.named_parameters()]
    other = to_device(MLP())
    tm.load_state_dict(other.state_dict())
    x = to_device(torch.randn(2, 8))
    _close(tm(x), other(x))
    tm.eval()
    assert not inner.training and not inner.fc1.training
    tm.train()
    assert inner.training
    assert tm.fc1 is inner.fc1  # attributes fall through to the wrapped module
    tm.to(torch.float64)
    assert inner.fc1.weight.dtype == torch.float64
    _close(tm(x.double()), other.double()(x.double()))
    # an optimizer over the wrapped module's own parameters trains the TrainModule
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    before = inner.fc1.weight.detach().clone()
    tm(x.double()).sum().backward()
    opt.step()
    assert not torch.equal(before, inner.fc1.weight)


def test_parameter_hooks_fire_like_eager():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP())
    seen, seen_ref, post = [], [], []
    tm.module.fc1.weight.register_hook(lambda g: seen.append(g.clone()) or g * 2)
    ref.fc1.weight.register_hook(lambda g: seen_ref.append(g.clone()) or g * 2)
    tm.module.fc2.bias.register_post_accumulate_grad_hook(lambda p: post.append(p.grad.clone()))
    x = to_device(torch.randn(5, 8))
    tm(x).pow(2).sum().backward(); ref(x).pow(2).sum().backward()
    assert len(seen) == len(seen_ref) == 1 and len(post) == 1
    _close(seen[0], seen_ref[0])
    _close(post[0], ref.fc2.bias.grad)
    assert_grads_equal(tm.module, ref)


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_global_module_hooks_never_see_fxtrain_graphs(tmp_path):
    """A global module hook (MemTracker, FSDP-style tooling) sees the user's modules only: fxtrain's
    own graphs (the batch guard's check, a deferred output's computation) are not modules of the
    model, and a hook acting on them (say, one that adds parameter gradient hooks) would change the
    step."""
    from fxtrain import models
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=1, heads=2, vocab=300))
    seen = []
    g = torch.Generator().manual_seed(0)
    batches = [models.synthetic_batch("mlm", 4, 16, 300, padding=0.5, label_density=0.2, generator=g, device=current_device())
               for _ in range(2)]
    # an entry in the on-disk cache, written before the hook exists (dynamo traces a global hook
    # into the graph, and one appending to a list is a side effect no entry can replay)
    writer = fxtrain.TrainModule(copy.deepcopy(tm.module), fxtrain.Options(cache_dir=str(tmp_path)))
    writer(**batches[0]).loss.backward()
    writer.capture_info()   # waits for the partition: the entry is stored with the whole step
    with torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m))):
        for b in batches:
            out = tm(**b)
            out.loss.backward()
            out.logits.sum()   # a deferred output, computed on read
        cached = fxtrain.TrainModule(copy.deepcopy(tm.module), fxtrain.Options(cache_dir=str(tmp_path)))
        out = cached(**batches[0])   # the graphs of a cache hit, run without dynamo
        out.loss.backward()
        out.logits.sum()
        assert cached.capture_info().cache_hits == 1, cached.capture_info().cache_log
    info = tm.capture_info()
    assert info.optimizations["label_sparsity"].startswith("on:"), info.optimizations   # a guard and a deferral ran
    assert seen and not [t for t in seen if issubclass(t, torch.fx.GraphModule)], set(seen)


# ------------------------------------------------------------------------ breaks and fallback
class Branchy(nn.Module):
    """A data-dependent Python branch: a graph break for dynamo."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)   # a bias before BatchNorm has no true gradient
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.lin(x))
        if x.sum() > 0:   # not h: a BatchNorm output sums to zero up to rounding
            return h * 2
        return h - 1


def test_graph_break_is_reported_and_correct():
    torch.manual_seed(0)
    tm, ref = wrap_pair(Branchy(), fallback="eager")
    for _ in range(3):
        x = to_device(torch.randn(5, 4))
        out, r = tm(x), ref(x)
        _close(out, r)
        out.pow(2).sum().backward(); r.pow(2).sum().backward()   # a BatchNorm output's sum has no gradient
    assert_grads_equal(tm.module, ref)
    assert_state_equal(tm.module, ref)
    info = tm.capture_info()
    assert info.graph_breaks >= 1 and info.graphs >= 2 and info.fallback_reason is None


def test_fullgraph_failure_falls_back_once_without_double_buffer_update():
    torch.manual_seed(0)
    tm, ref = wrap_pair(Branchy(), fallback="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = to_device(torch.randn(5, 4))
            out, r = tm(x), ref(x)
            _close(out, r)
            out.sum().backward(); r.sum().backward()
    fallbacks = [w for w in caught if issubclass(w.category, fxtrain.FallbackWarning)]
    assert len(fallbacks) == 1
    reason = tm.capture_info().fallback_reason
    assert reason and reason in str(fallbacks[0].message)
    assert int(tm.module.bn.num_batches_tracked) == 3  # the failed capture did not also update stats
    assert_state_equal(tm.module, ref)
    assert_grads_equal(tm.module, ref)


def test_fullgraph_failure_raises_when_asked():
    tm, _ = wrap_pair(Branchy(), fallback="raise", fullgraph=True)
    with pytest.raises(fxtrain.CaptureError, match="Branchy"):
        tm(to_device(torch.randn(5, 4)))


def test_user_error_is_eager_error_not_fallback():
    tm, ref = wrap_pair(MLP(), fallback="eager")
    with pytest.raises(RuntimeError) as eager_err:
        ref(to_device(torch.randn(3, 7)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtrain.FallbackWarning)
        with pytest.raises(type(eager_err.value)):
            tm(to_device(torch.randn(3, 7)))
    assert tm.capture_info().fallback_reason is None
    _close(tm(torch.ones(3, 8, device=current_device())), ref(torch.ones(3, 8, device=current_device())))


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.cpu_only(reason="input checks at the call: no tensor reaches a device")
def test_numpy_input_is_a_clear_type_error():
    np = pytest.importorskip("numpy")
    tm = fxtrain.TrainModule(MLP())
    with pytest.raises(TypeError, match=r"args\[0\].*numpy.*torch.from_numpy"):
        tm(np.zeros((2, 8), dtype="float32"))


def test_wrong_device_is_a_clear_value_error():
    tm = fxtrain.TrainModule(to_device(MLP()))
    with pytest.raises(ValueError, match=rf"kwargs\['x'\].*meta.*{current_device().type}"):
        tm(x=torch.empty(2, 8, device="meta"))


@pytest.mark.cpu_only(reason="input checks at the call: no tensor reaches a device")
def test_wrapping_non_module_or_twice_is_a_type_error():
    with pytest.raises(TypeError, match="nn.Module"):
        fxtrain.TrainModule(lambda x: x)
    with pytest.raises(TypeError, match="already"):
        fxtrain.TrainModule(fxtrain.TrainModule(MLP()))


# ---------------------------------------------------------------------- absent output gradients
@pytest.mark.parametrize("backward", ["autograd", "graph"])
@pytest.mark.parametrize("use", ["loss", "both", "logits"])
def test_unused_outputs_get_no_materialised_gradient(use, backward):
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP(), backward=backward)
    for b in (4, 7):
        x, y = to_device((torch.randn(b, 8), torch.randint(0, 4, (b,))))
        (loss, logits), (rl, rlog) = tm(x, y), ref(x, y)
        pick = {"loss": lambda l, g: l, "both": lambda l, g: l + g.pow(2).sum(), "logits": lambda l, g: g.sum()}[use]
        pick(loss, logits).backward(); pick(rl, rlog).backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()


def test_absent_gradient_specialisation_removes_the_add():
    from fxtrain.runtime.absent_grads import _eliminate

    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP(), backward="graph")  # the aten backward graph's runtime
    x, y = to_device((torch.randn(4, 8), torch.randint(0, 4, (4,))))
    loss, _ = tm(x, y)
    loss.backward()
    ref(x, y)[0].backward()
    assert_grads_equal(tm.module, ref)
    record = tm.capture_info().records[0]
    assert record.runtime.startswith("graph")
    runner = record.backward_runner
    assert runner.accepts_none
    # the backward ran with the logits' gradient absent, through a specialised graph
    assert len(runner.variants) == 1
    (absent,) = runner.variants
    assert len(absent) == 1 and absent[0] in runner.tangents
    gm, needs_zeros = _eliminate(record.backward_graph, absent)
    adds = lambda g: sum(n.target == torch.ops.aten.add.Tensor for n in g.graph.nodes)
    assert adds(gm) == adds(record.backward_graph) - 1 and needs_zeros == []


# ----------------------------------------------------------------------------------- inductor
def test_inductor_executor_matches_eager():
    """The model returns its loss and its logits; the loop differentiates the loss. The executor
    compiles at capture the backward the loop runs (the logits' gradient absent) and not the full
    one, which compiles when a backward first needs it and gives eager's gradients then too."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP(), executor="inductor")
    batches = [dict(x=torch.randn(b, 8), y=torch.randint(0, 4, (b,))) for b in (4, 6)]
    train_parity(tm, ref, batches, lambda out, _: out[0])
    assert tm.capture_info().executor == "inductor"
    runners = [r.backward_runner for r in tm.capture_info().records]
    assert runners and all(len(r.variants) == 1 and r._full is None for r in runners)
    x, y = to_device((torch.randn(6, 8), torch.randint(0, 4, (6,))))
    for model in (tm, ref):
        loss, logits = model(x, y)
        (loss + logits.square().mean()).backward()
    assert_grads_equal(tm.module, ref, atol=1e-5)
    assert any(r.backward_runner._full is not None for r in tm.capture_info().records)


@pytest.mark.cpu_only("graph surgery on a hand-built backward graph: no device involved")
def test_compile_ahead_compiles_the_pattern_the_loop_will_run():
    """A backward taking a loss's gradient and an output's: compiled ahead, the loss-only pattern
    and nothing else; where absent gradients arrive as zeros (``accepts_none`` off: the loop can only
    run the full graph), the full graph only."""
    from fxtrain.runtime.absent_grads import AbsentGradBackward
    g = torch.fx.Graph()
    saved, loss_grad, out_grad = g.placeholder("saved"), g.placeholder("tangents_1"), g.placeholder("tangents_2")
    for node, shape in ((saved, (3, 4)), (loss_grad, ()), (out_grad, (3, 4))):
        node.meta["val"] = torch.empty(shape)
    scaled = g.call_function(torch.ops.aten.mul.Tensor, (saved, loss_grad))
    total = g.call_function(torch.ops.aten.add.Tensor, (scaled, out_grad))
    scaled.meta["val"] = total.meta["val"] = torch.empty(3, 4)
    g.output((total,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x, one = torch.randn(3, 4), torch.tensor(2.0)
    for accepts_none in (True, False):
        compiled = []

        def compile(graph):
            compiled.append(sorted(n.name for n in graph.graph.nodes if n.op == "placeholder"))
            return lambda args: graph.forward(*args)

        backward = AbsentGradBackward(gm, compile)
        assert backward.accepts_none
        backward.accepts_none = accepts_none
        backward.compile_ahead()
        if accepts_none:   # the variant without the output's gradient
            assert compiled == [["saved", "tangents_1"]]
            assert torch.equal(backward([x, one, None])[0], x * 2)
        else:
            assert compiled == [["saved", "tangents_1", "tangents_2"]]
            assert torch.equal(backward([x, one, torch.zeros(3, 4)])[0], x * 2)
        assert len(compiled) == 1


def test_backend_failure_falls_back_with_root_cause(monkeypatch):
    import fxtrain.capture.pipeline as pipeline

    def broken(*_a, **_k):
        raise NotImplementedError("executor cannot handle aten.frobnicate")

    monkeypatch.setattr(pipeline, "split", broken)
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP(), fallback="eager")
    x = to_device(torch.randn(3, 8))
    with pytest.warns(fxtrain.FallbackWarning, match="aten.frobnicate"):
        _close(tm(x), ref(x))
    assert "NotImplementedError: executor cannot handle aten.frobnicate" == tm.capture_info().fallback_reason
    _close(tm(x), ref(x))  # stays eager, no second warning needed
    tm2, _ = wrap_pair(MLP(), fallback="raise")
    with pytest.raises(fxtrain.CaptureError, match="aten.frobnicate"):
        tm2(x)


def test_recompile_limit_goes_through_fallback_policy():
    torch.manual_seed(0)
    tm, ref = wrap_pair(MLP(), fallback="raise", recompile_limit=1)
    x = to_device(torch.randn(3, 8))
    _close(tm(x), ref(x))
    with pytest.raises(fxtrain.CaptureError):
        tm(x.double().float().requires_grad_())  # a new requires_grad pattern needs a second capture
    tm2, ref2 = wrap_pair(MLP(), fallback="eager", recompile_limit=1)
    tm2(x)
    with pytest.warns(fxtrain.FallbackWarning):
        xr = torch.randn(3, 8, device=current_device(), requires_grad=True)
        _close(tm2(xr), ref2(xr))


def test_a_dropped_train_module_is_freed_with_its_model():
    """dynamo keeps every compile backend for the life of the process; fxtrain's backend reaches its
    TrainModule only weakly, so a TrainModule the loop drops (a model swapped out, a notebook cell
    run again) frees its model's parameters instead of keeping them until torch._dynamo.reset()."""
    import gc
    import weakref

    def train_once():
        model = to_device(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
        tm = fxtrain.TrainModule(model)
        tm(to_device(torch.randn(4, 8))).sum().backward()
        return weakref.ref(model), weakref.ref(tm)

    model, tm = train_once()
    gc.collect()
    assert tm() is None and model() is None
