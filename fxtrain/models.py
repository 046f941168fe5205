"""Built-in models (transformers configs, random weights, nothing downloaded) and synthetic batches.

The demo, the benchmarks, the profiler CLI and the tests all draw from here so that a number quoted
in the docs can be reproduced by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .extras import require


def _no_dropout(cfg: Any) -> Any:
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "dropout_rate", "attention_dropout", "dropout", "classifier_dropout"):
        if hasattr(cfg, name):
            setattr(cfg, name, 0.0)
    return cfg


def bert_mlm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 30522,
             intermediate: Optional[int] = None, max_positions: int = 512) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate or 4 * hidden, max_position_embeddings=max_positions,
                     pad_token_id=0)
    return BertForMaskedLM(_no_dropout(cfg))


def roberta_mlm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 30522) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import RobertaConfig, RobertaForMaskedLM
    cfg = RobertaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=514, pad_token_id=1)
    return RobertaForMaskedLM(_no_dropout(cfg))


def distilbert_mlm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 30522) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    cfg = DistilBertConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=4 * hidden,
                           pad_token_id=0)
    return DistilBertForMaskedLM(_no_dropout(cfg))


def electra_mlm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 30522) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import ElectraConfig, ElectraForMaskedLM
    cfg = ElectraConfig(vocab_size=vocab, embedding_size=hidden // 2, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden, pad_token_id=0)
    return ElectraForMaskedLM(_no_dropout(cfg))


def roberta_cls(hidden: int = 64, layers: int = 2, heads: int = 2, vocab: int = 1000, labels: int = 3) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import RobertaConfig, RobertaForSequenceClassification
    cfg = RobertaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=514, pad_token_id=1,
                        num_labels=labels, problem_type="single_label_classification")
    # problem_type set up front: left None, the model writes it on its first call, and that change
    # of its own config makes any capture (ours or torch.compile's) recapture once.
    return RobertaForSequenceClassification(_no_dropout(cfg))


def gpt2_lm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 50257, positions: int = 1024) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions)
    return GPT2LMHeadModel(_no_dropout(cfg))


def t5(d_model: int = 64, layers: int = 2, heads: int = 2, vocab: int = 1000) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=4 * d_model, num_layers=layers,
                   num_heads=heads, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(_no_dropout(cfg))


def llama_lm(hidden: int = 256, layers: int = 4, heads: int = 4, vocab: int = 32000,
             kv_heads: Optional[int] = None, positions: int = 2048) -> nn.Module:
    """``kv_heads`` below ``heads``: grouped-query attention (each key/value head serves several)."""
    require("transformers", "fxtrain's built-in models")
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                      max_position_embeddings=positions, pad_token_id=0)
    return LlamaForCausalLM(_no_dropout(cfg))


def swin_cls(image: int = 32, labels: int = 5) -> nn.Module:
    """Tiny HF Swin (patch 2, embed 16, depths [1, 1], heads [2, 2], window 4): its window partition
    divides symbolic image sizes, the case that made a symbolic recapture stall (issue #31)."""
    require("transformers", "fxtrain's built-in models")
    from transformers import SwinConfig, SwinForImageClassification
    cfg = SwinConfig(image_size=image, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                     window_size=4, num_labels=labels, drop_path_rate=0.0)
    return SwinForImageClassification(_no_dropout(cfg))


def convnext_cls(image: int = 32, labels: int = 5) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(image_size=image, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                         num_labels=labels, drop_path_rate=0.0)
    return ConvNextForImageClassification(cfg)


def vit_cls(image: int = 32, labels: int = 5) -> nn.Module:
    """Call with ``interpolate_pos_encoding=True`` to feed other image sizes."""
    require("transformers", "fxtrain's built-in models")
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=image, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=labels)
    return ViTForImageClassification(_no_dropout(cfg))


def resnet_cls(labels: int = 5) -> nn.Module:
    require("transformers", "fxtrain's built-in models")
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=labels)
    return ResNetForImageClassification(cfg)


