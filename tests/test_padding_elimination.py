"""Padding elimination against eager: loss, every gradient, the returned logits and the trained
weights equal eager's, with the pass alone and with label sparsity, and the pass really fires."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from fxtrain import models
from fxtrain.capture import pipeline
from fxtrain.cost.launches import ACCELERATOR
from fxtrain.runtime.deferred import DeferredTensor
from utils import current_device, assert_grads_equal, long_params, to_device, train_parity, wrap_pair

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")

SHAPES = [(4, 16), (3, 11), (5, 20)]
STATE_ATOL = 3e-4  # AdamW magnifies rounding noise in zero-true gradients (see test_label_sparsity)
ALONE = dict(label_sparsity="off", upstream_slicing="off")

MODELS = {
    "bert": (lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 0),
    "roberta": (lambda: models.roberta_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 1),
    "distilbert": (lambda: models.distilbert_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 0),
    "electra": (lambda: models.electra_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 0),
    "gpt2": (lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64), "clm", 0),
}


def _batches(kind, pad_id, seed, side="right", padding=0.4, shapes=SHAPES, **kw):
    g = torch.Generator().manual_seed(seed)
    kw.setdefault("label_density", 0.2)
    return [models.synthetic_batch(kind, b, s, 1000, padding=padding, pad_id=pad_id, padding_side=side,
                                   generator=g, device=current_device(), **kw) for b, s in shapes]


def _same_logits(out, ref_out):
    # Padding positions included: the returned logits are recomputed densely when read. After the
    # first AdamW step weights differ by STATE_ATOL-sized noise, hence the looser bound.
    assert isinstance(out.logits, DeferredTensor)
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-4, rtol=1e-4)


def _why(tm, name="padding_elimination"):
    return tm.capture_info().optimizations[name]


def _fired(tm, name="padding_elimination"):
    assert _why(tm, name).startswith("on:"), _why(tm, name)


def test_passes_the_launch_model_turns_off_leave_eagers_training(monkeypatch):
    """On an accelerator the tiny models' passes add more launches than the FLOPs they skip are
    worth (cost/launches.py), so they are off, and the graph as dynamo traced it trains as eager's:
    the first capture partitioned by the worker, the symbolic one at capture (which AOTAutograd
    refused before the copy kept dynamo's input sources). The accelerator's rates are given to the
    test device's graphs; default options."""
    monkeypatch.setattr(pipeline, "rates_for", lambda device_type: ACCELERATOR)
    build, kind, pad = MODELS["bert"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), dynamic=None)
    train_parity(tm, ref, _batches(kind, pad, 1), lambda out, _: out.loss)
    info = tm.capture_info()
    assert info.fallback_reason is None and info.graphs == 2, info.capture_reasons
    for name in ("label_sparsity", "padding_elimination"):
        assert _why(tm, name).startswith("off: on accelerator the step is bound by the host"), _why(tm, name)


@pytest.mark.parametrize("name,side", long_params(
    [(n, s) for n in ("bert", "roberta", "distilbert", "electra") for s in ("right", "left")],
    keep=[("bert", "right"), ("roberta", "left")]))
def test_alone_on_mlm_matches_eager(name, side):
    build, kind, pad = MODELS[name]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), **ALONE)
    train_parity(tm, ref, _batches(kind, pad, 1, side), lambda out, _: out.loss,
                 compare_outputs=_same_logits, state_atol=STATE_ATOL)
    _fired(tm)
    assert "matmul" in _why(tm) and tm.capture_info().graphs == 1
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


def test_alone_on_causal_lm_matches_eager():
    """GPT-2, right padding: the shifted-label loss runs on real rows; logits and the returned
    key/value cache are deferred and equal eager's when read."""
    build, kind, pad = MODELS["gpt2"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), **ALONE)

    def compare(out, ref_out):
        _same_logits(out, ref_out)
        k, rk = out.past_key_values.layers[0].keys, ref_out.past_key_values.layers[0].keys
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-4)

    train_parity(tm, ref, _batches(kind, pad, 2), lambda out, _: out.loss, compare_outputs=compare,
                 state_atol=STATE_ATOL)
    _fired(tm)
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)  # causal


