"""Fit a GPT-2-style LM's training step into a memory budget (issue 10): planned vs measured peak,
step time, and torch.compile's ``activation_memory_budget`` beside it.

    PYTHONPATH=<checkout> python bench/memory_budget.py                     # budgets 1.0, 0.8, 0.6, 0.5 x P
    PYTHONPATH=<checkout> python bench/memory_budget.py --fractions 0.6 --compile 0.5,0.1
    PYTHONPATH=<checkout> python bench/memory_budget.py --plot docs/memory_budget.png --json out.json

P is eager PyTorch's whole-step peak (parameters, AdamW state, batch, activations, gradients,
temporaries), measured in a fresh process. Each contender runs in its own fresh process (Linux),
as bench/memory.py does, with glibc serving every allocation above 64 kB by mmap so that RSS
follows live memory. After two warm-up steps (capture and planning happen there):

- ``step s``: the median time of ``--steps`` steps (forward, backward, AdamW step, zero_grad);
- ``oracle``: the whole step's peak of live tensor bytes, counted storage by storage by the
  profiler's real-mode counter (``fxtrain/profile/measure.py``: what torch's MemTracker reads), on
  one more step. It cannot see inside inductor's generated code, so it is left out for
  torch.compile;
- ``RSS``: the kernel's peak-RSS mark reset before one more step (``/proc/self/clear_refs``);
  ``VmHWM`` minus the RSS before the step is what the step added, to which the tensor bytes alive
  before it (parameters, state, batch) are added to compare with whole-step peaks.

fxtrain's contenders: ``fxtrain`` (default options), ``fxtrain-graph`` (the aten-graph runtime a
budget runs on, unbudgeted: the time a budget is compared with), ``budget:F`` (``Options(
memory_budget=F*P, optimizer="adamw")``, which reports its plan). torch.compile's: ``compile:A``
(``torch._functorch.config.activation_memory_budget = A``, a fraction of the activation memory its
partitioner would save, not of the step's peak).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

from peak_rss import CHILD_ENV, added_at_peak


def _model(a: argparse.Namespace):
    import torch
    from fxtrain import models
    torch.manual_seed(0)
    m = models.gpt2_lm(hidden=a.hidden, layers=a.layers, heads=a.heads, vocab=a.vocab, positions=max(1024, a.seq))
    b = models.synthetic_batch("clm", a.batch, a.seq, a.vocab, padding=0.0, generator=torch.Generator().manual_seed(0))
    return m, b


def _child(a: argparse.Namespace, contender: str) -> Dict[str, Any]:
    import gc
    import torch
    import fxtrain
    from fxtrain.profile.measure import LiveBytes
    from fxtrain.cost.step import loss_of
    torch.set_num_threads(a.threads)
    m, b = _model(a)
    f = m
    kind, _, arg = contender.partition(":")
    result: Dict[str, Any] = {"contender": contender}
    if kind == "fxtrain":
        f = fxtrain.TrainModule(m)
    elif kind == "fxtrain-graph":
        f = fxtrain.TrainModule(m, fxtrain.Options(backward="graph"))
    elif kind == "budget":
        result["budget"] = int(arg)
        f = fxtrain.TrainModule(m, fxtrain.Options(memory_budget=int(arg), optimizer="adamw"))
    elif kind == "compile":
        import torch._functorch.config as functorch_config   # noqa: the bench drives torch's own knob
        functorch_config.activation_memory_budget = float(arg)
        f = torch.compile(m)
    elif kind != "eager":
        raise ValueError(contender)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step() -> float:
        out = f(**b)
        loss = loss_of(out)
        loss.backward()
        value = float(loss.detach())
        del out, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    started = time.perf_counter()
    for _ in range(2):
        result["loss"] = step()
    result["warmup_s"] = time.perf_counter() - started
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    result["step_s"] = statistics.median(times)
    result["step_s_all"] = times
    # Tensor bytes alive between steps: parameters, AdamW state, the batch.
    live = LiveBytes()
    live.track(list(m.parameters()) + list(m.buffers()) + [b] + [list(s.values()) for s in opt.state.values()])
    result["start_bytes"] = live.current
    gc.collect()
    result["rss_step"] = added_at_peak(step)
    result["rss_peak"] = result["rss_step"] + result["start_bytes"]
    if kind != "compile":
        counter = LiveBytes()
        counter.track(list(m.parameters()) + list(m.buffers()) + [b] + [list(s.values()) for s in opt.state.values()])
        with counter:
            step()
        result["oracle_peak"] = counter.peak
    if kind in ("budget", "fxtrain", "fxtrain-graph"):
        info = f.capture_info()
        result["runtime"] = info.records[0].runtime
        plan = info.memory_plan
        if plan is not None:
            result["plan"] = {k: getattr(plan, k) for k in (
                "budget_bytes", "planned_peak_bytes", "unplanned_peak_bytes", "smallest_peak_bytes", "fits",
                "saved_bytes", "extra_flops", "recomputed_ops", "dropped_values", "candidates", "costings", "seconds")}
    return result


def _timing_child(a: argparse.Namespace, contenders: List[str]) -> Dict[str, Any]:
    """Step times of several contenders in one process, round-robin, so that the load of a shared
    machine falls on all of them alike (the ratios are what the bench reports)."""
    import copy
    import torch
    import fxtrain
    from fxtrain.cost.step import loss_of
    torch.set_num_threads(a.threads)
    base, b = _model(a)
    runners = []
    for contender in contenders:
        kind, _, arg = contender.partition(":")
        m = copy.deepcopy(base)
        if kind == "eager":
            f = m
        elif kind == "fxtrain":
            f = fxtrain.TrainModule(m)
        elif kind == "fxtrain-graph":
            f = fxtrain.TrainModule(m, fxtrain.Options(backward="graph"))
        elif kind == "budget":
            f = fxtrain.TrainModule(m, fxtrain.Options(memory_budget=int(arg), optimizer="adamw"))
        elif kind == "compile":
            f = torch.compile(m)
        else:
            raise ValueError(contender)
        runners.append((contender, kind, arg, m, f, torch.optim.AdamW(m.parameters(), lr=1e-4)))

    def step(kind: str, arg: str, f: Any, opt: Any) -> None:
        import contextlib
        ctx = contextlib.nullcontext()
        if kind == "compile":   # read when the graphs compile (warm-up); harmless afterwards
            import torch._functorch.config as functorch_config   # noqa: torch's own knob, compared with
            ctx = functorch_config.patch(activation_memory_budget=float(arg))
        with ctx:
            out = f(**b)
        loss_of(out).backward()
        del out
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _, kind, arg, _, f, opt in runners:
        for _ in range(2):
            step(kind, arg, f, opt)
    times: Dict[str, List[float]] = {c: [] for c in contenders}
    for _ in range(a.steps):
        for contender, kind, arg, _, f, opt in runners:
            t = time.perf_counter()
            step(kind, arg, f, opt)
            times[contender].append(time.perf_counter() - t)
    return {"times": times, "median": {c: statistics.median(t) for c, t in times.items()}}


def _run(a: argparse.Namespace, contender: str) -> Dict[str, Any]:
    env = CHILD_ENV
    argv = [sys.executable, __file__, "--child", contender] + [f"--{k}={getattr(a, k)}" for k in
                                                              ("hidden", "layers", "heads", "vocab", "batch", "seq",
                                                               "steps", "threads")]
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return {"contender": contender, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.1f}"


def _plot(rows: List[Dict[str, Any]], eager: Dict[str, Any], base: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = eager["oracle_peak"]
    budget = sorted((r for r in rows if r["contender"].startswith("budget") and "plan" in r), key=lambda r: r["budget"])
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["budget"] / p for r in budget]
    mem.plot(xs, [r["plan"]["planned_peak_bytes"] / 2 ** 20 for r in budget], "o-", label="planned peak")
    mem.plot(xs, [r["oracle_peak"] / 2 ** 20 for r in budget], "x--", label="measured peak (tensor bytes)")
    mem.plot(xs, [r["rss_peak"] / 2 ** 20 for r in budget], "+:", label="measured peak (RSS)")
    mem.plot(xs, [r["budget"] / 2 ** 20 for r in budget], "k-", lw=0.7, label="budget")
    mem.axhline(p / 2 ** 20, color="grey", ls="--", lw=0.8, label="eager PyTorch")
    mem.set_xlabel("budget / eager peak")
    mem.set_ylabel("whole-step peak (MiB)")
    mem.set_title("peak memory against the budget")
    mem.legend(fontsize=8)
    speed.plot(xs, [r["step_s"] / base["step_s"] for r in budget], "o-", label="fxtrain with the budget")
    speed.axhline(1.0, color="grey", ls="--", lw=0.8, label="fxtrain, aten graphs, no budget")
    speed.axhline(1.35, color="red", ls=":", lw=0.8, label="target 1.35x")
    for r in rows:
        if r["contender"].startswith("compile") and "step_s" in r:
            speed.plot([r["rss_peak"] / p], [r["step_s"] / base["step_s"]], "s",
                       label=f"torch.compile, activation_memory_budget={r['contender'].split(':')[1]} "
                             f"(x: its RSS peak / P)")
    speed.set_xlabel("budget / eager peak")
    speed.set_ylabel("step time / unbudgeted step time")
    speed.set_ylim(top=max(1.6, speed.get_ylim()[1]))
    speed.set_title("step time against the budget")
    speed.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fractions", default="1.0,0.8,0.6,0.5", help="budgets, as fractions of eager's peak P")
    ap.add_argument("--compile", default="", help="torch.compile activation_memory_budget values, e.g. 1.0,0.5")
    ap.add_argument("--interleaved", action="store_true",
                    help="time every contender again in one process, round-robin (use on a shared machine)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--from-json", default=None, help="only redraw --plot from a --json of an earlier run")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as fh:
            rows = json.load(fh)["rows"]
        _plot(rows, rows[0], next(r for r in rows if r["contender"] == "fxtrain-graph"), a.plot)
        return
    if a.child:
        if a.child.startswith("timing="):
            print(json.dumps(_timing_child(a, a.child[len("timing="):].split(","))))
        else:
            print(json.dumps(_child(a, a.child)))
        return
    eager = _run(a, "eager")
    if "error" in eager:
        raise SystemExit(f"eager failed: {eager['error']}")
    p = eager["oracle_peak"]
    rows = [eager, _run(a, "fxtrain"), _run(a, "fxtrain-graph")]
    base = rows[2]
    rows += [_run(a, f"budget:{int(float(x) * p)}") for x in a.fractions.split(",") if x]
    rows += [_run(a, f"compile:{x}") for x in a.compile.split(",") if x]
    if a.interleaved:
        # Step times again, every contender in one process, round-robin: on a shared machine the
        # separate processes above see different loads; these ratios do not.
        names = [r["contender"] for r in rows if "error" not in r]
        timing = _run(a, "timing=" + ",".join(names))
        for r in rows:
            if "median" in timing and r["contender"] in timing["median"]:
                r["step_s_separate"] = r["step_s"]
                r["step_s"] = timing["median"][r["contender"]]
    print(f"GPT-2-style LM: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, batch {a.batch} x {a.seq}, AdamW, "
          f"{a.threads} threads; eager peak P = {_mib(p)} MiB (tensor bytes, whole step)")
    print(f"{'contender':<22}{'budget':>9}{'planned':>9}{'oracle':>9}{'RSS':>9}{'meas/plan':>10}{'step s':>8}"
          f"{'vs graph':>9}{'recomputed':>12}  runtime / plan")
    for r in rows:
        if "error" in r:
            print(f"{r['contender']:<22} failed: {r['error']}")
            continue
        plan = r.get("plan") or {}
        planned = plan.get("planned_peak_bytes")
        ratio = f"{r['oracle_peak'] / planned:.4f}" if planned and r.get("oracle_peak") else "-"
        name = r["contender"] if not r["contender"].startswith("budget") else f"budget {r['budget'] / p:.2f} P"
        extra = f"{plan['extra_flops'] / 1e9:.2f} GF" if plan else "-"
        note = r.get("runtime", "")[:40] if not plan else (
            f"fits={plan['fits']} dropped {plan['dropped_values']}/{plan['candidates']} "
            f"saved {_mib(plan['saved_bytes'])} MiB, planned in {plan['seconds']:.1f} s")
        print(f"{name:<22}{_mib(r.get('budget')):>9}{_mib(planned):>9}{_mib(r.get('oracle_peak')):>9}"
              f"{_mib(r.get('rss_peak')):>9}{ratio:>10}{r['step_s']:>8.3f}{r['step_s'] / base['step_s']:>8.2f}x"
              f"{extra:>12}  {note}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)
    if a.plot:
        _plot(rows, eager, base, a.plot)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
