"""HF Trainer with its default arguments, and the other places users put a model, against eager.

The oracle is the same loop with the bare model: HF ``Trainer`` (column pruning on, as by default),
``accelerate.Accelerator.prepare``, ``peft.get_peft_model``. Tiny models (hidden 32, 1 layer, rows of
at most 16 tokens of the built-in corpus) keep each test to seconds; one intra-op thread per worker
makes eager and fxtrain runs reduce in the same order, so logged losses agree to float rounding.
"""
import copy
import inspect
import pickle
import pydoc

import pytest
import torch
import torch.nn.functional as F

import fxtrain
from fxtrain import corpus, models
from utils import current_device, to_device


@pytest.fixture(scope="module")
def text():
    """Paragraphs of at least 16 words: truncated to 16 tokens, every batch has one shape, so each
    mode captures once (a size change would capture again: seconds each, and tested elsewhere)."""
    paras = corpus.paragraphs()
    return [p for p in paras if len(p.split()) >= 16], corpus.tokenizer(paras, 1000)


def _bert(vocab):
    torch.manual_seed(0)
    return to_device(models.bert_mlm(hidden=32, layers=1, heads=2, vocab=vocab, max_positions=32))


def _gpt2(vocab):
    torch.manual_seed(0)
    return to_device(models.gpt2_lm(hidden=32, layers=1, heads=2, vocab=vocab, positions=32))


def _mlm_loss(outputs, labels):
    return F.cross_entropy(outputs.logits.view(-1, outputs.logits.shape[-1]), labels.view(-1))