def _hf_causal_lm(family, **extra):
    import transformers
    if family == "Gemma4":
        extra.update(vocab_size_per_layer_input=1000, hidden_size_per_layer_input=16)
    config = getattr(transformers, {"Gemma4": "Gemma4TextConfig"}.get(family, f"{family}Config"))(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0,
        **extra)
    return getattr(transformers, f"{family}ForCausalLM")(config)


# Mistral: its sliding-window cache trims keys and values to the window, a whole-tensor slice on a
# sequence shorter than the window (padding_elimination._whole_slice). Qwen3: a per-head RMSNorm of
# q and k (varlen.per_position_op) before the head transpose (varlen._chain_above). Phi-3: q, k and
# v sliced out of one projection's features, the MLP's gate and up halves chunked out of another
# (rows.features_split). Before, the pass was off for all three ("padding rows reach view",
# "... getitem").
@pytest.mark.parametrize("family", ["Mistral", "Qwen3", "Phi3"])
def test_hf_causal_lms_whose_attention_inputs_pass_through_more_than_layout_ops(family):
    torch.manual_seed(0)
    tm, ref = wrap_pair(_hf_causal_lm(family))

    def compare(out, ref_out):
        _same_logits(out, ref_out)
        for mine, eager in zip(out.past_key_values.layers, ref_out.past_key_values.layers):
            torch.testing.assert_close(mine.keys, eager.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values, eager.values, atol=1e-4, rtol=1e-4)

    train_parity(tm, ref, _batches("clm", 0, 2), lambda out, _: out.loss, compare_outputs=compare,
                 state_atol=STATE_ATOL)
    _fired(tm)
    assert f"{8 if family == 'Phi3' else 14} matmul(s) on real tokens only" in _why(tm), _why(tm)
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


def test_a_sliding_window_cache_trimmed_below_the_sequence_is_returned_not_attended():
    """Mistral with a window of 8 on sequences of 11 to 20: its cache keeps the last 7 positions of
    keys and values (a slice along the sequence), returned and never attended in the step, so it is
    computed on first read like any returned tensor that holds padding. Before, the pass was off
    there ("padding rows reach transpose (key_states)"): gpt-oss's window is 128 tokens."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_hf_causal_lm("Mistral", sliding_window=8))

    def same_cache(out, ref_out):
        for mine, eager in zip(out.past_key_values.layers, ref_out.past_key_values.layers):
            assert mine.keys.shape[2] == 7
            torch.testing.assert_close(mine.keys, eager.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values, eager.values, atol=1e-4, rtol=1e-4)
    _train_from_eager_weights(tm, ref, _batches("clm", 0, 2, shapes=[(4, 16), (3, 12), (5, 20)]), compare=same_cache)
    _fired(tm)
    assert "14 matmul(s) on real tokens only" in _why(tm), _why(tm)


# Gemma 4 (text): per-layer inputs, one embedding viewed as [batch, seq, layers, dim] and indexed
# per layer; q/k norms and the rotary embedding's rotate_half (a cat of feature slices) before the
# heads' transpose, so the padded region reaches [tokens, heads, dim] rows (varlen: rows of more
# than one feature dim); ``hidden_states *= layer_scalar`` in place. Nemotron: squared ReLU.
# Apertus: xIELU (gt, where, expm1, torch.min of two tensors, softplus). GLM-4: an interleaved
# rotary embedding (``x[..., ::2]``, ``stack(..., dim=-1).flatten(-2)``). Before, the pass was off
# for all four ("padding rows reach reshape", "... square", "... gt", "... view").
@pytest.mark.parametrize("family", ["Gemma4", "Nemotron", "Apertus", "Glm4"])
def test_hf_causal_lms_with_feature_views_interleaved_rotary_and_other_activations(family):
    torch.manual_seed(0)
    tm, ref = wrap_pair(_hf_causal_lm(family))
    # Each step from eager's weights: on Gemma 4, AdamW moves two copies' weights apart by rounding
    # noise (STATE_ATOL), after which its gradients differed by up to 1.5e-4 (embeddings, third step).
    # From equal weights every gradient is within 1e-5 + 1e-4 of eager's, and as close to a float64
    # eager's as eager's own (bench/hf_families.py's oracle).
    _train_from_eager_weights(tm, ref, _batches("clm", 0, 2))
    _fired(tm)
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


@pytest.mark.parametrize("family", ["Qwen3", "Mixtral"])
def test_rotary_models_under_bf16_autocast_run_attention_on_real_tokens(family):
    """Under bf16 autocast a Llama-style rotary embedding leaves q and k in float32 (its cos and sin
    are) beside a bf16 v: eager's SDPA casts all three to bf16, as autocast does for it, and so must
    attention on real tokens (``varlen.as_sdpa_sees_them``). Before, the CPU kernel refused
    the mix and the capture fell back to eager ("expected scalar type Float but found BFloat16")."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_hf_causal_lm(family) if family == "Qwen3" else _hf_moe(family), fallback="raise")
    for batch in _batches("clm", 0, 2):
        with torch.autocast(current_device().type, dtype=torch.bfloat16):
            out, ref_out = tm(**batch), ref(**batch)
        torch.testing.assert_close(out.loss, ref_out.loss, atol=2e-2, rtol=2e-2)
        out.loss.backward(); ref_out.loss.backward()
        assert_grads_equal(tm.module, ref, atol=2e-2, rtol=2e-2)
        tm.zero_grad(); ref.zero_grad()
    if family == "Mixtral" and not _traceable_experts():
        return   # transformers 5.17: every MoE layer a graph break (see below)
    _fired(tm)
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


