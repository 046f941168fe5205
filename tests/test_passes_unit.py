"""The sparsity passes and the batch guard on hand-built FX graphs: no dynamo, no TrainModule.

What a pass reads of the capturing batch comes from the ``ExampleSource`` it is handed, so each test
names the batch's values, runs one pass, and checks what it decided, what it rewrote, and that the
rewritten graph computes what the original does (loss and gradients) on real inputs.
"""
import copy
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxtrain
from fxtrain.capture import pipeline
from fxtrain.capture.pipeline import CaptureContext, rewrite
from fxtrain.cost.launches import DeviceRates, DeviceStep, StepLoad, launch_bound, rates_for, replay_pays
from fxtrain.graph_walk import ancestors
from fxtrain.passes import ExampleSource, Plans, run_passes
from fxtrain.passes import eager_attention
from fxtrain.passes.batch_guard import GuardBuilder, counted_index
from fxtrain.passes.label_sparsity import label_sparsity
from fxtrain.passes.padding_elimination import padding_elimination
from fxtrain.passes.row_ops import row_selection
from fxtrain.passes.varlen import _Evaluator, autocast_dtype_at
from fxtrain.runtime import varlen_attention as va
from utils import current_device, to_device

B, S, H, HEADS, V = 3, 8, 16, 2, 50


def lm_head(hidden, labels, w1, b1, ln_w, ln_b, decoder, bias):
    """An MLM head as dynamo records it: torch functions, weights as graph inputs."""
    h = F.layer_norm(F.gelu(F.linear(hidden, w1, b1)), (H,), ln_w, ln_b)
    logits = F.linear(h, decoder, bias)
    return (F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100),)


def encoder(input_ids, attention_mask, labels, emb, wq, wk, wv, wo, ln_w, ln_b, decoder):
    """One attention layer over [batch, seq] tokens whose padding the mask marks, then an LM loss."""
    b, s = input_ids.size(0), input_ids.size(1)
    h = F.embedding(input_ids, emb)

    def heads(w):
        return F.linear(h, w).view(b, s, HEADS, H // HEADS).transpose(1, 2)

    mask = attention_mask[:, None, None, :].bool()
    a = F.scaled_dot_product_attention(heads(wq), heads(wk), heads(wv), attn_mask=mask)
    h = F.layer_norm(h + F.linear(a.transpose(1, 2).reshape(b, s, H), wo), (H,), ln_w, ln_b)
    logits = F.linear(h, decoder)
    return (F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100),)


def _traced(fn, inputs):
    """``fn`` as a GraphModule whose nodes carry fake values (``meta["val"]``), as dynamo's do."""
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*inputs.values())
    return gm


def _run(pass_fn, gm, examples, **options):
    plans = Plans()
    report = pass_fn(gm, examples, fxtrain.Options(**options), plans)
    gm.graph.lint()
    gm.recompile()
    return report, plans


def _loss_and_grads(gm, inputs, weights):
    args = {k: (v.detach().requires_grad_() if k in weights else v) for k, v in inputs.items()}
    (loss,) = gm(*args.values())
    return loss, torch.autograd.grad(loss, [args[k] for k in weights])


def _same_step(rewritten, original, inputs, weights):
    loss, grads = _loss_and_grads(rewritten, inputs, weights)
    ref_loss, ref_grads = _loss_and_grads(original, inputs, weights)
    torch.testing.assert_close(loss, ref_loss)
    for name, g, ref in zip(weights, grads, ref_grads):
        torch.testing.assert_close(g, ref, msg=lambda m: f"{name}: {m}")


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------------------------- label sparsity
def _head_inputs(labelled, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) >= labelled] = -100
    labels[0, 0] = 3   # at least one labelled row
    return to_device({"hidden": torch.randn(B, S, H, generator=g), "labels": labels,
                      "w1": torch.randn(H, H, generator=g) / 4, "b1": torch.randn(H, generator=g),
                      "ln_w": torch.rand(H, generator=g) + 0.5, "ln_b": torch.randn(H, generator=g),
                      "decoder": torch.randn(V, H, generator=g) / 4, "bias": torch.randn(V, generator=g)})


HEAD_WEIGHTS = ("hidden", "w1", "b1", "ln_w", "ln_b", "decoder", "bias")