def image_batch(batch: int, image: int, labels: int = 5, generator: Optional[torch.Generator] = None,
                **extra: Any) -> Dict[str, Any]:
    """Random RGB images and class labels, as HF image classifiers take them."""
    return dict(pixel_values=torch.randn(batch, 3, image, image, generator=generator),
                labels=torch.randint(0, labels, (batch,), generator=generator), **extra)


@dataclass
class Preset:
    """A named model with the batch kind it trains on ("mlm", "clm" or "cls")."""

    build: Callable[[], nn.Module]
    kind: str
    vocab: int
    pad_id: int
    about: str


PRESETS: Dict[str, Preset] = {
    "bert-mlm": Preset(bert_mlm, "mlm", 30522, 0, "BERT-MLM of DESIGN §7: hidden 256, 4 layers, vocab 30522"),
    "bert-mlm-1024": Preset(lambda: bert_mlm(max_positions=1024), "mlm", 30522, 0,
                            "long-row BERT-MLM of DESIGN §7: the bert-mlm model with 1024 positions "
                            "(benched at 4 x 1024, 60% padding, 15% labels)"),
    "bert-base": Preset(lambda: bert_mlm(hidden=768, layers=12, heads=12), "mlm", 30522, 0,
                        "BERT-base dimensions: hidden 768, 12 layers, 12 heads"),
    "bert-tiny": Preset(lambda: bert_mlm(hidden=64, layers=2, heads=2, vocab=1000), "mlm", 1000, 0,
                        "tiny BERT-MLM for tests: hidden 64, 2 layers, vocab 1000"),
    "roberta-mlm": Preset(roberta_mlm, "mlm", 30522, 1, "RoBERTa-MLM: hidden 256, 4 layers"),
    "roberta-base": Preset(lambda: roberta_mlm(hidden=768, layers=12, heads=12, vocab=50265), "mlm", 50265, 1,
                           "RoBERTa-base dimensions"),
    "distilbert-mlm": Preset(distilbert_mlm, "mlm", 30522, 0, "DistilBERT-MLM: hidden 256, 4 layers"),
    "distilbert-320": Preset(lambda: distilbert_mlm(hidden=320, layers=3, heads=5), "mlm", 30522, 0,
                             "DistilBERT-MLM of DESIGN §7: dim 320, 3 layers, 5 heads of 64, vocab 30522"),
    "electra-mlm": Preset(electra_mlm, "mlm", 30522, 0, "ELECTRA generator MLM: hidden 256, 4 layers"),
    "gpt2": Preset(gpt2_lm, "clm", 50257, 0, "GPT-2 LM: hidden 256, 4 layers, vocab 50257"),
    "gpt2-small": Preset(lambda: gpt2_lm(hidden=768, layers=12, heads=12), "clm", 50257, 0,
                         "GPT-2 small dimensions (124M)"),
    "gpt2-tiny": Preset(lambda: gpt2_lm(hidden=64, layers=2, heads=2, vocab=1000, positions=256), "clm", 1000, 0,
                        "tiny GPT-2 for tests"),
    "llama-small": Preset(llama_lm, "clm", 32000, 0, "Llama-style LM: hidden 256, 4 layers, vocab 32000"),
    "llama-1024": Preset(lambda: llama_lm(hidden=1024, layers=8, heads=16, vocab=32000, positions=4096), "clm", 32000, 0,
                         "Llama-style LM of GPU size: hidden 1024, 8 layers, 16 heads, vocab 32000, 4096 positions"),
    "llama-tiny": Preset(lambda: llama_lm(hidden=64, layers=2, heads=2, vocab=1000), "clm", 1000, 0,
                         "tiny Llama-style LM for tests"),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """Build a preset with random weights drawn from ``seed``."""
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; built-in models: {', '.join(sorted(PRESETS))}")
    torch.manual_seed(seed)
    return PRESETS[name].build()


def synthetic_batch(kind: str, batch: int, seq: int, vocab: int, *, padding: float = 0.0,
                    label_density: float = 1.0, pad_id: int = 0, padding_side: str = "right",
                    labels_at_end: Optional[float] = None, num_labels: int = 3,
                    generator: Optional[torch.Generator] = None,
                    device: Optional[torch.device] = None) -> Dict[str, torch.Tensor]:
    """A padded batch with the requested padding fraction and label density.

    ``padding`` is the fraction of all positions that are padding (row lengths vary around it, every
    row keeps at least one token). For "mlm", ``label_density`` is the fraction of *all* positions
    with a label (chosen among real tokens); for "clm" labels are the input ids with padding and,
    if ``labels_at_end`` is set, all but the last that fraction of each row's tokens ignored.
    """
    g = generator or torch.Generator().manual_seed(0)
    real = max(1.0, (1.0 - padding) * seq)
    spread = min(real - 1.0, seq - real, real * 0.5)
    # Drawn on the CPU (the generator's device, and the same numbers on every device), then moved.
    cpu = torch.device("cpu")
    lengths = (real + (torch.rand(batch, generator=g, device=cpu) * 2 - 1) * spread).round().clamp(1, seq).long()
    pos = torch.arange(seq, device=cpu).expand(batch, seq)
    if padding_side == "right":
        mask = pos < lengths[:, None]
    elif padding_side == "left":
        mask = pos >= (seq - lengths)[:, None]
    else:
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    low = 0 if pad_id != 0 else 1
    ids = torch.randint(low, vocab, (batch, seq), generator=g, device=cpu)
    ids = torch.where(ids == pad_id, (pad_id + 1) % vocab, ids)
    ids = torch.where(mask, ids, torch.full_like(ids, pad_id))
    out: Dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask.long()}
    if kind == "mlm":
        want = int(round(label_density * batch * seq))
        scores = torch.rand(batch, seq, generator=g, device=cpu).masked_fill(~mask, 2.0)
        chosen = scores.flatten().argsort()[:min(want, int(mask.sum()))]
        labels = torch.full((batch * seq,), -100, dtype=torch.long, device=cpu)
        labels[chosen] = ids.flatten()[chosen]
        out["labels"] = labels.view(batch, seq)
    elif kind == "clm":
        labels = ids.masked_fill(~mask, -100)
        if labels_at_end is not None:
            keep = (lengths.float() * labels_at_end).ceil().long().clamp(min=1)
            if padding_side == "right":
                start = lengths - keep
                labels = labels.masked_fill(pos < start[:, None], -100)
            else:
                labels = labels.masked_fill(pos < (seq - keep)[:, None], -100)
        out["labels"] = labels
    elif kind == "cls":
        out["labels"] = torch.randint(0, num_labels, (batch,), generator=g, device=cpu)
    else:
        raise ValueError(f"unknown batch kind {kind!r}")
    if device is not None:  # where the model trains ("cuda", ...): the batch is built on the CPU
        out = {k: v.to(device) for k, v in out.items()}
    return out