def _hf_moe(family):
    experts = dict(num_local_experts=4) if family == "Mixtral" else dict(num_experts=4, moe_intermediate_size=32)
    if family == "Qwen2Moe":
        experts.update(shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    return _hf_causal_lm(family, num_experts_per_tok=2, **experts)


def _train_from_eager_weights(tm, ref, batches, logits=True, compare=None):
    """Loss, logits (and what ``compare(out, eager_out)`` checks) and gradients equal eager's at
    every step, each step from eager's weights (so that AdamW cannot turn rounding noise into
    weight differences: see the Gemma 4 test)."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for batch in batches:
        out, ref_out = tm(**batch), ref(**batch)
        torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-4)
        if logits:
            _same_logits(out, ref_out)
        else:
            torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-4, rtol=1e-4)
        if compare is not None:
            compare(out, ref_out)
        out.loss.backward(); ref_out.loss.backward()
        assert_grads_equal(tm.module, ref)
        opt.step(); opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(tm.module.parameters(), ref.parameters()):
                p.copy_(q)
                p.grad = None


def _moved_by_padding_ids(model, batch):
    """How far other ids at the padding positions move the real tokens' logits: 0 where the model
    does not read its padding, as padding elimination assumes."""
    other = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        return (model(**batch).logits[real] - model(**other).logits[real]).abs().max().item()


# Mixtures of experts (transformers' grouped experts: sort the (token, slot) pairs by expert, one
# grouped matmul per projection, back in pair order, sum the slots): the block is one row op
# (passes/expert_blocks.py), and the router's top-k and Mixtral's in-place ``w /= w.sum()`` are
# row ops. Before, the pass was off ("padding rows reach getitem (selected_hidden_states_g)"),
# and eager's padding tokens went through two experts each.
def _traceable_experts():
    """Whether transformers' grouped experts can be traced for training. Before transformers 5.2x
    (5.17 is the GPU image's, tested with torch 2.11) the backward of its CPU grouped matmul loops
    over ``offs.tolist()`` in Python: dynamo breaks the graph at every MoE layer, under plain
    ``torch.compile`` too (GuardOnDataDependentSymNode), and no pass sees a whole layer."""
    from transformers.integrations import moe   # noqa: F401  (registers the ops)
    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")


@pytest.mark.parametrize("family", ["Mixtral", "Qwen3Moe", "Qwen2Moe"])
def test_hf_mixtures_of_experts_route_only_real_tokens(family):
    tm, ref = wrap_pair(_hf_moe(family))
    if not _traceable_experts():   # what fxtrain does there: eager's numbers, across the breaks
        _train_from_eager_weights(tm, ref, _batches("clm", 0, 2), logits=False)
        assert tm.capture_info().graph_breaks > 0 and not _why(tm).startswith("on"), tm.capture_info()
        return
    _train_from_eager_weights(tm, ref, _batches("clm", 0, 2))
    _fired(tm)
    # Per layer q/k/v/o and the router, two grouped matmuls; Qwen2-MoE's shared expert and its gate: 4 more.
    assert f"{2 * (7 + 4 * (family == 'Qwen2Moe'))} matmul(s) on real tokens only" in _why(tm), _why(tm)
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


class _CappedExperts(nn.Module):
    """transformers' grouped experts written out, where each expert takes at most ``capacity`` of the
    sorted pairs (``None``: all of them) and the pairs beyond add nothing (Switch Transformers' expert
    capacity). Which pairs fit then depends on every token's routing, padding tokens' included, so
    the block is no row op."""

    def __init__(self, experts, capacity):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.capacity = experts.gate_up_proj, experts.down_proj, capacity

    def forward(self, hidden, top_k_index, top_k_weights):
        from transformers.integrations import moe   # noqa: F401  (registers its grouped matmul for the CPU)
        grouped_mm = torch.ops.transformers.grouped_mm_fallback
        k, n_experts = top_k_index.size(-1), self.gate_up_proj.size(0)
        ids, perm = torch.sort(top_k_index.reshape(-1))
        x = hidden[perm // k]
        weights = top_k_weights.reshape(-1)[perm]
        counts = torch.histc(ids.float(), bins=n_experts, min=0, max=n_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        if self.capacity is not None:
            first = (offs - counts.int())[ids]   # each sorted pair's place among its expert's
            weights = weights * (torch.arange(ids.size(0), device=ids.device) - first < self.capacity)
        gate, up = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs) * weights.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=perm.device)
        return y[inv].view(hidden.size(0), k, hidden.size(-1)).sum(dim=1)


@pytest.mark.parametrize("capacity", [None, 6], ids=["every-pair", "capacity"])
def test_experts_whose_pairs_depend_on_other_tokens_keep_the_padding(capacity):
    """The expert block is a row op only in the forms passes/expert_blocks.py proves: the same block
    with an expert capacity (an index into the offsets by each pair's expert) keeps every token,
    and trains as eager does; without it the pass fires, as on transformers' own experts."""
    model = _hf_moe("Qwen3Moe")
    for layer in model.model.layers:
        layer.mlp.experts = _CappedExperts(layer.mlp.experts, capacity)
    tm, ref = wrap_pair(model)
    batches = _batches("clm", 0, 2)
    moved = _moved_by_padding_ids(ref, batches[0])   # the capacity binds
    assert (moved > 1e-3) == (capacity is not None), moved
    _train_from_eager_weights(tm, ref, batches, logits=_traceable_experts())
    if not _traceable_experts():
        assert tm.capture_info().graph_breaks > 0 and not _why(tm).startswith("on"), tm.capture_info()
    elif capacity is None:
        _fired(tm)
        assert "14 matmul(s) on real tokens only" in _why(tm), _why(tm)
    else:
        assert _why(tm).startswith("off: padding rows reach "), _why(tm)


def test_gpt_neox_attention_from_its_per_head_fused_projection_runs_sequence_by_sequence():
    """GPT-NeoX (Pythia) views its fused q/k/v projection as ``[batch, seq, heads, 3 * dim]`` and
    chunks the last dim, so head ``h``'s query is features ``3 * dim * h ..`` of each token, not a
    contiguous block of q's: the varlen rewrite takes heads ``3 * dim`` features apart (its partial
    rotary embedding between). Before, attention stayed re-padded ("its query does not split each
    token's features into heads")."""
    torch.manual_seed(0)
    model = _hf_causal_lm("GPTNeoX", rotary_pct=0.5, hidden_dropout=0.0)
    tm, ref = wrap_pair(model)
    _train_from_eager_weights(tm, ref, _batches("clm", 0, 2))
    _fired(tm)
    assert "sequence by sequence: 2 of 2" in _why(tm) and "re-padded" not in _why(tm), _why(tm)


# Attention written out in eager ops (transformers' eager_attention_forward): Gemma 2, whose logit
# softcapping transformers runs in eager ops only, gpt-oss (a sink logit per head as an extra softmax
# column; its experts add their biases in place and split gate and up as ``x[..., ::2]``), a Llama
# set to attn_implementation="eager", and GPT-J, which transformers runs in eager ops only (its q
# and k cast to float32 for the scores, its rotary embedding on part of each head before the heads'
# permute). Every projection runs on the real tokens. A plain block (Llama's, GPT-J's: scores
# scaled, masked, softmaxed) is the SDPA it computes and runs sequence by sequence as one; a capped
# or sink one keeps the padded layout, q, k and v re-padded around it. Before, the pass was off
# ("padding rows reach transpose"; gpt-oss: "no attention mask ... marks the padding"), then the
# plain blocks stayed re-padded too.
@pytest.mark.parametrize("family", ["Gemma2", "GptOss", "Llama", "GPTJ"])
def test_hf_attention_in_eager_ops_runs_on_real_tokens_as_the_sdpa_it_computes_or_keeps_the_padded_layout(family):
    torch.manual_seed(0)
    if family == "GPTJ":
        import transformers
        model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
            vocab_size=1000, n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=64, pad_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = _hf_causal_lm(family, **(dict(num_local_experts=4, num_experts_per_tok=2) if family == "GptOss" else {}))
    model.config._attn_implementation = "eager"
    tm, ref = wrap_pair(model)
    if family == "GptOss" and not _traceable_experts():   # transformers 5.17: its MoE layers break the graph
        _train_from_eager_weights(tm, ref, _batches("clm", 0, 2), logits=False)
        assert not _why(tm).startswith("on"), _why(tm)
        return
    _train_from_eager_weights(tm, ref, _batches("clm", 0, 2))
    _fired(tm)
    # Per layer q, k, v, o and three more: the MLP's projections, or gpt-oss's router and two grouped
    # matmuls. GPT-J's MLP has two, and its last layer's output projection and MLP (parallel to
    # attention) run on the labelled rows only (upstream slicing): 2 x 6 - 3.
    assert f"{9 if family == 'GPTJ' else 14} matmul(s) on real tokens only" in _why(tm), _why(tm)
    if family in ("Llama", "GPTJ"):
        assert "sequence by sequence: 2 of 2" in _why(tm) and "re-padded" not in _why(tm), _why(tm)
    else:
        why_not = "its scores pass through tanh" if family == "Gemma2" else "its softmax has a sink column"
        assert "sequence by sequence: 0 of 2 (re-padded: attn_output: attention in eager ops" in _why(tm), _why(tm)
        assert why_not in _why(tm), _why(tm)


def test_gptj_in_bfloat16_gets_its_float32_queries_and_keys_cast_as_its_values_for_attention_on_real_tokens():
    """GPT-J casts q and k to float32 for its scores; in a bfloat16 model (no autocast) v and the
    output stay bfloat16. Attention on real tokens takes all three in v's dtype, the dtype eager's
    output has (``varlen.as_sdpa_sees_them``); the kernels take no mix."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=1000, n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=64, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(torch.bfloat16)
    tm, ref = wrap_pair(model, fallback="raise")
    for batch in _batches("clm", 0, 2):
        out, ref_out = tm(**batch), ref(**batch)
        assert out.logits.dtype == ref_out.logits.dtype == torch.bfloat16
        torch.testing.assert_close(out.loss, ref_out.loss, atol=2e-2, rtol=2e-2)
        out.loss.backward(); ref_out.loss.backward()
        assert_grads_equal(tm.module, ref, atol=2e-2, rtol=2e-2)
        tm.zero_grad(); ref.zero_grad()
    _fired(tm)
    assert "sequence by sequence: 2 of 2" in _why(tm), _why(tm)


def _softcapped_attention(cap_after_mask):
    """Gemma 2's eager attention written out, with its softcap before the mask (as Gemma 2) or after
    it: then a padding key's score is capped to ``-1`` instead of staying at the mask's lowest
    value, and it gets a weight (a cap of 1: Gemma 2's 50 would give it ``exp(-50)``, too little to
    see in float32)."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, kv, s, d = key.shape
        rep = query.shape[1] // kv
        key = key[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)
        value = value[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if not cap_after_mask:
            scores = torch.tanh(scores)
        scores = scores + attention_mask
        if cap_after_mask:
            scores = torch.tanh(scores)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights
    return attention


@pytest.mark.parametrize("cap_after_mask", [False, True], ids=["cap-then-mask", "mask-then-cap"])
def test_attention_in_eager_ops_that_gives_padding_keys_weight_keeps_the_padding(cap_after_mask):
    """passes/eager_attention.py accepts only a mask added last before the softmax: the same block
    with the cap after the mask (registered through transformers' attention interface, in a BERT
    MLM, whose real tokens would see padding keys but for the mask) reads the padding tokens, keeps
    the pass off and trains as eager; with the cap first the pass fires."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    name = f"fxtrain_test_softcap_{'after' if cap_after_mask else 'before'}_mask"
    transformers.AttentionInterface.register(name, _softcapped_attention(cap_after_mask))
    AttentionMaskInterface.register(name, eager_mask)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model.config._attn_implementation = name
    tm, ref = wrap_pair(model)
    batches = _batches("mlm", 0, 2)
    moved = _moved_by_padding_ids(ref, batches[0])   # mask then cap reads the padding
    assert (moved > 1e-4) == cap_after_mask, moved
    _train_from_eager_weights(tm, ref, batches)
    if cap_after_mask:
        assert _why(tm).startswith("off: padding rows reach "), _why(tm)
    else:
        _fired(tm)
        assert "0 of 2 (re-padded: " in _why(tm) and "attention in eager ops" in _why(tm), _why(tm)


def test_modernbert_mlm_matches_eager_with_its_global_attention_sequence_by_sequence():
    """ModernBERT: q, k and v unbound from one fused projection viewed as [batch, seq, 3, heads,
    dim], a GeGLU MLP chunked out of another, and every second layer's sliding-window attention,
    whose mask is more than padding: that one stays re-padded (exact). Before: off ("padding rows
    reach view")."""
    import transformers
    config = transformers.ModernBertConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, pad_token_id=0, global_attn_every_n_layers=2, local_attention=8)
    torch.manual_seed(0)
    tm, ref = wrap_pair(transformers.ModernBertForMaskedLM(config))
    train_parity(tm, ref, _batches("mlm", 0, 1), lambda out, _: out.loss, compare_outputs=_same_logits,
                 state_atol=STATE_ATOL)
    _fired(tm)
    assert "7 matmul(s) on real tokens only" in _why(tm), _why(tm)
    assert "sequence by sequence: 1 of 2 (re-padded: " in _why(tm), _why(tm)
    assert _why(tm).endswith(": its mask is not padding plus causal order)"), _why(tm)


def test_left_padded_causal_loss_reads_a_padding_position_so_the_pass_stays_off():
    """With left padding, label shifting makes the last padding position predict the first real
    token: eager's loss reads a padding row, so the pass must not fire and the result is eager's."""
    build, kind, pad = MODELS["gpt2"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), **ALONE)
    train_parity(tm, ref, _batches(kind, pad, 3, "left"), lambda out, _: out.loss, state_atol=STATE_ATOL)
    assert _why(tm) == "off: the loss has labels on padding positions"


@pytest.mark.parametrize("name,extra", [("bert", {}), pytest.param("roberta", {}, marks=pytest.mark.extended),
                                        ("gpt2", {"labels_at_end": 0.25})])
def test_together_with_label_sparsity(name, extra):
    build, kind, pad = MODELS[name]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build())
    batches = _batches(kind, pad, 4, **extra) if kind == "clm" else _batches(kind, pad, 4, label_density=0.1)
    train_parity(tm, ref, batches, lambda out, _: out.loss, compare_outputs=_same_logits, state_atol=STATE_ATOL)
    _fired(tm)
    _fired(tm, "label_sparsity")
    # The last layer's attention output is read at the labelled rows only: taken from the packed ones.
    assert "attention on real tokens, sequence by sequence: 2 of 2" in _why(tm), _why(tm)


def test_unread_outputs_cost_nothing():
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(MODELS["bert"][0]()), fxtrain.Options(fallback="raise", **ALONE))
    out = tm(**_batches("mlm", 0, 5)[0])
    out.loss.backward()
    assert isinstance(out.logits, DeferredTensor) and not out.logits.is_materialized
    # Token-wise matmuls of the forward graph run on a run-time row count, not batch x seq.
    fw = tm.capture_info().records[0].forward_graph
    mms = [n for n in fw.graph.nodes if n.op == "call_function" and str(n.target) in ("aten.addmm.default", "aten.mm.default")]
    assert mms and all(str(n.meta["val"].shape[0]).startswith("u") for n in mms)


def test_all_padding_rows_and_a_dense_batch_give_eagers_answer():
    """Capture on a batch with an all-padding row; later a fully dense batch and another
    all-padding row: no crash, no NaN, eager's loss and gradients."""
    build, kind, pad = MODELS["bert"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), **ALONE)
    first, second = _batches(kind, pad, 7, shapes=[(4, 16), (3, 12)])
    for b in (first, second):
        b["input_ids"][1] = pad
        b["attention_mask"][1] = 0
        b["labels"][1] = -100
    dense = _batches(kind, pad, 8, padding=0.0, shapes=[(3, 10)])[0]
    train_parity(tm, ref, [first, dense, second], lambda out, _: out.loss, compare_outputs=_same_logits,
                 state_atol=STATE_ATOL)
    _fired(tm)