def test_label_sparsity_computes_the_head_on_labelled_rows_only():
    inputs = _head_inputs(labelled=0.2)
    gm = _traced(lm_head, inputs)
    original = copy.deepcopy(gm)
    report, plans = _run(label_sparsity, gm, ExampleSource({"labels": inputs["labels"]}))
    density = float((inputs["labels"] != -100).float().mean())
    assert report.applied and report.reason.startswith(f"label density {density:.2f} < 0.9"), report
    assert "2 matmul(s) run on labelled rows only" in report.reason
    # The labelled rows of the hidden states are picked before the head's first linear, and the loss
    # reads the decoder's output on them directly.
    (select,) = [n for n in gm.graph.nodes if n.target is torch.nonzero_static]
    first, decoder = [n for n in gm.graph.nodes if n.target is F.linear]
    rows, index = row_selection(first.args[0])
    assert rows.args[0].name == "hidden" and select in ancestors(index)
    (loss,) = [n for n in gm.graph.nodes if n.target is F.cross_entropy]
    assert loss.kwargs["input"] is decoder
    # Later batches are measured by the runtime (a probe on the labels input), and sized by the guard.
    assert plans.probes == [("label density", 1, -100)]
    assert plans.guard is not None and plans.guard.slots
    _same_step(gm, original, inputs, HEAD_WEIGHTS)
    # Another batch of other label positions, sized by the guard's count as the runtime does it.
    other = _head_inputs(labelled=0.5, seed=1)
    assert plans.guard.failed(tuple(other.values())) == []
    _same_step(gm, original, other, HEAD_WEIGHTS)


def test_label_sparsity_decides_on_the_batch_the_source_gives():
    inputs = _head_inputs(labelled=1.0)   # every row labelled: nothing to skip
    gm = _traced(lm_head, inputs)
    report, plans = _run(label_sparsity, gm, ExampleSource({"labels": inputs["labels"]}))
    assert not report.applied and report.reason == "label density 1.00 >= 0.9: nothing worth skipping", report
    assert torch.nonzero_static not in _targets(gm) and plans.guard is None
    # Without the batch's values the density is unknown: the pass runs, exact either way.
    report, _ = _run(label_sparsity, _traced(lm_head, inputs), ExampleSource())
    assert report.applied and "label density unknown at capture" in report.reason, report


# ---------------------------------------------------------------------------- padding elimination
def _encoder_inputs(seed=0, lengths=(8, 5, 3), label_on_padding=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.int64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = torch.randint(1, V, (B, S), generator=g) * mask
    labels = torch.where(mask.bool(), torch.randint(0, V, (B, S), generator=g), torch.full((B, S), -100))
    if label_on_padding:
        labels[2, S - 1] = 7
    w = {name: torch.randn(*shape, generator=g) / 4 for name, shape in
         [("emb", (V, H)), ("wq", (H, H)), ("wk", (H, H)), ("wv", (H, H)), ("wo", (H, H))]}
    return to_device({"input_ids": ids, "attention_mask": mask, "labels": labels, **w,
                      "ln_w": torch.rand(H, generator=g) + 0.5, "ln_b": torch.randn(H, generator=g),
                      "decoder": torch.randn(V, H, generator=g) / 4})


ENCODER_WEIGHTS = ("emb", "wq", "wk", "wv", "wo", "ln_w", "ln_b", "decoder")


def _batch(inputs):
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "labels")}


def test_padding_elimination_runs_token_wise_ops_on_real_tokens_only():
    inputs = _encoder_inputs()
    gm = _traced(encoder, inputs)
    original = copy.deepcopy(gm)
    report, plans = _run(padding_elimination, gm, ExampleSource(_batch(inputs)))
    assert report.applied, report
    assert report.reason.startswith("token density 0.67 < 0.9: 5 matmul(s) on real tokens only"), report
    assert "attention on real tokens, sequence by sequence: 1 of 1" in report.reason, report
    assert plans.probes == [("token density", 1, 0)]
    assert torch.nonzero_static in _targets(gm)
    assert F.scaled_dot_product_attention not in _targets(gm)   # attention runs per sequence
    assert plans.guard is not None and plans.guard.failed(tuple(inputs.values())) == []
    _same_step(gm, original, inputs, ENCODER_WEIGHTS)
    other = _encoder_inputs(seed=1, lengths=(2, 8, 6))
    left = {k: v.flip(1) if k in ("input_ids", "attention_mask", "labels") else v for k, v in other.items()}
    for batch in (other, left):   # other lengths; the same batch padded on the left
        assert plans.guard.failed(tuple(batch.values())) == []
        _same_step(gm, original, batch, ENCODER_WEIGHTS)


def _in_place(read):
    def fn(input_ids, attention_mask, labels, emb, wq, wk, wv, wo, ln_w, ln_b, decoder):
        y = F.linear(F.embedding(input_ids, emb, 0), wq)
        alias = y
        before = y * 0.5 if read == "read-before" else 0.0
        y *= 2.0   # Gemma 4's ``hidden_states *= self.layer_scalar``; Mixtral's ``w /= w.sum(-1, keepdim=True)``
        after = alias * 0.5 if read == "read-after" else 0.0   # sees the mutation: y's new value
        logits = F.linear(F.gelu(y + before + after), decoder)
        return (F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100),)
    return fn


