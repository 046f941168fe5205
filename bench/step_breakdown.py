"""Where one training step's time goes, per mode: host, device, and the kernels that take the device.

    python bench/step_breakdown.py --workload gpu-bert-base-mlm --device cuda --autocast bf16 \
        [--modes compile,fxtrain:inductor] [--steps 3] [--top 12] [--json PATH]

Issue 17 asks why fxtrain's compiled step on BERT-base MLM (half the FLOPs of eager's, FLOP-ideal
2.6x) ran only ~1.05x torch.compile on an H200. A median step time cannot say whether a step waits
on the host (launches, Python, synchronisations) or on the device, nor which kernels fill the
device. This runs each mode's warm-up steps (``fxtrain:auto`` until its tier has compiled), then
``--steps`` steps under ``torch.profiler``, and prints per mode:

- the first step's wall time (capture or compilation; the modes run one after another in one
  process, so the first mode's also pays the process's lazy initialisation): with ``eager`` and
  ``dynamo`` (torch.compile's trace alone, bench.py) beside fxtrain's, it says how much of a slow
  first step is dynamo's trace, which every capture pays, and how much fxtrain's own work;
- step wall time, device busy time (the union of the kernels' intervals), and its share of the wall;
- device-to-host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, blocking
  ``cudaMemcpy``) per step: each one drains the launch queue;
- the kernels taking most device time, by name, with counts per step;
- the ops the host dispatched most per step (counted as ``fxtrain bench`` counts them: an op
  another aten op called is not counted again), which say where a host-bound step's launches come
  from (fxtrain's compiled BERT-base step dispatched 964 ops against torch.compile's 611).

On the CPU (``--device cpu``, a dry run) the device columns are the CPU ops' self time instead.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any, Dict, List, Tuple

import torch

from fxtrain import bench, models

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")   # and a plain cudaMemcpy


def _busy(intervals: List[Tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _profile(fn: Any, opt: Any, batches: List[Dict[str, Any]], device: torch.device, autocast: Any) -> Dict[str, Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = device.type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for b in batches:
            bench._step(fn, opt, b, autocast)
        wall = (time.perf_counter() - started) / len(batches)
    events = prof.events()
    if on_gpu:
        work = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        syncs = sum(1 for e in events if e.name.startswith(SYNCS) or e.name == "cudaMemcpy")
    else:   # CPU ops that no other aten op called: the work a device would run
        work = [e for e in events if e.name.startswith("aten::")
                and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        syncs = 0
    dispatched: Dict[str, int] = {}
    for e in events:
        if e.name.startswith(("aten::", "fxtrain")) and not (e.cpu_parent is not None
                                                              and e.cpu_parent.name.startswith("aten::")):
            dispatched[e.name] = dispatched.get(e.name, 0) + 1
    ops = sorted(((name, n / len(batches)) for name, n in dispatched.items()), key=lambda o: -o[1])
    busy = _busy([(e.time_range.start, e.time_range.end) for e in work]) / 1e3 / len(batches)
    by_name: Dict[str, List[float]] = {}
    for e in work:
        took = e.time_range.end - e.time_range.start
        by_name.setdefault(e.name, []).append(took)
    kernels = sorted(((name, len(t) / len(batches), sum(t) / 1e3 / len(batches)) for name, t in by_name.items()),
                     key=lambda k: -k[2])
    return {"wall_ms": wall * 1e3, "busy_ms": busy, "syncs_per_step": syncs / len(batches),
            "launches_per_step": len(work) / len(batches), "kernels": kernels, "ops": ops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="demo", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=sorted(k for k in bench.AUTOCAST if k), default=None)
    parser.add_argument("--modes", default="eager,compile,fxtrain:inductor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = bench.WORKLOADS[args.workload].config(device=args.device, modes=tuple(args.modes.split(",")))
    device = torch.device(args.device)
    base = models.build(config.model, seed=config.seed).to(device)
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
               for b in bench._batches(config, 1 + args.warmup + args.steps)]
    results: Dict[str, Any] = {}
    for mode in config.modes:
        model = copy.deepcopy(base)
        fn, opt = bench._wrap(mode, model), bench._optimizer(model, config.lr)
        started = time.perf_counter()
        for i, b in enumerate(batches[:1 + args.warmup]):
            bench._step(fn, opt, b, args.autocast)
            if i == 0:
                first = time.perf_counter() - started
        if mode == "fxtrain:auto":
            bench.tier_ran(fn, wait=True)
            bench._step(fn, opt, batches[0], args.autocast)
        warm = time.perf_counter() - started
        results[mode] = _profile(fn, opt, batches[1 + args.warmup:], device, args.autocast)
        results[mode]["warmup_s"], results[mode]["first_step_s"] = warm, first
        del fn, opt, model
    unit = "kernel" if device.type == "cuda" else "CPU op"
    print(f"# step breakdown: {args.workload} on {args.device}, autocast {args.autocast or 'none'}, "
          f"{args.steps} profiled steps (the profiler slows the host: compare modes, not with the bench)\n")
    print("| mode | first step s | wall ms/step | device busy ms/step | busy share | launches/step | syncs/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['first_step_s']:.2f} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} "
              f"| {r['busy_ms'] / r['wall_ms']:.0%} | {r['launches_per_step']:.0f} | {r['syncs_per_step']:.0f} |")
    for mode, r in results.items():
        print(f"\n## {mode}: the {args.top} {unit}s with most time per step\n")
        print(f"| {unit} | per step | ms/step |")
        print("|---|---:|---:|")
        for name, count, ms in r["kernels"][:args.top]:
            print(f"| `{name[:110]}` | {count:.0f} | {ms:.3f} |")
        print(f"\n## {mode}: the {args.top} ops dispatched most per step ({sum(n for _, n in r['ops']):.0f} in all)\n")
        print("| op | per step |")
        print("|---|---:|")
        for name, count in r["ops"][:args.top]:
            print(f"| `{name[:110]}` | {count:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "device": args.device, "autocast": args.autocast,
                       "modes": {m: {**r, "kernels": r["kernels"][:50], "ops": r["ops"][:50]} for m, r in results.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
