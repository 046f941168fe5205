"""A small real-text corpus and a tokenizer trained on it, built offline in well under a second.

The HF ``Trainer`` workloads (``fxtrain bench --trainer``, tests/test_trainer.py) need text whose
lengths vary as real text does, so that dynamic padding, recaptures on new sizes and the sparsity
passes meet what users' data gives them, and nothing may be downloaded. The paragraphs of the
standard library's own documentation are English prose of varied length and ship with every Python.
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Dict, List, Sequence

from .extras import require

# Modules whose docstrings are long prose; the order fixes the corpus for a given Python version.
_SOURCES = ("argparse", "collections", "functools", "itertools", "json", "re", "typing", "inspect", "textwrap",
            "subprocess", "logging", "unittest", "threading", "dataclasses", "pathlib", "string", "csv",
            "datetime", "decimal", "fractions", "heapq", "bisect", "difflib", "pickle", "shutil", "tempfile",
            "zipfile", "tarfile", "socket", "asyncio", "contextlib", "enum", "abc", "copy", "pprint")

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def paragraphs(min_words: int = 4) -> List[str]:
    """Paragraphs of the docstrings of ``_SOURCES`` and their public members, in a fixed order."""
    out: List[str] = []
    for name in _SOURCES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                if len(para.split()) >= min_words:
                    out.append(para)
    return list(dict.fromkeys(out))


def tokenizer(texts: Sequence[str], vocab_size: int = 2000) -> Any:
    """A word-level BERT-style fast tokenizer trained on ``texts`` (``[CLS] ... [SEP]``, ``[MASK]``),
    usable by HF data collators; the vocabulary is the ``vocab_size`` most frequent words."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    require("transformers", "the corpus tokenizer")
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(list(texts), trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS)))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[(s, tok.token_to_id(s)) for s in ("[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def mlm_rows(tok: Any, texts: Sequence[str], max_length: int) -> List[Dict[str, Any]]:
    """One row per text, as a tokenized dataset hands them to a collator (plus the ``text`` column,
    which HF Trainer's column pruning removes)."""
    rows = []
    for text in texts:
        enc = tok(text, truncation=True, max_length=max_length)
        rows.append({"text": text, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return rows


def sft_rows(tok: Any, texts: Sequence[str], max_length: int, prompt_fraction: float = 0.5) -> List[Dict[str, Any]]:
    """Supervised fine-tuning rows: the first ``prompt_fraction`` of each text is the prompt (labels
    -100), the rest the answer the loss is on."""
    rows = []
    for text in texts:
        ids = tok(text, truncation=True, max_length=max_length)["input_ids"]
        cut = max(1, int(len(ids) * prompt_fraction))
        rows.append({"text": text, "input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": [-100] * cut + ids[cut:]})
    return rows

