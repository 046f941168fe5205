"""Activation checkpointing (HF's ``gradient_checkpointing_enable``, ``torch.utils.checkpoint``)
trains as eager does: gradients equal eager's with dropout in the checkpointed layers, the
checkpointed activations are not kept, and the sparsity passes reach inside the layers."""
import copy
import functools

import pytest
import torch
import torch.fx
import torch.utils.checkpoint as cp
from torch import nn

import fxtrain
from fxtrain import models
from fxtrain import torch_private as tp
from fxtrain.passes.checkpoints import NotConvex, OpenRegions, close_checkpoints
from fxtrain.runtime.step import PassReport
from utils import assert_grads_equal, current_device, train_parity, wrap_pair


def _bert(dropout=0.0, layers=2, hidden=32):
    model = models.bert_mlm(hidden=hidden, layers=layers, heads=2, vocab=300)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = dropout
    model.config.attention_probs_dropout_prob = dropout   # HF's SDPA call reads its dropout from here
    return model


def _checkpointed(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batches(n=3, padding=0.4, label_density=0.2, shapes=((4, 16), (3, 11), (5, 20))):
    g = torch.Generator().manual_seed(0)
    return [models.synthetic_batch("mlm", b, s, 300, padding=padding, label_density=label_density,
                                   generator=g, device=current_device()) for b, s in shapes[:n]]


def _regions(tm):
    return sum(tp.is_checkpoint_call(n) for r in tm.capture_info().records for n in r.step.graph.graph.nodes)


# The aten graphs' mode (backward="graph") was right before; make test-long checks it stays so.
GRAPH_MODE = pytest.param("graph", marks=pytest.mark.extended)


@pytest.mark.parametrize("backward", ["auto", GRAPH_MODE])
def test_checkpointed_dropout_gives_eagers_gradients(backward):
    """Dropout inside checkpointed layers: the backward recomputes each layer, and must draw the
    masks its forward drew, as eager's checkpoint does (``preserve_rng_state``). Run by PyTorch's
    engine (the default's autograd mode), torch's region op recomputed them with fresh random
    numbers: the loss was eager's to the last bit and the gradients off by up to 1e-2. Every
    position is a real, labelled token, so no pass changes which random numbers are drawn."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_checkpointed(_bert(dropout=0.1)), backward=backward)
    for i, batch in enumerate(_batches(padding=0.0, label_density=1.0)):
        torch.manual_seed(i)
        loss = tm(**batch).loss
        torch.manual_seed(i)
        ref_loss = ref(**batch).loss
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=1e-5)
        tm.zero_grad(), ref.zero_grad()
    assert _regions(tm) == 2
    assert tm.capture_info().optimizations["checkpointed_regions"].startswith("on: 2 checkpointed region(s)")


def test_padding_elimination_reaches_inside_checkpointed_layers(passes_whatever_they_cost):
    """The passes see the layers inside checkpointed regions (before, padding elimination stopped at
    the first: "padding rows reach tag_activation_checkpoint"), and the regions come back as
    checkpointed calls, with what the passes made of them: loss, gradients and AdamW's weights equal
    eager's over three batch shapes on one capture."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_checkpointed(_bert(layers=3)))
    train_parity(tm, ref, _batches(), lambda out, _: out.loss, state_atol=3e-4)
    why = tm.capture_info().optimizations
    assert why["padding_elimination"].startswith("on:") and "attention on real tokens" in why["padding_elimination"], why
    assert why["label_sparsity"].startswith("on:"), why
    assert _regions(tm) == 3 and tm.capture_info().graphs == 1


@pytest.mark.parametrize("kind", ["gpt2-padded", "llama-packed"])
def test_causal_lms_checkpointed_with_reentrant_calls_keep_their_passes(kind, passes_whatever_they_cost):
    """HF's default for ``gradient_checkpointing_enable`` has been the reentrant checkpoint: dynamo
    records it as the same region op. A right-padded GPT-2 (padding elimination inside the layers)
    and a Llama on packed documents (attention document by document inside the layers) train as
    eager does."""
    torch.manual_seed(0)
    model = (models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=300, positions=64) if kind == "gpt2-padded"
             else models.build("llama-tiny", seed=0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    tm, ref = wrap_pair(model)
    g, vocab = torch.Generator().manual_seed(0), model.config.vocab_size
    batches = [models.packed_batch(2, 64, vocab, documents=(5, 20), generator=g, device=current_device())
               if kind == "llama-packed" else
               models.synthetic_batch("clm", 4, 24, vocab, padding=0.3, label_density=0.5, labels_at_end=0.5,
                                      generator=g, device=current_device()) for _ in range(2)]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=3e-4)
    why = tm.capture_info().optimizations
    fired = "packed_attention" if kind == "llama-packed" else "padding_elimination"
    assert why[fired].startswith("on:") and why["checkpointed_regions"].startswith("on: 2 "), why
    assert _regions(tm) == 2


def _saved_mib(step):
    """MiB of distinct storages autograd saves for the backward while ``step`` runs its forward."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values()) / 2 ** 20


@pytest.mark.parametrize("backward", ["auto", GRAPH_MODE])
def test_checkpointed_layers_are_not_kept_for_the_backward(backward, passes_whatever_they_cost):
    """What checkpointing is for: the layers' activations are recomputed, not kept. A 4-layer
    BERT-MLM (hidden 128, 8 x 128, half padding, passes on; torch 2.13) kept 18.6 MiB for the backward
    without checkpointing and 5.8 MiB (PyTorch's engine) or 5.7 MiB (the aten graphs) with it; eager
    with checkpointing 9.1 MiB. Here the same at 4 layers of hidden 64, 4 x 64."""
    torch.manual_seed(0)
    batch = _batches(n=1, padding=0.5, label_density=0.15, shapes=((4, 64),))[0]
    kept = {}
    for name, model in (("plain", _bert(layers=4, hidden=64)), ("checkpointed", _checkpointed(_bert(layers=4, hidden=64)))):
        tm, _ = wrap_pair(model, backward=backward)
        _saved_mib(lambda: tm(**batch).loss)               # the capture, and the partition
        tm.capture_info(wait=True)
        kept[name] = _saved_mib(lambda: tm(**batch).loss)
    assert kept["checkpointed"] < kept["plain"] / 2, kept


def test_the_profiler_costs_the_recomputation_and_the_smaller_saved_set():
    """``fxtrain.profile`` on fake tensors sees what checkpointing does to the step: the backward
    recomputes the layers (more FLOPs), the forward keeps less for it, the forward's FLOPs are the
    same."""
    batch = _batches(n=1, padding=0.5, label_density=0.15, shapes=((4, 64),))[0]
    plain = fxtrain.profile(_bert(layers=3, hidden=64).to(current_device()), **batch)
    checked = fxtrain.profile(_checkpointed(_bert(layers=3, hidden=64)).to(current_device()), **batch)
    assert checked.flops_forward == plain.flops_forward
    assert checked.flops_backward > 1.2 * plain.flops_backward, (checked.flops_backward, plain.flops_backward)
    assert checked.saved_for_backward_bytes < plain.saved_for_backward_bytes / 2, \
        (checked.saved_for_backward_bytes, plain.saved_for_backward_bytes)


def test_checkpointing_changes_no_value_under_dropout_and_the_passes(passes_whatever_they_cost):
    """With dropout and padding elimination on, fxtrain with checkpointing computes what fxtrain
    without it computes (the passes run dropout on real tokens only, so neither draws eager's masks):
    the same random numbers in the forward and in the recomputation."""
    torch.manual_seed(0)
    base = _bert(dropout=0.1)
    plain = fxtrain.TrainModule(copy.deepcopy(base).to(current_device()))
    checked = fxtrain.TrainModule(_checkpointed(base).to(current_device()))
    for i, batch in enumerate(_batches(shapes=((4, 16), (4, 16)))):   # one capture each
        losses = []
        for tm in (plain, checked):
            torch.manual_seed(i)
            losses.append(tm(**batch).loss)
            losses[-1].backward()
        torch.testing.assert_close(losses[0], losses[1])
        assert_grads_equal(checked.module, plain.module, atol=1e-6)
        plain.zero_grad(), checked.zero_grad()
    assert checked.capture_info().optimizations["padding_elimination"].startswith("on:")


class _Selective(nn.Module):
    """Two blocks under a selective checkpoint policy (``context_fn``): matmuls kept, the rest recomputed."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(2))

    def forward(self, x):
        def policy(ctx, op, *args, **kwargs):
            keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return cp.CheckpointPolicy.MUST_SAVE if keep else cp.CheckpointPolicy.PREFER_RECOMPUTE
        context = functools.partial(cp.create_selective_checkpoint_contexts, policy)
        for block in self.blocks:
            x = cp.checkpoint(block, x, use_reentrant=False, context_fn=context)
        return x.square().mean()


def test_selective_checkpoint_stays_whole_and_gives_eagers_gradients():
    """A selective policy tags its ops as they run: its regions are left whole, with the reason, and
    run as eager runs them (dropout's masks drawn again in the recomputation as in the forward)."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_Selective())
    for i in range(2):
        x = torch.randn(6, 16, device=current_device())
        torch.manual_seed(i)
        loss = tm(x)
        torch.manual_seed(i)
        ref_loss = ref(x)
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=1e-6)
        tm.zero_grad(), ref.zero_grad()
    why = tm.capture_info().optimizations["checkpointed_regions"]
    assert why.startswith("off: a selective checkpoint (context_fn)") and "2 region(s) left whole" in why, why


@pytest.mark.cpu_only("graph surgery on a hand-built graph: no device involved")
def test_closing_a_region_takes_in_the_pure_ops_between_its_ops_and_refuses_impure_ones():
    """A region whose ops the passes left around an op outside it (reading the region, feeding it):
    a pure one joins the region, so the call is one piece again; an impure one cannot move into a
    recomputed body, and the capture then keeps the regions whole (capture/pipeline.py)."""
    def build(impure):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        a = graph.call_function(torch.sin, (x,))
        between = graph.call_function(torch.nn.functional.dropout if impure else torch.cos, (a,))
        b = graph.call_function(torch.add, (a, between))
        out = graph.call_function(torch.mul, (b, 2.0))
        graph.output(out)
        for n in (a, b):
            tp.tag_recompute(n, 7)
        return torch.fx.GraphModule(nn.Module(), graph)

    gm = build(impure=False)
    x = torch.randn(5, requires_grad=True)
    want = gm(x)
    close_checkpoints(gm, OpenRegions(PassReport("checkpointed_regions", True, ""), {7: {"use_reentrant": False}}))
    calls = [n for n in gm.graph.nodes if tp.is_checkpoint_call(n)]
    assert len(calls) == 1 and calls[0].kwargs == {"use_reentrant": False}
    body = getattr(gm, calls[0].args[0].target)
    assert [n.target for n in body.graph.nodes if n.op == "call_function"] == [torch.sin, torch.cos, torch.add]
    assert not any(tp.recompute_region(n) is not None for g in (gm, body) for n in g.graph.nodes)
    from fxtrain.runtime.checkpointed import checkpointing_eagerly
    torch.testing.assert_close(checkpointing_eagerly(gm)(x), want)
    with pytest.raises(NotConvex, match="dropout"):
        close_checkpoints(build(impure=True), OpenRegions(PassReport("checkpointed_regions", True, ""), {7: {}}))
