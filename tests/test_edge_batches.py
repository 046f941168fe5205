"""Edge batches against eager: batches whose labels are all ignored, outputs read after the
optimizer step, and batches the sparse graph cannot serve (the dense route). Default options
throughout (conftest clears FXTRAIN_*) unless a test is about an option."""
import copy
from collections import Counter
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from utils import current_device, long_params, to_device
from fxtrain import models
from fxtrain.runtime.deferred import DeferredTensor, StaleDeferredOutput
from fxtrain.runtime.dense_route import SparseBatchError

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")

PASSES = ("label_sparsity", "padding_elimination", "upstream_slicing")


def _pair(model, **options):
    model = to_device(model)
    ref = copy.deepcopy(model)
    return fxtrain.TrainModule(to_device(model), fxtrain.Options(**options)), ref


def _step_both(tm, ref, batch, loss_of=lambda o: o.loss):
    """One forward+backward on each; loss, NaN positions and every gradient must be eager's."""
    batch = to_device(batch)
    out, ref_out = tm(**batch), ref(**batch)
    loss, ref_loss = loss_of(out), loss_of(ref_out)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4, equal_nan=True)
    loss.backward()
    ref_loss.backward()
    mine = dict(tm.named_parameters())
    for name, p in ref.named_parameters():
        assert (mine[name].grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(mine[name].grad, p.grad, atol=1e-5, rtol=1e-4, equal_nan=True,
                                       msg=lambda m: f"{name}: {m}")
    tm.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    return out, ref_out


# ------------------------------------------------------------------ batches whose labels are all ignored
class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 300)

    def forward(self, x, y):
        return F.cross_entropy(self.l(x), y, ignore_index=-100)


def test_all_ignored_labels_after_a_dense_capture_give_eagers_zero_gradients():
    """The issue's repro: cross_entropy_grad divided by the count of valid labels (0 here). The
    pass runs with the eager executor only (inductor fuses these gradients itself)."""
    torch.manual_seed(0)
    tm, ref = _pair(_Head(), executor="eager")
    _step_both(tm, ref, {"x": torch.randn(8, 16), "y": torch.randint(0, 300, (8,))}, loss_of=lambda o: o)
    x, y = to_device((torch.randn(8, 16), torch.full((8,), -100)))
    out = tm(x, y)
    out.backward()
    ref(x, y).backward()
    assert torch.isnan(out)
    assert torch.equal(tm.module.l.weight.grad, torch.zeros_like(ref.l.weight.grad))
    assert torch.equal(ref.l.weight.grad, torch.zeros_like(ref.l.weight.grad))
    assert tm.capture_info().optimizations["cross_entropy_grad"].startswith("on:")


@pytest.mark.parametrize("passes,capture", long_params(
    [(p, c) for p in ("on", "off") for c in ("sparse", "dense")], keep=[("on", "sparse"), ("off", "dense")]))
def test_all_ignored_labels_give_eagers_gradients_with_every_pass_on_or_off(capture, passes):
    torch.manual_seed(0)
    tm, ref = _pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64),
                    **{name: passes for name in PASSES})
    g = torch.Generator().manual_seed(1)
    first = models.synthetic_batch("mlm", 4, 16, 300, padding=0.4 if capture == "sparse" else 0.0,
                                   label_density=0.15 if capture == "sparse" else 1.0, generator=g, device=current_device())
    _step_both(tm, ref, first)
    for b, s in [(4, 16), (3, 12)]:
        batch = models.synthetic_batch("mlm", b, s, 300, padding=0.3, generator=g, device=current_device())
        batch["labels"].fill_(-100)
        out, _ = _step_both(tm, ref, batch)
        assert torch.isnan(out.loss)
    why = tm.capture_info().optimizations
    if passes == "on":
        assert why["label_sparsity"].startswith("on:") and why["padding_elimination"].startswith("on:"), why


