"""What keeping deferred outputs readable after optimizer.step() costs a loop that never reads them.

The demo's workload (DESIGN §7 BERT-MLM, 16 x 128, 54% padding, 7% labels), with the loop of
`fxtrain bench`, which holds the model's outputs across `optimizer.step()` (as most loops do):
before the step fxtrain copies the parameters the pending logits would need. Three modes trained on
the same batches, interleaved step by step in one process: eager, fxtrain, and fxtrain with the
copy switched off (what a read after the step could not be served without). The ratio of the two
fxtrain speed-ups is the cost (issue: within 5%).

    python bench/keep_outputs.py [--steps 12] [--model bert-mlm]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fxtrain
from fxtrain import models
from fxtrain.runtime import deferred


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-mlm")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    base = models.build(a.model)
    g = torch.Generator().manual_seed(0)
    batches = [models.preset_batch(a.model, 16, 128, padding=0.54, label_density=0.07, generator=g)
               for _ in range(a.steps + 2)]
    runs = {}
    for mode in ("eager", "fxtrain", "fxtrain, no keeping"):
        model = copy.deepcopy(base)
        fn = model if mode == "eager" else fxtrain.TrainModule(model)
        runs[mode] = (fn, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), [])
    keep = deferred._before_optimizer_step
    for i, batch in enumerate(batches):
        order = list(runs)[i % 3:] + list(runs)[:i % 3]
        for mode in order:
            fn, opt, times = runs[mode]
            deferred._before_optimizer_step = (lambda *_: None) if mode == "fxtrain, no keeping" else keep
            t = time.perf_counter()
            out = fn(**batch)                 # held across the step, never read: the bench loop
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - t)
            del out
    deferred._before_optimizer_step = keep
    eager = statistics.median(runs["eager"][2])
    print(f"{a.model}, 16 x 128, {a.steps} steps interleaved, medians:")
    for mode, (_, _, times) in runs.items():
        med = statistics.median(times)
        print(f"  {mode:<22} {1000 * med:8.1f} ms   {eager / med:5.2f}x eager")
    with_keep = eager / statistics.median(runs["fxtrain"][2])
    without = eager / statistics.median(runs["fxtrain, no keeping"][2])
    print(f"speed-up kept: {with_keep / without:.3f} of the speed-up without keeping")


if __name__ == "__main__":
    main()