@pytest.mark.parametrize("read", ["alone", "read-before", "read-after"])
def test_padding_elimination_runs_in_place_arithmetic_out_of_place_only_where_nothing_reads_it_after(read):
    """``y *= s`` on rows that no op reads after it is ``y * s`` on the real tokens' rows: an op
    before it reads what both leave in ``y``. An op after it that reads ``y`` through another name
    sees the mutation, which the out-of-place op would not make, so the region stops there."""
    inputs = _encoder_inputs()
    gm = _traced(_in_place(read), inputs)
    (scaled,) = [n for n in gm.graph.nodes if n.target is operator.mul and n.args[1] == 2.0]
    scaled.target = operator.imul   # as dynamo records ``y *= 2.0`` (FX's tracer records a mul)
    gm.recompile()
    original = copy.deepcopy(gm)
    report, _ = _run(padding_elimination, gm, ExampleSource(_batch(inputs)))
    if read == "read-after":
        assert not report.applied and report.reason.startswith("padding rows reach imul"), report
    else:
        assert report.applied, report
        assert operator.imul not in _targets(gm) and operator.mul in _targets(gm)
    _same_step(gm, original, inputs, ("emb", "wq", "decoder"))


def test_attention_on_real_tokens_is_cast_as_autocast_casts_each_sdpa():
    """The dtype q, k and v get in place of an SDPA is the one autocast gives that SDPA: the capture's
    autocast, then the model's own ``torch.autocast`` blocks around it (recorded by dynamo as
    enter/exit calls). Eager's output dtypes are the oracle."""
    device = current_device().type

    def attend(q, v):
        a = F.scaled_dot_product_attention(q, q, v)
        with torch.autocast(device, enabled=False):
            b = F.scaled_dot_product_attention(q, q, v)
        with torch.autocast(device, dtype=torch.float16):
            c = F.scaled_dot_product_attention(q, q, v)
        return a, b, c

    q, v = to_device((torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)))
    graphs = []
    torch.compile(attend, backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)(q, v)
    sdpas = [n for n in graphs[0].graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpas) == 3
    for ambient in (None, torch.bfloat16):
        with torch.autocast(device, dtype=ambient or torch.bfloat16, enabled=ambient is not None):
            eager = [o.dtype for o in attend(q, v)]
            got = [autocast_dtype_at(n, device) or torch.float32 for n in sdpas]
        assert got == eager == [ambient or torch.float32, torch.float32, torch.float16], (got, eager)


def test_padding_elimination_checks_the_capturing_batch_it_is_given():
    # A label on a padding position: the rewritten loss would miss it, so the pass stays off.
    inputs = _encoder_inputs(label_on_padding=True)
    report, _ = _run(padding_elimination, _traced(encoder, inputs), ExampleSource(_batch(inputs)))
    assert not report.applied and report.reason == "the loss has labels on padding positions", report
    # No padding: nothing to skip.
    inputs = _encoder_inputs(lengths=(8, 8, 8))
    report, _ = _run(padding_elimination, _traced(encoder, inputs), ExampleSource(_batch(inputs)))
    assert report.reason == "token density 1.00 >= 0.9: nothing worth skipping", report
    # Without the batch the model's mask cannot be evaluated: the pass cannot prove itself exact.
    inputs = _encoder_inputs()
    report, _ = _run(padding_elimination, _traced(encoder, inputs), ExampleSource())
    assert not report.applied and report.reason == "the token mask of the capturing batch is not readable", report


# ------------------------------------------------------------------------------------- batch guard
def test_the_batch_guard_sends_a_label_on_padding_to_the_dense_graph():
    inputs = _encoder_inputs()
    gm = _traced(encoder, inputs)
    report, plans = _run(padding_elimination, gm, ExampleSource(_batch(inputs)))
    assert report.applied, report
    bad = _encoder_inputs(seed=2, label_on_padding=True)
    assert plans.guard.failed(tuple(bad.values())) == ["a label sits on a padding position"]
    assert plans.guard.failed(tuple(_encoder_inputs(seed=3).values())) == []


def _kept_rows_sum(x, keep):
    return ((x * (keep != 0)[:, None]).sum(),)


KEEP_INPUTS = {"x": torch.arange(12.0).view(6, 2), "keep": torch.tensor([1, 0, 1, 1, 0, 0])}


def _counted_selection(inputs):
    """``_kept_rows_sum`` traced, its rows selected by ``counted_index(keep != 0)``: the graph, its
    plans (the guard counting the selection), ``keep``'s placeholder and the output node."""
    gm = _traced(_kept_rows_sum, inputs)
    plans = Plans()
    x, keep = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graph = gm.graph
    with graph.inserting_before(output):
        index = counted_index(gm, plans, graph.call_function(torch.ne, (keep, 0)))
        total = graph.call_method("sum", (graph.call_function(torch.index_select, (x, 0, index)),))
    output.args = ((total,),)
    return gm, plans, keep, output