def test_batch_without_labels_gives_eagers_nan():
    build, kind, pad = MODELS["bert"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), **ALONE)
    first, second = _batches(kind, pad, 9, shapes=[(4, 16), (3, 12)])
    tm(**first).loss.backward()
    second["labels"].fill_(-100)
    out, ref_out = tm(**second), ref(**second)
    assert torch.isnan(ref_out.loss)
    torch.testing.assert_close(out.loss, ref_out.loss, equal_nan=True)
    _fired(tm)


@pytest.mark.parametrize("mode,expect", [("auto", "off: token density 1.00"), ("on", "on:")])
def test_dense_capturing_batch(mode, expect):
    """No padding: 'auto' leaves the graph alone; 'on' rewrites it and is still exact."""
    build, kind, pad = MODELS["bert"]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), label_sparsity="off", padding_elimination=mode)
    batches = _batches(kind, pad, 10, padding=0.0)
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=STATE_ATOL)
    assert _why(tm).startswith(expect), _why(tm)


def test_a_label_on_a_padding_token_raises_under_the_strict_guard_instead_of_a_wrong_loss():
    """The default sends such a batch down the dense route (tests/test_edge_batches.py)."""
    build, kind, pad = MODELS["bert"]
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(build()), fxtrain.Options(fallback="raise", dynamic=True, sparsity_guard="raise",
                                                      **ALONE))
    first, second = _batches(kind, pad, 11, shapes=[(4, 16), (3, 12)])
    tm(**first).loss.backward()
    row, col = (second["attention_mask"] == 0).nonzero()[0].tolist()
    second["labels"][row, col] = 5
    with pytest.raises(RuntimeError, match="sits on a padding position"):
        tm(**second).loss.item()