# ------------------------------------------------------------------------------ the signature
def test_forward_presents_the_wrapped_signature_and_doc():
    from transformers.utils.generic import find_labels
    model = models.bert_mlm(hidden=32, layers=1, heads=2, vocab=100)
    eager = inspect.signature(model.forward)
    tm = fxtrain.TrainModule(model)
    assert inspect.signature(tm.forward) == eager
    assert list(inspect.signature(type(tm).forward).parameters)[1:] == list(eager.parameters)
    assert find_labels(type(tm)) == find_labels(type(model)) == ["labels"]   # how Trainer finds labels
    assert tm.forward.__doc__ == model.forward.__doc__
    assert "labels" in pydoc.render_doc(tm.forward) and "masked language modeling" in pydoc.render_doc(tm.forward)
    assert isinstance(tm, fxtrain.TrainModule) and type(tm).__name__ == "TrainModule[BertForMaskedLM]"

    # ModuleWithLoss: the model's parameters, its targets keyword-only and required.
    mwl = fxtrain.ModuleWithLoss(model, _mlm_loss)
    params = inspect.signature(mwl.forward).parameters
    assert list(params) == [p for p in eager.parameters if p not in ("labels", "kwargs")] + ["labels", "kwargs"]
    assert params["labels"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["labels"].default is inspect.Parameter.empty
    assert mwl.forward.__doc__.startswith("fxtrain.ModuleWithLoss: labels go")
    wrapped = fxtrain.TrainModule(mwl)
    assert inspect.signature(wrapped.forward) == inspect.signature(mwl.forward)
    assert find_labels(type(wrapped)) == ["labels"]

    # Copies and pickles keep it; the two instances of one class share their presenting class.
    assert type(copy.deepcopy(tm)) is type(tm) is type(fxtrain.TrainModule(models.bert_mlm(32, 1, 2, 100)))
    back = pickle.loads(pickle.dumps(fxtrain.ModuleWithLoss(torch.nn.Linear(3, 2), _mlm_loss)))
    assert list(inspect.signature(back.forward).parameters) == ["input", "labels"]
    # A module whose signature is unknown keeps TrainModule's own; calling is unchanged either way.
    lin = fxtrain.TrainModule(to_device(torch.nn.Linear(3, 2)), fxtrain.Options(fallback="raise"))
    assert list(inspect.signature(lin.forward).parameters) == ["input"]
    x = torch.randn(4, 3, device=current_device())
    torch.testing.assert_close(lin(x), lin.module(x))
    torch.testing.assert_close(lin(input=x), lin.module(x))


def test_state_dict_keeps_keys_and_saves_with_safetensors_despite_tied_weights(tmp_path):
    import safetensors.torch
    model = to_device(models.gpt2_lm(hidden=32, layers=1, heads=2, vocab=100, positions=32))
    tm = fxtrain.TrainModule(model)
    ours, eager = tm.state_dict(), model.state_dict()
    assert list(ours) == list(eager)
    for k in eager:
        torch.testing.assert_close(ours[k], eager[k], rtol=0, atol=0)
    # The first of the tied entries still aliases the parameter, as eager's does.
    assert ours["transformer.wte.weight"].data_ptr() == model.transformer.wte.weight.data_ptr()
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(eager, str(tmp_path / "eager.safetensors"))
    safetensors.torch.save_file(ours, str(tmp_path / "tm.safetensors"))   # what HF Trainer does with a wrapper
    fresh = to_device(models.gpt2_lm(hidden=32, layers=1, heads=2, vocab=100, positions=32))
    fresh.load_state_dict(safetensors.torch.load_file(str(tmp_path / "tm.safetensors")), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    torch.testing.assert_close(fresh.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    assert tm.state_dict(keep_vars=True)["lm_head.weight"] is model.lm_head.weight
    # Under a parent (DDP-like), the parent's prefix applies and the wrapped keys follow it.
    parent = torch.nn.ModuleDict({"m": fxtrain.TrainModule(fresh)})
    assert list(parent.state_dict()) == ["m." + k for k in eager]


# ------------------------------------------------------------------------------- HF Trainer
def _trainer_run(out_dir, model, rows, evals, collator, steps=4, resume=None, **overrides):
    """Trainer with its defaults (column pruning on; checkpoints every 2 steps to test resuming), on the
    test device (``use_cpu=True`` would move a GPU run's model back to the CPU)."""
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             max_steps=steps, logging_steps=1, save_steps=2, report_to="none",
                             use_cpu=current_device().type == "cpu", seed=0, disable_tqdm=True, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=evals, data_collator=collator())
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _same_trainer_results(tmp_path, build, rows, evals, collator, resume):
    """Train, evaluate, predict, save (and resume): fxtrain's Trainer against the plain one."""
    import safetensors.torch
    saves = {} if resume else {"save_strategy": "no"}
    ref_model = build()
    ref, ref_losses = _trainer_run(tmp_path / "eager", ref_model, rows, evals, collator, **saves)
    tm = fxtrain.TrainModule(build(), fxtrain.Options(fallback="raise"))
    trainer, losses = _trainer_run(tmp_path / "fx", tm, rows, evals, collator, **saves)
    assert len(losses) == 4 and losses == pytest.approx(ref_losses, abs=1e-4)

    got, want = trainer.evaluate(), ref.evaluate()
    assert "eval_loss" in got and got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-4)
    got, want = trainer.predict(evals), ref.predict(evals)
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], abs=1e-4)
    assert got.label_ids is not None and (got.label_ids == want.label_ids).all()
    torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), atol=1e-4, rtol=1e-4)

    # save_model: the wrapped model's keys, loadable strictly into the bare model.
    trainer.save_model(str(tmp_path / "final"))
    saved = safetensors.torch.load_file(str(tmp_path / "final" / "model.safetensors"))
    assert set(saved) == set(ref_model.state_dict())
    bare = build()
    bare.load_state_dict(saved, strict=True)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(dict(bare.named_parameters())[name], p, atol=1e-4, rtol=1e-4)
    if not resume:
        return tm

    # A new Trainer resumes from fxtrain's checkpoint as the plain one does from its own (weights,
    # optimizer, scheduler and data order all from the checkpoint: the same TrainModule, its weights
    # overwritten, so that no capture is repeated).
    with torch.no_grad():
        for p in tm.parameters():
            p.zero_()
    _, resumed = _trainer_run(tmp_path / "fx", tm, rows, evals, collator, resume=str(tmp_path / "fx" / "checkpoint-2"))
    _, ref_resumed = _trainer_run(tmp_path / "eager", build(), rows, evals, collator,
                                  resume=str(tmp_path / "eager" / "checkpoint-2"))
    assert resumed[:2] == losses[:2] and resumed == pytest.approx(ref_resumed, abs=1e-4)
    return tm


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_trainer_default_arguments_bert_mlm_like_plain_trainer(tmp_path, text):
    """Column pruning on (the ``text`` column is dropped, the model's columns kept), dynamic padding
    and masking by the collator; the eval run reports ``eval_loss`` because Trainer finds labels."""
    from transformers import DataCollatorForLanguageModeling
    paras, tok = text
    rows, evals = corpus.mlm_rows(tok, paras[:32], 16), corpus.mlm_rows(tok, paras[32:40], 16)
    # seed=1, not 0: transformers before 5.23 (5.17 pinned with torch 2.11) tests ``if self.seed`` and
    # takes seed=0 for no seed, drawing masks from the global RNG; the two evaluations below would
    # then mask differently (whichever runs first draws first) on one release only.
    tm = _same_trainer_results(tmp_path, lambda: _bert(len(tok)), rows, evals,
                               lambda: DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=1),
                               resume=False)
    assert tm.capture_info().optimizations["label_sparsity"].startswith("on:")