def test_the_batch_guard_counts_a_selection_and_checks_conditions_before_the_step():
    inputs = to_device(KEEP_INPUTS)
    gm, plans, keep, _ = _counted_selection(inputs)
    builder = GuardBuilder.of(gm, plans)
    assert builder is plans.guard_builder   # a later pass adds to the same guard
    builder.require(builder.call("all", builder.call(torch.ge, builder.node(keep), 0), method=True),
                    "keep is negative somewhere")
    builder.store(plans)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    guard = plans.guard
    assert guard.reasons == ["keep is negative somewhere"] and len(guard.slots) == 1
    assert guard.check(*inputs.values()).tolist() == [1, 3]   # condition holds; 3 rows kept
    assert guard.failed(tuple(inputs.values())) == []
    torch.testing.assert_close(gm(*inputs.values())[0], _kept_rows_sum(*inputs.values())[0])
    bad = dict(inputs, keep=to_device(torch.tensor([1, -1, 0, 0, 0, 0])))
    assert guard.failed(tuple(bad.values())) == ["keep is negative somewhere"]


def test_the_batch_guard_computes_each_thing_it_reads_once():
    """Models recompute what the guard reads and each pass adds its own reading (BERT's guard made
    ``attention_mask != 0`` three times: a kernel each, every step): the guard's graph computes each
    once, whichever node of the captured graph, or of a pass, asked for it."""
    inputs = to_device(KEEP_INPUTS)
    gm, plans, keep, output = _counted_selection(inputs)
    with gm.graph.inserting_before(output):
        again = gm.graph.call_function(torch.ne, (keep, 0))     # the model computing it a second time
    builder = GuardBuilder.of(gm, plans)
    builder.require(builder.call("any", builder.node(again), method=True), "nothing is kept")
    builder.require(builder.call("any", builder.call(torch.ne, builder.node(keep), 0), method=True),
                    "the same, asked again")
    builder.store(plans)
    check = plans.guard.check
    assert [n.target for n in check.graph.nodes].count(torch.ne) == 1, check.code
    assert [n.target for n in check.graph.nodes].count("any") == 1, check.code
    assert plans.guard.check(*inputs.values()).tolist() == [1, 1, 3]
    none = dict(inputs, keep=to_device(torch.zeros(6, dtype=torch.long)))
    assert plans.guard.failed(tuple(none.values())) == ["nothing is kept", "the same, asked again"]


def test_run_passes_measures_the_batch_its_source_gives():
    for labelled, on in ((0.2, True), (1.0, False)):
        inputs = _head_inputs(labelled)
        plans = Plans()
        reports = {name: str(r) for name, r in run_passes(_traced(lm_head, inputs), ExampleSource(
            {"labels": inputs["labels"]}), fxtrain.Options(), plans)[0].items()}
        assert reports["label_sparsity"].startswith("on: label density" if on else "off: label density"), reports
        assert reports["padding_elimination"] == "off: no [batch, seq] embedding lookup"
        assert plans.guard_builder is None and (plans.guard is not None) == on


@pytest.mark.parametrize("name", ["label_sparsity", "padding_elimination"])
def test_a_pass_turned_off_rewrites_nothing(name):
    pass_fn, fn, inputs = {"label_sparsity": (label_sparsity, lm_head, _head_inputs(0.2)),
                           "padding_elimination": (padding_elimination, encoder, _encoder_inputs())}[name]
    gm = _traced(fn, inputs)
    before = gm.code
    report, plans = _run(pass_fn, gm, ExampleSource(inputs), **{name: "off"})
    assert (report.applied, report.reason) == (False, "off by option") and gm.code == before and plans == Plans()


# ------------------------------------------------------------------------- launch cost (issue 17)
def wide_head(hidden, labels, decoder):
    """An LM head alone: the logits of every row, of which the loss reads the labelled ones."""
    return (F.cross_entropy(F.linear(hidden, decoder).view(-1, decoder.size(0)), labels.view(-1), ignore_index=-100),)


def _wide_head_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 8192, (8, 128), generator=g)
    labels[torch.rand(8, 128, generator=g) >= 0.15] = -100
    return to_device({"hidden": torch.randn(8, 128, 256, generator=g).to(dtype), "labels": labels,
                      "decoder": (torch.randn(8192, 256, generator=g) / 16).to(dtype)})


def _rewritten(fn, inputs, rates, **options):
    gm = _traced(fn, inputs)
    context = CaptureContext(fxtrain.Options(**options), None, ExampleSource(inputs), launch_rates=rates)
    return gm, rewrite(gm, context)