def test_off_option():
    tm = fxtrain.TrainModule(to_device(MODELS["bert"][0]()), fxtrain.Options(fallback="raise", padding_elimination="off"))
    tm(**_batches("mlm", 0, 12)[0])
    assert _why(tm) == "off: off by option"


class _PaddingIdxLM(nn.Module):
    """No attention: the embedding's padding_idx is what marks padding."""

    def __init__(self, vocab=100, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden, padding_idx=0)
        self.ffn = nn.Sequential(nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden), nn.LayerNorm(hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        h = h + self.ffn(h)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)), logits


def test_embedding_padding_idx_marks_padding():
    torch.manual_seed(0)
    tm, ref = wrap_pair(_PaddingIdxLM(), **ALONE)
    g = torch.Generator().manual_seed(13)
    batches = []
    for b, s in SHAPES:
        batch = models.synthetic_batch("mlm", b, s, 100, padding=0.5, label_density=0.3, generator=g)
        batches.append({"input_ids": batch["input_ids"], "labels": batch["labels"]})

    def compare(out, ref_out):
        torch.testing.assert_close(out[1], ref_out[1], atol=1e-5, rtol=1e-4)

    train_parity(tm, ref, batches, lambda out, _: out[0], compare_outputs=compare)
    _fired(tm)