# ------------------------------------------------------------------- outputs read after optimizer.step()
def _read_after_step(tm, ref, batches, outputs=("logits",)):
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in batches:
        out, ref_out = tm(**batch), ref(**batch)
        out.loss.backward()
        ref_out.loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name in outputs:
            assert isinstance(out[name], DeferredTensor), name
            torch.testing.assert_close(out[name], ref_out[name], atol=1e-5, rtol=1e-4, equal_nan=True)
        # The next forward runs on the updated weights, as eager's does.
        torch.testing.assert_close(tm(**batch).loss, ref(**batch).loss, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["bert-mlm", "gpt2"])
def test_outputs_read_after_the_optimizer_step_are_their_forwards(name):
    """Eager's logits are the forward's; fxtrain's deferred ones are computed on first read, so the
    parameters they need are kept before the optimizer updates them in place."""
    build = {"bert-mlm": lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64),
             "gpt2": lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=300, positions=64)}[name]
    kind = {"bert-mlm": "mlm", "gpt2": "clm"}[name]
    torch.manual_seed(0)
    tm, ref = _pair(build())
    g = torch.Generator().manual_seed(2)
    batches = [models.synthetic_batch(kind, 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
               for _ in range(3)]
    _read_after_step(tm, ref, batches)
    why = tm.capture_info().optimizations
    assert why["label_sparsity"].startswith("on:") and why["padding_elimination"].startswith("on:"), why


def test_returned_hidden_states_after_a_graph_break_are_eagers():
    """transformers installs output-capturing hooks on the first output_hidden_states call: a graph
    break whose first graph returns the encoder's output to model code. Such outputs are not
    deferred (the model reads them at once); before, dynamo traced fxtrain's deferred-output code
    and hit its recompile limit."""
    torch.manual_seed(0)
    tm, ref = _pair(models.roberta_cls(hidden=32, layers=2, heads=2, vocab=300), fallback="raise")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = models.synthetic_batch("cls", 4, 16, 300, padding=0.4, pad_id=1, generator=g, device=current_device())
        out, ref_out = _step_both(tm, ref, dict(batch, output_hidden_states=True))
        for mine, theirs in zip(out.hidden_states, ref_out.hidden_states):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    assert tm.capture_info().graphs <= 3


def test_keeping_costs_nothing_when_the_loop_drops_its_outputs(monkeypatch):
    """Parameters are copied ahead of a step only for deferred outputs still alive."""
    from fxtrain.runtime import deferred
    kept = []
    original = deferred._kept_copies
    monkeypatch.setattr(deferred, "_kept_copies", lambda xs, owner: kept.extend(xs) or original(xs, owner))
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64)))
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    batches = [models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
               for _ in range(3)]
    for batch in batches[:2]:
        tm(**batch).loss.backward()     # the outputs are dropped before the step
        opt.step()
        opt.zero_grad()
    mine = [k for k in kept if any(k is p for p in tm.parameters())]
    assert mine == [], f"{len(mine)} of this module's parameters copied ({len(kept)} in all)"
    out = tm(**batches[2])              # held across the step: what the logits need is kept
    out.loss.backward()
    opt.step()
    assert kept and all(any(k is p for p in tm.parameters()) for k in kept)


def test_keeping_is_one_copy_op_into_the_last_steps_buffers():
    """A loop that holds its outputs across the step (``out = model(**batch)``, then backward and
    ``opt.step()``) has every parameter the deferred outputs read copied before each step: one
    foreach op for all of them (it was a ``copy_`` from Python per parameter: 202 ops a step for a
    12-layer BERT, a kernel launch each on a GPU), into the buffers the step before used once its
    outputs are gone, also where another optimizer steps in between with nothing pending (it used
    to drop every buffer: fresh copies each step). Reads after the step are still eager's."""
    from fxtrain.runtime import deferred
    torch.manual_seed(0)
    tm, ref = _pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64))
    params = list(tm.parameters())
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (tm, ref))
    other = torch.optim.SGD(to_device(torch.nn.Linear(2, 2)).parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    batches = [models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g,
                                      device=current_device()) for _ in range(3)]
    buffers = []
    for batch in batches:
        out, ref_out = tm(**batch), ref(**batch)
        out.loss.backward()
        ref_out.loss.backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        top = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                      and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
        assert top["aten::_foreach_copy_"] == 1 and top["aten::copy_"] == 0, top
        kept = out.logits._pending.inputs
        assert len(kept) > len(params) // 2 and not any(any(k is p for p in params) for k in kept)
        buffers.append({id(p): deferred._spares[id(p)][1].data_ptr() for p in params if id(p) in deferred._spares})
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4, equal_nan=True)
        del out, ref_out
        # Another loop's optimizer stepping with nothing pending (a benchmark interleaving modes, a
        # GAN's second model) drops no buffer of these weights.
        other.step()
    assert len(buffers[0]) > len(params) // 2 and buffers[0] == buffers[1] == buffers[2], \
        "a later step's copies went to new buffers"
    opt.step()   # nothing pending from this model's loop any more: its weights' copies are freed
    assert not [p for p in params if id(p) in deferred._spares]
    assert tm.capture_info().optimizations["padding_elimination"].startswith("on:")