def test_a_pass_whose_launches_cost_more_than_it_skips_is_off_on_an_accelerator():
    """On a device fed by host launches, the tiny encoder's passes add more launch time than the
    FLOPs they skip take: the capture keeps dynamo's graph and says why. The CPU keeps them."""
    inputs = _encoder_inputs()
    plain = _traced(encoder, inputs)
    gm, rewritten = _rewritten(encoder, inputs, rates_for("cuda"))
    for name in ("label_sparsity", "padding_elimination"):
        assert rewritten.reports[name].startswith("off: on cuda the step is bound by the host's launches: its "), \
            rewritten.reports
        assert "extra forward kernel op(s) add ~" in rewritten.reports[name]
    assert [n.target for n in gm.graph.nodes] == [n.target for n in plain.graph.nodes]
    assert rewritten.plans == Plans() and rewritten.dense_graph is None
    torch.testing.assert_close(gm(*inputs.values())[0], plain(*inputs.values())[0])
    # The graph's own device decides, the CPU by its own rule (host work and arithmetic add up there):
    # one attention of 3 sequences and a 256-wide head over 24 tokens skip less than they add.
    _, own = _rewritten(encoder, inputs, None)
    assert all(own.reports[n].startswith(f"off: on {'the cpu' if current_device().type == 'cpu' else ''}")
               for n in ("label_sparsity", "padding_elimination")), own.reports
    # Asked for by option: kept whatever it costs.
    _, forced = _rewritten(encoder, inputs, rates_for("cuda"), padding_elimination="on")
    assert forced.reports["padding_elimination"].startswith("on: forced on"), forced.reports
    assert forced.reports["label_sparsity"].startswith("off: on cuda the step"), forced.reports


def test_a_pass_turned_off_for_its_launches_is_weighed_before_the_passes_after_it_run(monkeypatch):
    """Each pass is weighed as it applies. Label sparsity comes first and is slower on an accelerator:
    the passes start again without it on dynamo's graph, so padding elimination runs once, on the
    graph it serves, and weighs what it skips there (the head's padded rows too)."""
    calls = []

    def counted(p):
        def run(*args):
            calls.append(p.__name__)
            return p(*args)
        run.__name__ = p.__name__
        return run

    monkeypatch.setattr(fxtrain.passes, "PASSES", [counted(p) for p in fxtrain.passes.PASSES])
    inputs = _encoder_inputs()
    gm, rewritten = _rewritten(encoder, inputs, rates_for("cuda"), padding_elimination="on")
    assert calls.count("padding_elimination") == 1 and calls[:2] == ["label_sparsity"] * 2, calls
    assert rewritten.reports["label_sparsity"].startswith("off: on cuda the step is bound by the host's"), \
        rewritten.reports
    assert rewritten.reports["padding_elimination"].startswith("on: forced on"), rewritten.reports
    by_option, _ = _rewritten(encoder, inputs, rates_for("cuda"), padding_elimination="on", label_sparsity="off")
    assert [(n.op, n.target) for n in gm.graph.nodes] == [(n.op, n.target) for n in by_option.graph.nodes]
    torch.testing.assert_close(gm(*inputs.values())[0], _traced(encoder, inputs)(*inputs.values())[0])


def test_the_launch_cost_is_weighed_at_the_precision_the_flops_run_in():
    """The rate is the one of the graph's largest contraction's dtype. Label sparsity on an
    8192-class head over 1024 rows: the dense step's 4.3 GFLOP of forward contractions take the
    device ~13 ms at 1 TFLOP/s (float32 here), far longer than the host's launches: it pays; at
    1000 TFLOP/s (16-bit here) they take ~13 µs, and the ops it adds cost the host more than that."""
    rates = DeviceRates("cuda", host_per_op={"float32": 1e-6, "16-bit": 1e-6}, host_per_added_op=20e-6,
                        flops_per_second={"float32": 1e12, "tf32": 1e12, "16-bit": 1e15})
    _, fp32 = _rewritten(wide_head, _wide_head_inputs(torch.float32), rates)
    assert fp32.reports["label_sparsity"].startswith("on: label density"), fp32.reports
    _, bf16 = _rewritten(wide_head, _wide_head_inputs(torch.bfloat16), rates)
    assert bf16.reports["label_sparsity"].startswith("off: on cuda the step "), bf16.reports
    assert "(1000 TFLOP/s, bfloat16)" in bf16.reports["label_sparsity"], bf16.reports


@pytest.mark.cpu_only(reason="the launch model's arithmetic: no tensors")
def test_launch_bound_decides_only_where_it_knows():
    cuda = rates_for("cuda")
    step = StepLoad(kernels=100, flops=10 ** 9)
    assert launch_bound(1, 100, step, None, torch.float32) is None               # no rates: no weighing
    assert launch_bound(None, 100, step, cuda, torch.float32) is None        # a density computed in the graph
    assert launch_bound(1, 0, step, cuda, torch.float32) is None             # no kernel added
    assert launch_bound(10 ** 9, 5, None, cuda, torch.float32) is None       # the dense step unknown
    assert rates_for("xpu").name == "xpu"   # any accelerator: the same model


