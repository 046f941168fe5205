"""Issue 29: executor="auto" against "eager" and "inductor": wall time of a short run, steady state.

    PYTHONPATH=<checkout> python bench/tiered.py [--workloads mlp,gpt2] [--steps 20] [--rounds 3]
    PYTHONPATH=<checkout> python bench/tiered.py --workloads gpt2-dense,demo --steps 20,200 --skip steady

Workloads: bench/overhead.py's tiny ones (mlp, gpt2, vit) and ``fxtrain bench``'s named ones
(``--list-workloads``: gpt2-dense, demo, ...; their model and batch settings, a new batch every
step). Wall time: a fresh process per run (capture and compile included, inductor's on-disk caches
as they are: warm after the first round), from wrapping the model to the end of each step count in
``--steps`` (one run reads them all: a 20-step run is the first 20 steps of a 200-step one); the
executors alternate in each round, medians over rounds. Steady state: one process; once auto's
compile has finished (``wait_for_compiles``) it steps alone while it times its two tiers, then the
five copies (PyTorch eager, torch.compile and fxtrain's three executors) step in alternating order,
medians of ``--steady`` steps, ratios against PyTorch's; ``--rounds`` such processes, and the
median of each ratio over them. ``--modes`` picks the wall-time runs (the
same five names). One intra-op thread.
"""
from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch

import fxtrain
from fxtrain.bench import WORKLOADS as BENCH_WORKLOADS, _batches
from fxtrain.models import build
from fxtrain.runtime.tiered import TRIAL_STEPS
from overhead import gpt2, mlp, vit

EXECUTORS = ("eager", "inductor", "auto")
# Besides fxtrain's executors: the model as it is (PyTorch eager) and torch.compile of it (inductor,
# its defaults), the two a user compares against.
MODES = ("torch", "compile") + EXECUTORS


def wrapped(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "torch":
        return model
    if mode == "compile":
        return torch.compile(model)
    return fxtrain.TrainModule(model, fxtrain.Options(executor=mode))


def named(name: str, steps: int = 16):
    """An ``fxtrain bench`` workload: its model, and a new batch of its settings per step (``steps``
    of them, then again from the first)."""
    config = BENCH_WORKLOADS[name].config()
    batches = itertools.cycle(_batches(config, steps))
    return build(config.model, seed=config.seed), lambda f: f(**next(batches)).loss


WORKLOADS = {"mlp": mlp, "gpt2": gpt2, "vit": vit, **{w: functools.partial(named, w) for w in BENCH_WORKLOADS}}


def one(workload: str, executor: str, marks: List[int]) -> None:
    m, loss_of = WORKLOADS[workload](max(marks)) if workload in BENCH_WORKLOADS else WORKLOADS[workload]()
    start = time.perf_counter()
    f = wrapped(m, executor)
    opt = torch.optim.SGD(f.parameters(), lr=1e-4)
    walls = []
    for step in range(1, max(marks) + 1):
        loss_of(f).backward()
        opt.step()
        opt.zero_grad()
        if step == 1 or step in marks:
            walls.append(time.perf_counter() - start)
    tiers = f.capture_info().tiers if isinstance(f, fxtrain.TrainModule) else []
    print(f"RESULT {' '.join(f'{w:.3f}' for w in walls)} {tiers[0] if tiers else '-'}")


def wall(workload: str, marks: List[int], rounds: int, cold: bool = False, threads: int = 1,
         modes: tuple = EXECUTORS) -> None:
    executors = ("eager", "auto") if cold else modes
    runs: Dict[str, List[List[float]]] = {k: [] for k in executors}   # per run: first step, then each mark
    notes = {}
    for r in range(rounds):
        for ex in (executors if r % 2 else executors[::-1]):
            with tempfile.TemporaryDirectory() as tmp:
                # cold: an empty inductor cache per run, so auto's worker compiles through the whole run
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tmp) if cold else os.environ
                out = subprocess.run([sys.executable, __file__, "--one", workload, ex, ",".join(map(str, marks)),
                                      "--threads", str(threads)], capture_output=True, text=True, env=env)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                print(out.stderr[-2000:])
                raise SystemExit(f"{workload} {ex} failed")
            fields = line.split(" ", len(marks) + 2)
            runs[ex].append([float(x) for x in fields[1:len(marks) + 2]])
            notes[ex] = fields[-1]
            print(f"  ({workload} {ex} round {r}: {' '.join(fields[1:-1])}; load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"{workload}: wall time to the end of step {', '.join(map(str, marks))}, median of {rounds} fresh "
          f"processes (first step in brackets){', inductor cache cold' if cold else ''}")
    ref = "eager" if "eager" in executors else executors[0]
    for ex in executors:
        med = [statistics.median(run[i] for run in runs[ex]) for i in range(len(marks) + 1)]
        vs = [f"{m:.2f} s ({m / statistics.median(run[i + 1] for run in runs[ref]):.2f}x {ref}'s)"
              for i, m in enumerate(med[1:])]
        print(f"  {ex:9s} {'  '.join(vs)}  ({med[0]:.2f} s)  {notes[ex] if ex == 'auto' else ''}")