def test_gradients_through_the_deferred_logits():
    """The user's own loss also reads the (deferred, dense-recomputed) logits: both paths' grads are eager's."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(MODELS["bert"][0](), **ALONE)
    batch = _batches("mlm", 0, 14)[0]
    out, ref_out = tm(**batch), ref(**batch)
    (out.loss + out.logits.pow(2).mean()).backward()
    (ref_out.loss + ref_out.logits.pow(2).mean()).backward()
    assert_grads_equal(tm.module, ref)
    _fired(tm)


def test_symbolic_recapture_after_a_static_one_keeps_the_pass():
    """The default (dynamic=None): static sizes first, then a symbolic capture where ids and mask
    have sizes of their own; the pass must still find the mask, and stay exact on every shape."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(MODELS["bert"][0](), dynamic=None, **ALONE)
    train_parity(tm, ref, _batches("mlm", 0, 16), lambda out, _: out.loss, state_atol=STATE_ATOL)
    records = tm.capture_info().records
    assert len(records) == 2, [r.optimizations for r in records]
    assert all(r.optimizations["padding_elimination"].startswith("on:") for r in records), [r.optimizations for r in records]


def test_densities_measured_on_every_batch_and_logged(caplog):
    """The inspector keeps watching after capture: the last batch's densities, logged on request."""
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(MODELS["bert"][0]()), fxtrain.Options(fallback="raise", log_density=True))
    first, second = _batches("mlm", 0, 15, shapes=[(4, 16), (3, 12)])
    tm(**first)
    with caplog.at_level("INFO", logger="fxtrain"):
        tm(**second)
    density = tm.capture_info().density
    assert density["token density"] == pytest.approx(float(second["attention_mask"].float().mean()))
    assert density["label density"] == pytest.approx(float((second["labels"] != -100).float().mean()))
    assert any("batch density" in r.getMessage() and "label density" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("padding_elimination", ["on", "off"])
def test_tied_embedding_gradient_accumulated_in_place(padding_elimination):
    """BERT ties the word embedding to the decoder: the backward adds the embedding rows into the
    decoder gradient in place (with padding elimination off, padding ids reach it and padding_idx
    rows must stay out). Gradients equal eager's either way."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(MODELS["bert"][0](), padding_elimination=padding_elimination)
    assert tm.module.get_input_embeddings().weight is tm.module.get_output_embeddings().weight
    train_parity(tm, ref, _batches("mlm", 0, 16, label_density=0.1), lambda out, _: out.loss,
                 state_atol=STATE_ATOL)
    assert _why(tm, "tied_embedding_grad").startswith("on:")