def test_a_hand_written_update_still_makes_a_stale_read_raise():
    """fxtrain keeps values ahead of torch.optim steps only; other in-place changes are detected."""
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64)))
    g = torch.Generator().manual_seed(4)
    out = tm(**models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device()))
    out.loss.backward()
    with torch.no_grad():
        for p in tm.parameters():
            p -= 0.1 * p.grad
    with pytest.raises(StaleDeferredOutput, match="hand-written update"):
        out.logits.sum()


def test_weights_heavier_than_the_outputs_are_not_kept(monkeypatch):
    """Keeping never costs more memory than eager's outputs (beyond a small floor): a model whose
    weights outweigh its logits refuses the read after the step, saying why and what to do."""
    from fxtrain.runtime import deferred
    monkeypatch.setattr(deferred, "KEEP_ANYWAY", 0)
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64)))
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    out = tm(**models.synthetic_batch("mlm", 2, 8, 300, padding=0.4, label_density=0.3, generator=g, device=current_device()))
    out.loss.backward()
    opt.step()
    with pytest.raises(StaleDeferredOutput, match="more memory than the output itself"):
        out.logits.sum()


def test_a_tied_weight_is_weighed_once_against_the_outputs(monkeypatch):
    """A weight the deferred graph reads twice (tied embeddings) is copied once, so it is weighed
    once against the outputs' bytes: weighed as two copies, a copy as large as the outputs it serves
    was refused and the read after the step raised."""
    from fxtrain.runtime import deferred
    monkeypatch.setattr(deferred, "KEEP_ANYWAY", 0)
    w = to_device(torch.randn(4, 4))
    pending = deferred._Pending(lambda a, b: (a @ b,), [w, w], False, out_bytes=w.nbytes)
    pending.keep_before_update({id(w)})
    assert pending.not_kept is None
    assert pending.inputs[0] is pending.inputs[1] and pending.inputs[0] is not w
    before = w.clone()
    w.add_(1)   # the optimizer's step
    torch.testing.assert_close(pending.result(0), before @ before)


def test_backward_through_an_output_read_after_the_step_raises_as_eager_does():
    torch.manual_seed(0)
    tm, ref = _pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64))
    g = torch.Generator().manual_seed(5)
    batch = models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
    for model in (tm, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(**batch)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        with pytest.raises(RuntimeError):
            out.logits.sum().backward()


# ------------------------------------------------------------------------------- the dense route
def _gpt2():
    return models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=300, positions=64)


def test_left_padding_after_a_right_padded_capture_takes_the_dense_route(caplog):
    """GPT-2 captured on right padding; left-padded batches label the first real token, which label
    shifting puts on the last padding position: eager's loss reads a padding row."""
    torch.manual_seed(0)
    tm, ref = _pair(_gpt2())
    g = torch.Generator().manual_seed(6)
    right = [models.synthetic_batch("clm", b, s, 300, padding=0.4, generator=g, device=current_device()) for b, s in [(4, 16), (3, 20)]]
    left = [models.synthetic_batch("clm", b, s, 300, padding=0.4, padding_side="left", generator=g, device=current_device())
            for b, s in [(4, 16), (3, 20), (5, 12)]]
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        for batch in right + left + right:
            _step_both(tm, ref, batch)
    info = tm.capture_info()
    assert info.optimizations["padding_elimination"].startswith("on:"), info.optimizations
    assert info.dense_batches == {"a label sits on a padding position": 3}
    assert sum("without the sparsity passes" in r.message for r in caplog.records) == 1  # logged once
    assert "dense route: 3 batch(es)" in str(info)