def test_trainer_default_arguments_gpt2_sft_like_plain_trainer(tmp_path, text):
    from transformers import DataCollatorForSeq2Seq
    paras, tok = text
    rows, evals = corpus.sft_rows(tok, paras[:32], 16), corpus.sft_rows(tok, paras[32:40], 16)
    _same_trainer_results(tmp_path, lambda: _gpt2(len(tok)), rows, evals,
                          lambda: DataCollatorForSeq2Seq(tok, label_pad_token_id=-100), resume=True)


def test_trainer_default_arguments_module_with_loss(tmp_path, text):
    """ModuleWithLoss's signature names the model's inputs and its targets: columns survive pruning."""
    from transformers import DataCollatorForLanguageModeling
    paras, tok = text
    rows = corpus.mlm_rows(tok, paras[:16], 16)
    collator = lambda: DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=0)  # noqa: E731
    _, ref_losses = _trainer_run(tmp_path / "eager", _bert(len(tok)), rows, None, collator, steps=3,
                                 save_strategy="no")
    tm = fxtrain.TrainModule(fxtrain.ModuleWithLoss(_bert(len(tok)), _mlm_loss), fxtrain.Options(fallback="raise"))
    _, losses = _trainer_run(tmp_path / "fx", tm, rows, None, collator, steps=3, save_strategy="no")
    assert losses == pytest.approx(ref_losses, abs=1e-4)


def test_trainer_gradient_checkpointing_like_plain_trainer(tmp_path, text):
    """``TrainingArguments(gradient_checkpointing=True)``: Trainer calls the model's
    ``gradient_checkpointing_enable`` through the TrainModule, and the checkpointed layer trains as the
    plain Trainer's does, recomputed in the backward (tests/test_checkpointing.py covers the rest)."""
    from transformers import DataCollatorForLanguageModeling
    paras, tok = text
    rows = corpus.mlm_rows(tok, paras[:16], 16)
    collator = lambda: DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=1)  # noqa: E731
    ref = _bert(len(tok))
    _, ref_losses = _trainer_run(tmp_path / "eager", ref, rows, None, collator, steps=3, save_strategy="no",
                                 gradient_checkpointing=True)
    tm = fxtrain.TrainModule(_bert(len(tok)), fxtrain.Options(fallback="raise"))
    _, losses = _trainer_run(tmp_path / "fx", tm, rows, None, collator, steps=3, save_strategy="no",
                             gradient_checkpointing=True)
    assert ref.is_gradient_checkpointing and tm.module.is_gradient_checkpointing
    assert len(losses) == 3 and losses == pytest.approx(ref_losses, abs=1e-4)
    assert tm.capture_info().optimizations["checkpointed_regions"].startswith("on: 1 checkpointed region(s)")


