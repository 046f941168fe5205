"""Profiler accuracy: estimated vs measured peak memory and the FLOPs, on the models of the tests.

    python bench/profile_accuracy.py

Measured = live tensor bytes of the same step run for real (fxtrain/profile/measure.py), with
``TrainModule`` for the fxtrain column and the plain module for eager.
"""
from __future__ import annotations

import sys

import torch

import fxtrain
from fxtrain import models
from fxtrain.profile.measure import measure_step

sys.path.insert(0, "tests")
from test_profile import CASES  # noqa: E402  (the very models and batches the tests check)


def main() -> None:
    print("| model | optimizer | costed | estimate (bytes) | measured (bytes) | ratio | fwd FLOPs | bwd FLOPs |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name in sorted(CASES):
        build, make_inputs = CASES[name]
        torch.manual_seed(0)
        model = build()
        args, kwargs = make_inputs()
        real_tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
        for optimizer in (None, torch.optim.AdamW):
            for optimizations in (False, True):
                report = fxtrain.profile(model, *args, optimizer=optimizer, optimizations=optimizations, **kwargs)
                measured = measure_step(real_tm if optimizations else model, *args, optimizer=optimizer,
                                        params_model=model, **kwargs).peak_bytes
                print(f"| {name} | {'AdamW' if optimizer else '-'} | {'fxtrain' if optimizations else 'eager'} | "
                      f"{report.peak_memory_bytes:,} | {measured:,} | {report.peak_memory_bytes / measured:.4f} | "
                      f"{report.flops_forward:,} | {report.flops_backward:,} |")


if __name__ == "__main__":
    main()