def test_classifier_reading_a_padding_position_takes_the_dense_route():
    """RoBERTa classification keeps position 0: left padding puts padding there in short rows."""
    torch.manual_seed(0)
    tm, ref = _pair(models.roberta_cls(hidden=32, layers=2, heads=2, vocab=300))
    g = torch.Generator().manual_seed(7)
    batches = [models.synthetic_batch("cls", b, s, 300, padding=0.4, pad_id=1, padding_side=side, generator=g, device=current_device())
               for b, s, side in [(4, 16, "right"), (3, 12, "right"), (4, 16, "left"), (3, 12, "left")]]
    for batch in batches:
        out, ref_out = _step_both(tm, ref, batch)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)
    info = tm.capture_info()
    assert info.optimizations["padding_elimination"].startswith("on:"), info.optimizations
    assert info.dense_batches == {"the model keeps position 0, which is padding in some rows": 2}


def test_mlm_labels_on_padding_take_the_dense_route():
    torch.manual_seed(0)
    tm, ref = _pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64))
    g = torch.Generator().manual_seed(8)
    batches = [models.synthetic_batch("mlm", b, s, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
               for b, s in [(4, 16), (3, 12), (4, 16), (3, 12)]]
    for batch in batches[2:]:
        row, col = (batch["attention_mask"] == 0).nonzero()[0].tolist()
        batch["labels"][row, col] = 5
    for batch in batches:
        out, ref_out = _step_both(tm, ref, batch)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)
    assert tm.capture_info().dense_batches == {"a label sits on a padding position": 2}


def test_strict_option_raises_before_anything_runs():
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64)),
                             fxtrain.Options(sparsity_guard="raise"))
    g = torch.Generator().manual_seed(9)
    first, second = [models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
                     for _ in range(2)]
    tm(**first).loss.backward()
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in tm.named_parameters()}
    row, col = (second["attention_mask"] == 0).nonzero()[0].tolist()
    second["labels"][row, col] = 5
    with pytest.raises(SparseBatchError, match="a label sits on a padding position"):
        tm(**second)
    assert all(torch.equal(v, before[k]) for k, v in tm.state_dict().items())
    assert all(torch.equal(p.grad, grads[k]) for k, p in tm.named_parameters())
    # fallback="raise" alone does not make valid batches raise, nor change the default route.
    tm2, ref = _pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64), fallback="raise")
    _step_both(tm2, ref, first)
    _step_both(tm2, ref, second)
    assert tm2.capture_info().dense_batches == {"a label sits on a padding position": 1}


def test_a_cache_hit_takes_the_dense_route_too(tmp_path):
    """A graph loaded from Options.cache_dir carries its batch guard: the same batches go dense."""
    def build():
        torch.manual_seed(0)
        return models.bert_mlm(hidden=32, layers=2, heads=2, vocab=300, max_positions=64)
    g = torch.Generator().manual_seed(10)
    first, second = [models.synthetic_batch("mlm", 4, 16, 300, padding=0.4, label_density=0.15, generator=g, device=current_device())
                     for _ in range(2)]
    writer = fxtrain.TrainModule(to_device(build()), fxtrain.Options(cache_dir=str(tmp_path)))
    writer(**first).loss.backward()
    writer.capture_info()   # waits for the partition: the entry is stored with the whole step
    row, col = (second["attention_mask"] == 0).nonzero()[0].tolist()
    second["labels"][row, col] = 5
    tm, ref = _pair(build(), cache_dir=str(tmp_path))
    for batch in (first, second, first):
        out, ref_out = _step_both(tm, ref, batch)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)
    info = tm.capture_info()
    assert info.cache_hits == 1 and info.graphs == 1, info.cache_log
    assert info.dense_batches == {"a label sits on a padding position": 1}