def test_first_capture_without_cache_says_once_where_the_cache_would_save_it(monkeypatch, caplog, tmp_path):
    import logging
    import fxtrain.module as module
    monkeypatch.setattr(module, "_cache_hint_logged", False)
    x = torch.randn(4, 3, device=current_device())
    with caplog.at_level(logging.INFO, logger="fxtrain"):
        cached = fxtrain.TrainModule(to_device(torch.nn.Linear(3, 2)), fxtrain.Options(cache_dir=str(tmp_path)))
        cached(x).sum().backward()
        assert not [r for r in caplog.records if "FXTRAIN_CACHE_DIR" in r.getMessage()]   # cache on: no hint
        for _ in range(2):
            fxtrain.TrainModule(to_device(torch.nn.Linear(3, 2)))(x).sum().backward()
    hints = [r for r in caplog.records if "FXTRAIN_CACHE_DIR" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.INFO
    assert "captured Linear in" in hints[0].getMessage() and "docs/caching.md" in hints[0].getMessage()


# ---------------------------------------------------------------- accelerate and peft wrappers
def _clm_batches():
    g = torch.Generator().manual_seed(0)
    return [models.synthetic_batch("clm", 4, 16, 100, padding=0.0, label_density=0.5, generator=g,
                                   device=current_device()) for _ in range(3)]


def _train_steps(model, batches, backward=None, prepare=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    losses = []
    for b in batches:
        loss = model(**b).loss
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_accelerator_prepare_trains_like_eager():
    from accelerate import Accelerator
    batches = _clm_batches()
    acc = Accelerator(cpu=current_device().type == "cpu")   # cpu=True: prepare() moves the model to the CPU
    ref, _ = _train_steps(_gpt2(100), batches, acc.backward, acc.prepare)
    tm = fxtrain.TrainModule(_gpt2(100), fxtrain.Options(fallback="raise"))
    got, prepared = _train_steps(tm, batches, acc.backward, acc.prepare)
    assert got == pytest.approx(ref, abs=1e-5)
    assert acc.unwrap_model(prepared) is tm and tm.capture_info().graphs == 1
    assert inspect.signature(prepared.forward) == inspect.signature(tm.module.forward)
    assert list(acc.get_state_dict(prepared)) == list(tm.module.state_dict())


def test_peft_model_before_and_after_wrapping_trains_like_eager():
    """get_peft_model(model) wrapped, and get_peft_model(TrainModule(model)): peft finds its layers by
    module name and keeps the parameters of those names trainable, so module and parameter names
    of a TrainModule agree (the wrapped module's own)."""
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                task_type="CAUSAL_LM", init_lora_weights=False))
    batches = _clm_batches()
    ref, ref_model = _train_steps(lora(_gpt2(100)), batches)
    inside = fxtrain.TrainModule(lora(_gpt2(100)), fxtrain.Options(fallback="raise"))
    assert list(inspect.signature(inside.forward).parameters)[:4] == ["input_ids", "attention_mask", "inputs_embeds", "labels"]
    got, _ = _train_steps(inside, batches)
    assert got == pytest.approx(ref, abs=1e-5) and inside.capture_info().graphs == 1
    outside = lora(fxtrain.TrainModule(_gpt2(100), fxtrain.Options(fallback="raise")))
    trainable = [n for n, p in outside.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in ref_model.named_parameters() if p.requires_grad] and trainable
    got, _ = _train_steps(outside, batches)
    assert got == pytest.approx(ref, abs=1e-5) and outside.get_base_model().capture_info().graphs == 1
    assert list(outside.state_dict()) == list(ref_model.state_dict())