def packed_batch(batch: int, seq: int, vocab: int, *, documents: Tuple[int, int] = (32, 512), pad_id: int = 0,
                 generator: Optional[torch.Generator] = None,
                 device: Optional[torch.device] = None) -> Dict[str, Any]:
    """A packed causal-LM batch, as HF's ``DataCollatorWithFlattening`` makes one per row: each row
    of ``seq`` tokens holds documents of random lengths in ``documents`` (the last one cut to fill
    the row), ``position_ids`` restart at 0 with each document, ``labels`` are the ids with -100 on
    each document's first token, no ``attention_mask``; ``use_cache=False`` so that HF builds the
    document mask."""
    g = generator or torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    lo, hi = documents
    positions = torch.empty(batch, seq, dtype=torch.long)
    for r in range(batch):
        at = 0
        while at < seq:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), seq - at)
            positions[r, at:at + n] = torch.arange(n)
            at += n
    low = 0 if pad_id != 0 else 1
    ids = torch.randint(low, vocab, (batch, seq), generator=g, device=cpu)
    ids = torch.where(ids == pad_id, (pad_id + 1) % vocab, ids)
    out: Dict[str, Any] = {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100),
                           "position_ids": positions, "use_cache": False}
    if device is not None:
        out = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out


def preset_batch(name: str, batch: int, seq: int, **kwargs: Any) -> Dict[str, torch.Tensor]:
    p = PRESETS[name]
    return synthetic_batch(p.kind, batch, seq, p.vocab, pad_id=p.pad_id, **kwargs)
