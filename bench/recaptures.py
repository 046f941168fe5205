"""Captures per step of a model with graph breaks: fxtrain against torch.compile, eager as the oracle.

    python bench/recaptures.py [fxtrain|aot_eager|inductor|fxtrain-dynamic] [--steps 6]

A tiny HF Longformer (random weights; hidden 32, 2 layers, attention window 4) trains over three
batch shapes in turn. Longformer graph-breaks (`.item()`, and sizes computed with torch.div, which
are constants under static sizes and data under symbolic ones), so where it breaks depends on
whether sizes are symbolic. Prints, per step: new graphs and graph breaks (dynamo's count:
"graph_break" + "unimplemented" counters), then capture_info() for fxtrain.
Loss and every gradient are checked against an eager copy at every step.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch._dynamo.utils import counters

import fxtrain
from fxtrain import models

SHAPES = [(2, 16), (3, 24), (2, 32)]


def longformer() -> torch.nn.Module:
    from transformers import LongformerConfig, LongformerForMaskedLM
    cfg = LongformerConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, attention_window=4, max_position_embeddings=128,
                           pad_token_id=1)
    return LongformerForMaskedLM(models._no_dropout(cfg))


def dynamo_breaks() -> int:
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="fxtrain",
                        choices=["fxtrain", "fxtrain-dynamic", "aot_eager", "inductor"])
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = longformer()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [models.synthetic_batch("mlm", b, s, 1000, padding=0.2, label_density=0.25, pad_id=1, generator=g)
               for b, s in SHAPES]
    if a.mode.startswith("fxtrain"):
        run = fxtrain.TrainModule(model, fxtrain.Options(dynamic=True if a.mode == "fxtrain-dynamic" else None))
    else:
        run = torch.compile(model, backend=a.mode)
    seen = set()
    for step in range(a.steps):
        batch = batches[step % len(batches)]
        graphs, breaks = counters["stats"]["unique_graphs"], dynamo_breaks()
        out, ref_out = run(**batch), ref(**batch)
        out.loss.backward(); ref_out.loss.backward()
        torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-4)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        model.zero_grad(); ref.zero_grad()
        shape = tuple(batch["input_ids"].shape)
        new = counters["stats"]["unique_graphs"] - graphs
        flag = "  <- captured again on a shape already run" if new and shape in seen else ""
        print(f"step {step} {shape}: +{new} graphs, +{dynamo_breaks() - breaks} breaks (dynamo's count){flag}")
        seen.add(shape)
    print(f"total: {counters['stats']['unique_graphs']} graphs, {dynamo_breaks()} breaks (dynamo's count)")
    if a.mode.startswith("fxtrain"):
        print(run.capture_info())


if __name__ == "__main__":
    main()
