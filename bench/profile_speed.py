"""Profiler speed: BERT-base dimensions at batch 1,000,000 x seq 512, and the profiler's own memory.

    python bench/profile_speed.py [--batch 1000000 --seq 512 --optimizer adamw] [--cache-dir DIR]
                                  [--layers 12] [--sizes symbolic|static]

Prints, per costing mode, the wall time of the first ``fxtrain.profile`` call (includes the warm-up:
capture for the fxtrain graph, optimizer state) and of a second call at another batch (the session's
graphs reused), and the process's resident memory after each, which stays flat whatever the batch.
``--layers 1`` costs a one-layer BERT-base: the least any capture of the model must trace (embeddings,
one layer, head), hence a floor for designs that trace each distinct layer once. ``--sizes static``
captures for the given sizes only (each further batch size captures again).
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

import fxtrain
from fxtrain import models


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1_000_000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--modes", default="eager,fxtrain")
    p.add_argument("--cache-dir", default=None, help="Options.cache_dir: run twice, the second process loads the graphs")
    p.add_argument("--layers", type=int, default=12, help="encoder layers (BERT-base has 12)")
    p.add_argument("--sizes", choices=("symbolic", "static"), default="symbolic")
    a = p.parse_args()
    started = time.perf_counter()
    with torch.device("meta"):
        model = models.bert_mlm(hidden=768, layers=a.layers, heads=12)
    print(f"build bert-base ({a.layers} layers) on meta: {time.perf_counter() - started:.2f} s, rss {rss_mib():.0f} MiB")
    B, S = a.batch, a.seq
    for mode in a.modes.split(","):
        optimizations = mode == "fxtrain"
        for batch in (B, 2 * B):
            inputs = fxtrain.fake_inputs(input_ids=((batch, S), torch.long), attention_mask=((batch, S), torch.long),
                                         labels=((batch, S), torch.long))
            started = time.perf_counter()
            options = fxtrain.Options(cache_dir=a.cache_dir, dynamic=a.sizes == "symbolic")
            report = fxtrain.profile(model, optimizer=a.optimizer, optimizations=optimizations, options=options,
                                     **inputs)
            took = time.perf_counter() - started
            print(f"{mode:8s} batch {batch:>9,} x {S}: {took:6.2f} s (warm-up {report.capture_seconds:.2f} s, "
                  f"fake step {report.seconds:.2f} s)  peak {report.peak_memory_bytes / 2 ** 40:8.2f} TiB  "
                  f"fwd {report.flops_forward / 1e15:7.1f} PFLOP  bwd {report.flops_backward / 1e15:7.1f} PFLOP  "
                  f"rss {rss_mib():.0f} MiB" + (f"  cache: {report.cache[0]}" if report.cache else ""))


if __name__ == "__main__":
    main()