def _eager_encoder(form):
    """``encoder`` with its attention written out in eager ops, as transformers' eager attention:
    ``plain`` (scaled by a number, cast, an additive mask at float32's lowest value, softmax, a
    dropout of ``p`` 0); ``capped`` (``tanh`` before the mask); ``dropout`` (``p`` 0.1 while
    training); ``tensor scale`` (scaled by a one-element tensor)."""
    def fn(input_ids, attention_mask, labels, emb, wq, wk, wv, wo, ln_w, ln_b, decoder):
        b, s = input_ids.size(0), input_ids.size(1)
        h = F.embedding(input_ids, emb)

        def heads(w):
            return F.linear(h, w).view(b, s, HEADS, H // HEADS).transpose(1, 2)

        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        scores = torch.matmul(heads(wq), heads(wk).transpose(-2, -1)).float()
        scores = scores * ln_w[:1] if form == "tensor scale" else scores / 2.0
        if form == "capped":
            scores = torch.tanh(scores)
        weights = F.softmax(scores + mask, dim=-1, dtype=torch.float32)
        weights = F.dropout(weights, p=0.1 if form == "dropout" else 0.0, training=True)
        a = torch.matmul(weights, heads(wv))
        h = F.layer_norm(h + F.linear(a.transpose(1, 2).reshape(b, s, H), wo), (H,), ln_w, ln_b)
        logits = F.linear(h, decoder)
        return (F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100),)
    return fn


@pytest.mark.parametrize("form", ["plain", "capped", "dropout", "tensor scale"])
def test_attention_in_eager_ops_runs_on_real_tokens_as_the_sdpa_it_computes_only_when_plain(form):
    """passes/eager_attention.py: a plain block is SDPA with its mask and scale (here 1/2), and
    padding elimination runs it sequence by sequence (no matmul over [batch, heads, seq, seq] left);
    any other keeps the padded layout and the report says why. Loss and gradients are the
    original graph's either way, over the capturing batch and another."""
    inputs = _encoder_inputs()
    gm = _traced(_eager_encoder(form), inputs)
    original = copy.deepcopy(gm)
    (block,) = eager_attention.find(gm)
    equivalent, why = block.sdpa_equivalent()
    assert (equivalent is None) == (form != "plain"), why
    if form == "plain":
        assert equivalent.args["scale"] == 0.5 and equivalent.args["attn_mask"] is block.mask
        assert equivalent.args["key"] is block.scores.args[1].args[0] and equivalent.args["value"] is block.out.args[1]
    report, plans = _run(padding_elimination, gm, ExampleSource(_batch(inputs)))
    assert report.applied, report
    expected = {"plain": "1 of 1", "capped": "its scores pass through tanh (a cap) before the mask",
                "dropout": "attention dropout is on", "tensor scale": "its scores are scaled by a tensor"}[form]
    assert expected in report.reason, report
    squares = [n for n in gm.graph.nodes if n.target is torch.matmul and n.meta.get("val") is not None
               and tuple(n.meta["val"].shape[-2:]) == (S, S)]
    assert bool(squares) == (form != "plain"), squares
    if form != "dropout":   # dropout draws its mask from the generator: no two runs agree
        _same_step(gm, original, inputs, ENCODER_WEIGHTS)
        other = _encoder_inputs(seed=1, lengths=(2, 8, 6))
        assert plans.guard.failed(tuple(other.values())) == []
        _same_step(gm, original, other, ENCODER_WEIGHTS)


def test_padding_elimination_reports_the_attention_calls_it_makes_variable_length():
    """What the CPU's rule weighs: one attention over 3 sequences of lengths 8, 5, 3 runs as one
    kernel call a run on the CPU's route, one call on CUDA's variable-length kernels."""
    inputs = _encoder_inputs()
    reports, slower = run_passes(_traced(encoder, inputs), ExampleSource(inputs), fxtrain.Options(), Plans())
    report = reports["padding_elimination"]
    assert report.applied and slower is None, report
    runs = 1 if va.route(current_device().type, torch.float32, H // HEADS) in va.VARLEN_ROUTES else 3
    assert (report.attention_calls, report.attention_runs) == (1, runs), report
    assert va.kernel_calls(torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4, 8), [8, 5, 5, 0, 3]) == 3
    assert reports["label_sparsity"].attention_calls == 0