def steady(workload: str, steps: int, warmup: int = 10) -> None:
    m, loss_of = WORKLOADS[workload]()
    fs = {mode: wrapped(copy.deepcopy(m), mode) for mode in MODES}
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
    print("  " + "  ".join(f"{k} {med[k] * 1e3:.3f} ms ({med[k] / med['torch']:.2f}x PyTorch's)" for k in med))
    print("STEADY " + json.dumps(med), flush=True)


def steady_rounds(workload: str, steps: int, rounds: int, threads: int) -> None:
    """``rounds`` fresh processes of ``steady``; the median over rounds of each mode's step time over
    PyTorch's, and the issue-19 ratios: fxtrain auto's step over torch.compile's (the MLP's bound is
    <= 1.03) and torch.compile's over auto's (speed, ViT's bound >= 0.97)."""
    ratios: Dict[str, List[float]] = {}
    for r in range(rounds):
        out = subprocess.run([sys.executable, __file__, "--one-steady", workload, str(steps), "--threads",
                              str(threads)], capture_output=True, text=True)
        print(out.stdout.replace("STEADY", "  (round %d)" % r).rstrip(), flush=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STEADY ")), None)
        if line is None:
            print(out.stderr[-2000:])
            raise SystemExit(f"{workload} steady round {r} failed")
        med = json.loads(line[len("STEADY "):])
        for k, v in med.items():
            ratios.setdefault(k, []).append(v / med["torch"])
        ratios.setdefault("auto / compile", []).append(med["auto"] / med["compile"])
    print(f"{workload}: medians over {rounds} rounds, step time over PyTorch eager's (lower is faster): " +
          "  ".join(f"{k} {statistics.median(v):.3f}" for k, v in ratios.items() if k != "auto / compile"))
    each = ", ".join(f"{x:.3f}" for x in ratios["auto / compile"])
    print(f"  fxtrain auto's step / torch.compile's: median {statistics.median(ratios['auto / compile']):.3f} "
          f"({each}); torch.compile's speed over auto's: {1 / statistics.median(ratios['auto / compile']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="mlp,gpt2")
    ap.add_argument("--steps", default="20", help="step counts to time a run to, comma-separated (20,200)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady", type=int, default=200)
    ap.add_argument("--one", nargs=3, metavar=("WORKLOAD", "EXECUTOR", "MARKS"))
    ap.add_argument("--one-steady", nargs=2, metavar=("WORKLOAD", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (of every run)")
    ap.add_argument("--skip", default="", help="'wall' or 'steady'")
    ap.add_argument("--cold", action="store_true", help="wall times only, eager and auto, inductor's cache empty")
    ap.add_argument("--modes", default=",".join(EXECUTORS),
                    help=f"wall times: of {', '.join(MODES)} (torch: the model as it is; compile: torch.compile)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:
        one(a.one[0], a.one[1], [int(x) for x in a.one[2].split(",")])
        return
    if a.one_steady:
        steady(a.one_steady[0], int(a.one_steady[1]))
        return
    print(f"torch {torch.__version__}, {a.threads} thread(s), load {os.getloadavg()[0]:.2f}")
    for w in a.workloads.split(","):
        if a.skip != "wall":
            wall(w, [int(x) for x in a.steps.split(",")], a.rounds, a.cold, a.threads, tuple(a.modes.split(",")))
        if a.skip != "steady" and not a.cold:
            steady_rounds(w, a.steady, a.rounds, a.threads)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
