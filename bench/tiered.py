"""Issue 29: executor="auto" against "eager" and "inductor": wall time of a short run, steady state.

    PYTHONPATH=<checkout> python bench/tiered.py [--workloads mlp,gpt2] [--steps 20] [--rounds 3]

Wall time: a fresh process per run (capture and compile included, inductor's on-disk caches as they
are: warm after the first round), from wrapping the model to the end of step ``--steps``; the
executors alternate in each round, medians over rounds. Steady state: one process; once auto's
compile has finished (``wait_for_compiles``) it steps alone while it times its two tiers, then the
three wrapped copies step in alternating order, medians of ``--steady`` steps. One intra-op thread.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import fxtrain
from fxtrain.runtime.tiered import TRIAL_STEPS
from overhead import gpt2, mlp, vit

WORKLOADS = {"mlp": mlp, "gpt2": gpt2, "vit": vit}
EXECUTORS = ("eager", "inductor", "auto")


def one(workload: str, executor: str, steps: int) -> None:
    m, loss_of = WORKLOADS[workload]()
    start = time.perf_counter()
    f = fxtrain.TrainModule(m, fxtrain.Options(executor=executor))
    opt = torch.optim.SGD(f.parameters(), lr=1e-4)
    first = None
    for _ in range(steps):
        loss_of(f).backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else time.perf_counter() - start
    wall = time.perf_counter() - start
    tiers = f.capture_info().tiers
    print(f"RESULT {wall:.3f} {first:.3f} {tiers[-1] if tiers else '-'}")


def wall(workload: str, steps: int, rounds: int, cold: bool = False) -> None:
    executors = ("eager", "auto") if cold else EXECUTORS
    runs = {k: [] for k in executors}
    firsts = {k: [] for k in executors}
    notes = {}
    for r in range(rounds):
        for ex in (executors if r % 2 else executors[::-1]):
            with tempfile.TemporaryDirectory() as tmp:
                # cold: an empty inductor cache per run, so auto's worker compiles through the whole run
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tmp) if cold else os.environ
                out = subprocess.run([sys.executable, __file__, "--one", workload, ex, str(steps)],
                                     capture_output=True, text=True, env=env)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                print(out.stderr[-2000:])
                raise SystemExit(f"{workload} {ex} failed")
            _, w, f1, note = line.split(" ", 3)
            runs[ex].append(float(w))
            firsts[ex].append(float(f1))
            notes[ex] = note
    print(f"{workload}: {steps}-step wall time, median of {rounds} fresh processes (first step in brackets)"
          f"{', inductor cache cold' if cold else ''}")
    for ex in executors:
        print(f"  {ex:9s} {statistics.median(runs[ex]):7.2f} s  ({statistics.median(firsts[ex]):.2f} s)"
              f"  runs {', '.join(f'{x:.2f}' for x in runs[ex])}  {notes[ex] if ex == 'auto' else ''}")


def steady(workload: str, steps: int, warmup: int = 10) -> None:
    m, loss_of = WORKLOADS[workload]()
    fs = {ex: fxtrain.TrainModule(copy.deepcopy(m), fxtrain.Options(executor=ex)) for ex in EXECUTORS}
    opts = {k: torch.optim.SGD(f.parameters(), lr=1e-4) for k, f in fs.items()}
    for k, f in fs.items():
        for _ in range(2):   # HF ViT recaptures on its second call (its first sets config.problem_type)
            loss_of(f).backward()
    assert fs["auto"].capture_info().wait_for_compiles(900)
    for _ in range(2 * TRIAL_STEPS + 3):   # auto alone while it times both tiers (as a training loop would)
        loss_of(fs["auto"]).backward()
        opts["auto"].step()
        opts["auto"].zero_grad()
    times = {k: [] for k in fs}
    order = list(fs)
    for i in range(steps + warmup):
        for k in (order if i % 2 else order[::-1]):
            t = time.perf_counter()
            loss_of(fs[k]).backward()
            opts[k].step()
            opts[k].zero_grad()
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{workload}: steady-state step, median of {steps} interleaved steps; "
          f"auto: {fs['auto'].capture_info().tiers[-1]}")
    print("  " + "  ".join(f"{k} {med[k] * 1e3:.3f} ms ({med[k] / med['eager']:.2f}x eager's)" for k in med))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="mlp,gpt2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady", type=int, default=200)
    ap.add_argument("--one", nargs=3, metavar=("WORKLOAD", "EXECUTOR", "STEPS"))
    ap.add_argument("--skip", default="", help="'wall' or 'steady'")
    ap.add_argument("--cold", action="store_true", help="wall times only, eager and auto, inductor's cache empty")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.one:
        one(a.one[0], a.one[1], int(a.one[2]))
        return
    print(f"torch {torch.__version__}, 1 thread, load {os.getloadavg()[0]:.2f}")
    for w in a.workloads.split(","):
        if a.skip != "wall":
            wall(w, a.steps, a.rounds, a.cold)
        if a.skip != "steady" and not a.cold:
            steady(w, a.steady)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
