"""Issue 8's per-step tax table: eager, torch.compile and fxtrain, interleaved in one process.

    PYTHONPATH=<checkout> python bench/overhead.py [--steps 200] [--workloads mlp,gpt2,vit,pythonop]

One thread. Each round runs one step of every contender, in an order that alternates per round;
medians of per-step times after warm-up. Ratios are step time / eager's (MLP) and eager / contender
(GPT-2, ViT), as in the issue; the PythonOp row is the extra cost per call over eager
``Function.apply`` (bench/pythonop_overhead.py measures it alone in more detail).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import fxtrain
from fxtrain import models


class Tiny(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class Chain(nn.Module):
    def __init__(self, calls: int):
        super().__init__()
        self.lin, self.calls = nn.Linear(8, 8), calls

    def forward(self, x):
        h = self.lin(x)
        for _ in range(self.calls):
            h = Tiny.apply(h)
        return h.sum()


def mlp():
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(8, 16)
    return m, lambda f: f(x).sum()


def gpt2():
    m = models.gpt2_lm(hidden=64, layers=2, heads=2, vocab=1000, positions=64)
    b = models.synthetic_batch("clm", 4, 24, 1000, padding=0.0, generator=torch.Generator().manual_seed(0))
    return m, lambda f: f(**b).loss


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    image_size=32, patch_size=8, num_labels=10)
    m = ViTForImageClassification(cfg)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    return m, lambda f: f(pixel_values=x, labels=y).loss


def contenders(m):
    return {"eager": m,
            "torch.compile": torch.compile(copy.deepcopy(m)),
            # dynamo's own per-call cost with no compiler: the floor of any dynamo-based wrapper
            "dynamo floor": torch.compile(copy.deepcopy(m), backend="eager"),
            "fxtrain": fxtrain.TrainModule(copy.deepcopy(m)),
            "fxtrain inductor": fxtrain.TrainModule(copy.deepcopy(m), fxtrain.Options(executor="inductor"))}


def run(make, steps: int, warmup: int = 10):
    m, loss_of = make()
    fs = contenders(m)
    opts = {k: torch.optim.SGD(f.parameters(), lr=1e-4) for k, f in fs.items()}
    times = {k: [] for k in fs}
    order = list(fs)
    for i in range(steps + warmup):
        for k in (order if i % 2 else order[::-1]):
            t = time.perf_counter()
            loss_of(fs[k]).backward(); opts[k].step(); opts[k].zero_grad()
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, fs


def pythonop(steps: int):
    out = {}
    for calls in (1, 33):
        med, _ = run(lambda: (Chain(calls), lambda f, x=torch.randn(8, 8): f(x)), steps)
        out[calls] = med
    return {k: (out[33][k] - out[1][k]) / 32 for k in out[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workloads", default="mlp,gpt2,vit,pythonop")
    a = ap.parse_args()
    torch.set_num_threads(1)
    names = a.workloads.split(",")
    print(f"torch {torch.__version__}, 1 thread, {a.steps} interleaved steps per contender")
    if "mlp" in names:
        med, fs = run(mlp, a.steps)
        print("mlp   step / eager's:  " + "  ".join(f"{k} {med[k] / med['eager']:.2f} ({med[k] * 1e6:.0f} us)" for k in med))
        print("      fxtrain runtime:", fs["fxtrain"].capture_info().records[0].runtime)
    for name, make in (("gpt2", gpt2), ("vit", vit)):
        if name in names:
            med, fs = run(make, max(a.steps // 4, 20))
            print(f"{name:5s} eager / contender: " + "  ".join(f"{k} {med['eager'] / med[k]:.2f} ({med[k] * 1e3:.2f} ms)" for k in med))
            print("      fxtrain runtime:", fs["fxtrain"].capture_info().records[0].runtime)
    if "pythonop" in names:
        per = pythonop(max(a.steps // 2, 40))
        print("pythonop extra per call over eager: " + "  ".join(f"{k} {(per[k] - per['eager']) * 1e6:+.1f} us" for k in per))


if __name__ == "__main__":
    main()