@pytest.mark.cpu_only(reason="the launch model's arithmetic: no tensors")
def test_on_the_cpu_a_pass_pays_where_the_host_work_it_adds_takes_less_than_the_arithmetic_it_skips(monkeypatch):
    """The CPU's host work and arithmetic share the cores, so they add up; the attention a pass makes
    variable-length costs a call and a kernel call per run of equal lengths there (cost/launches.py)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cpu = rates_for("cpu")
    assert cpu.shares_cores and cpu.rate(torch.float32) == 160e9 and cpu.rate(torch.bfloat16) == 160e9
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert rates_for("cpu").rate(torch.float32) == 320e9          # the arithmetic scales with threads
    step = StepLoad(kernels=215, flops=120 * 10 ** 6)   # unused on the CPU: the dense step's own ops do not bound
    # 12 layers of hidden 32 at 4 x 64: ~9.1 ms of attention calls against ~1.1 ms of arithmetic.
    why = launch_bound(59_700_000, -1, step, cpu, torch.float32, attention_calls=12, attention_runs=48)
    assert why == ("on the cpu the host's work and the arithmetic share the cores: 12 attention(s) run as 48 kernel "
                   "calls (one per run of equal lengths) add ~9.1 ms of host work a step; the 179 MFLOP it skips in "
                   "forward and backward take ~1.1 ms at 160 GFLOP/s"), why
    # The demo's padding elimination: 6.9 GFLOP skipped (~130 ms) for 4 attentions of 16 runs (~10 ms).
    assert launch_bound(6_922_000_000, 7, step, cpu, torch.float32, attention_calls=4, attention_runs=64) is None
    # Label sparsity's gathers alone: 5 ops (~300 µs) against what they skip.
    assert launch_bound(10 ** 7, 5, step, cpu, torch.float32) == (
        "on the cpu the host's work and the arithmetic share the cores: 5 extra forward kernel op(s) add ~300 µs "
        "of host work a step; the 30 MFLOP it skips in forward and backward take ~188 µs at 160 GFLOP/s")
    assert launch_bound(10 ** 8, 5, step, cpu, torch.float32) is None
    assert launch_bound(None, 5, step, cpu, torch.float32) is None      # a density computed in the graph
    assert launch_bound(0, -3, step, cpu, torch.float32) is None        # only removes work
    # The replay keeps the CPU's rule (memory traffic per replayed op) under the CPU's rates.
    on_cpu = DeviceStep(cpu, step, torch.float32)
    assert replay_pays(805 * 2 ** 20, 396, on_cpu) == replay_pays(805 * 2 ** 20, 396, None)
    assert replay_pays(10 * 2 ** 20, 396, on_cpu) == replay_pays(10 * 2 ** 20, 396, None)


@pytest.mark.cpu_only(reason="the launch model's arithmetic: no tensors")
def test_the_backward_is_replayed_only_where_that_shortens_the_step_on_its_device():
    """The eager executor replays the aten backward (where the backward passes remove memory
    traffic) only where that shortens the step: on an accelerator the replay's ~5 µs an op is host
    time, the traffic saved device time at 4 TB/s; on the CPU 50 kB of traffic per replayed op."""
    cuda = rates_for("cuda")
    demo = DeviceStep(cuda, StepLoad(kernels=87, flops=46 * 10 ** 9), torch.float32)   # host-bound
    pays, why = replay_pays(805 * 2 ** 20, 396, demo)
    assert not pays and why == ("replaying 396 backward ops adds ~2 ms to the host's ~8.1 ms per step, the 805.0 MiB "
                                "of memory traffic the backward passes remove take ~211 µs of the device's ~3.4 ms on "
                                "cuda: ~10 ms per step against ~8.1 ms"), why
    assert replay_pays(805 * 2 ** 20, 396, None)[0]          # the CPU: 805 MiB > 396 x 50 kB
    assert not replay_pays(10 * 2 ** 20, 396, None)[0]       # 10 MiB < 396 x 50 kB
    # Device-bound (a wide head: ~75 ms of device work for ~1 ms of launches): 4 GB of traffic pays.
    wide = DeviceStep(cuda, StepLoad(kernels=10, flops=10 ** 12), torch.float32)
    assert replay_pays(4 * 10 ** 9, 100, wide) == (True, (
        "replaying 100 backward ops adds ~500 µs to the host's ~930 µs per step, the 3814.7 MiB of memory traffic "
        "the backward passes remove take ~1 ms of the device's ~75 ms on cuda: ~74 ms per step against ~75 ms"))
    # Nothing saved: PyTorch's engine, whatever the device.
    assert replay_pays(0, 396, None) == replay_pays(0, 396, demo) == (
        False, "no backward pass applies: PyTorch's engine runs the backward")


@pytest.mark.cpu_only(reason="the launch model's arithmetic: no tensors")
def test_a_pass_pays_only_where_it_shortens_the_longer_of_host_and_device():
    """The step takes the longer of its host time (ops) and its device time (FLOPs). Host-bound,
    a pass that adds ops never pays, however much it skips; device-bound, it pays until the host
    becomes the bound. At the H200's rates (cost/launches.py: 93 µs a float32 op, 233 µs an added
    one, 40 TFLOP/s float32, 220 16-bit)."""
    cuda = rates_for("cuda")
    demo = StepLoad(kernels=87, flops=46 * 10 ** 9)     # the demo: host ~8.1 ms, device ~3.4 ms
    why = launch_bound(40 * 10 ** 9, 5, demo, cuda, torch.float32)
    assert why.startswith("on cuda the step is bound by the host's launches: its 5 extra forward kernel op(s) "
                          "add ~1.2 ms of host time to the step's ~8.1 ms; the 120 GFLOP it skips in forward and "
                          "backward save ~3 ms of the device's ~3.4 ms (40 TFLOP/s, float32): ~9.3 ms per step "
                          "against ~8.1 ms"), why
    base = StepLoad(kernels=215, flops=3880 * 10 ** 9)  # BERT-base 32x512: host ~32 ms, device ~53 ms (bf16)
    assert launch_bound(817 * 10 ** 9, 5, base, cuda, torch.bfloat16) is None          # ~42 ms after
    assert launch_bound(10 ** 9, 5, base, cuda, torch.bfloat16) is None                # still device-bound
    assert launch_bound(3000 * 10 ** 9, 100, base, cuda, torch.bfloat16) is not None   # host ~55 ms after


@pytest.mark.cpu_only(reason="graph evaluation on host probes: the device plays no part")
def test_the_matchers_probes_are_shared_and_a_path_that_writes_into_one_is_refused():
    """The attention matcher's numbered probes are views of one tensor made once per capture (a
    probe is as large as the batch's activations), so a layout path that writes into its probe
    must be refused, not trusted: the numbers it compares against would have moved with it."""
    def layout(x):
        return x.view(4, 2).t()

    def writes(x):
        return x.view(4, 2).mul_(2).t()

    ev = _Evaluator(torch.fx.symbolic_trace(layout), lambda gm, node: None)
    large, small = ev.numbered((3, 4), torch.device("cpu")), ev.numbered((8,), torch.device("cpu"))
    assert torch.equal(large.flatten(), torch.arange(12, dtype=torch.float64))
    assert small.data_ptr() == large.data_ptr() and torch.equal(small, torch.arange(8, dtype=torch.float64))
    nodes = list(ev.gm.graph.nodes)
    assert torch.equal(ev.run(nodes[0], small, nodes[-2]), torch.arange(8.0).view(4, 2).t())
    gm = torch.fx.symbolic_trace(writes)
    ev = _Evaluator(gm, lambda gm, node: None)
    nodes = list(gm.graph.nodes)
    assert ev.run(nodes[0], ev.numbered((8,), torch.device("cpu")), nodes[-2]) is None
    assert torch.equal(ev.numbered((8,), torch.device("cpu")), torch.arange(8, dtype=torch.float64))   # made anew


def _qk_norm(q, w, eps: float = 1e-6, power: float = 2.0, dim: int = -1):
    """A per-head RMSNorm of q ``[batch, seq, heads, dim]`` (HF Qwen3's q_norm), with knobs."""
    variance = q.pow(power).mean(dim, keepdim=True)
    return w * (q * torch.rsqrt(variance + eps) if eps else q * torch.rsqrt(variance))


@pytest.mark.parametrize("knobs,per_position", [
    ({}, True),
    # Each refusal is an inf a re-padded position's zeros would make (then NaN in attention), or a
    # reduction over more than one position's own features.
    ({"eps": 0.0}, False), ({"power": -1.0}, False), ({"dim": 1}, False)])
def test_per_position_ops_take_an_rms_norm_only_in_its_safe_form(knobs, per_position):
    from fxtrain.passes.varlen import per_position_op
    q, w = to_device(torch.randn(2, 5, 3, 4)), to_device(torch.randn(4))
    gm = _traced(lambda q, w: _qk_norm(q, w, **knobs), {"q": q, "w": w})
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    norm_ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    inside = set()
    for node in norm_ops:   # every op computed from q is inside, as the padded rows' descendants are
        if any(a is placeholder or a in inside for a in node.all_input_nodes):
            inside.add(node)
    inside_of = lambda a: a is placeholder or a in inside   # noqa: E731
    verdicts = [per_position_op(n, inside_of) for n in norm_ops if n in inside]
    assert all(verdicts) is per_position, [(n.name, v) for n, v in zip(norm_ops, verdicts)]


@pytest.mark.cpu_only(reason="reads masks built on the host; no model runs")
def test_additive_masks_hide_keys_only_at_their_lowest_value():
    """A float mask hides a key where it is ``-inf`` or its dtype's lowest value (``exp`` is then
    exactly 0: transformers' eager masks); a finite bias such as ``-1e4`` or ``-0.5`` leaves the key
    a weight, so it neither hides padding nor makes the mask causal for the per-sequence kernel."""
    from fxtrain.passes.padding_elimination import _masks_padding_keys
    from fxtrain.passes.varlen import mask_kind
    tokens = torch.tensor([[True, True, True, False]])
    low = torch.finfo(torch.float32).min
    causal = torch.ones(4, 4).tril().bool()

    def additive(hidden_value, bias_at=None):
        m = torch.zeros(1, 1, 4, 4)
        m[..., ~(causal & tokens[0][None, :])] = hidden_value
        if bias_at is not None:
            m[(0, 0) + bias_at] = -0.5
        return m

    for hidden in (float("-inf"), low):
        assert _masks_padding_keys(additive(hidden), tokens)
        assert mask_kind(additive(hidden), tokens) is True
        assert mask_kind(additive(hidden, bias_at=(0, 1)), tokens) is None   # a future key, biased not hidden
    assert not _masks_padding_keys(additive(-1e4), tokens)
    assert mask_kind(causal[None, None] & tokens[:, None, None, :], tokens) is True
