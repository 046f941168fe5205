"""The per-step tax and the demo on each tested torch release, in alternating processes (issue 16).

    python bench/releases.py [--rounds 2] [--releases 2.11.0,2.13.0,2.14.1] [--steps 100]

Each release runs in its own venv (``make test TORCH=<release>`` builds ``.venv/torch-<release>``).
Per round, every release runs ``bench/overhead.py`` and then ``fxtrain bench --workload demo`` in a
fresh process, the releases' order rotating per round, so that a machine that gets busier or
quieter during the run moves every release alike. Eager PyTorch's own times are printed beside
fxtrain's: a release where eager is slower is torch's difference, not fxtrain's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

# overhead.py's lines: "mlp   step / eager's:  eager 1.00 (250 us)  compile 1.12 (...)  fxtrain 1.30 (...)"
_CONTENDER = re.compile(r"(\S+) ([\d.]+) \(([\d.]+) (us|ms)\)")
_PYTHONOP = re.compile(r"(\S+) ([+-][\d.]+) us")


def _overhead(python: Path, steps: int) -> Dict[str, float]:
    out = subprocess.run([str(python), str(ROOT / "bench" / "overhead.py"), "--steps", str(steps)],
                         capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    row: Dict[str, float] = {}
    for line in out.splitlines():
        head = line.split()[0] if line.split() else ""
        if head in ("mlp", "gpt2", "vit"):
            for name, ratio, t, unit in _CONTENDER.findall(line):
                row[f"{head} {name} ratio"] = float(ratio)
                row[f"{head} {name} ms"] = float(t) / (1000 if unit == "us" else 1)
        elif line.startswith("pythonop"):
            for name, extra in _PYTHONOP.findall(line):
                row[f"pythonop {name} us"] = float(extra)
    return row


def _demo(python: Path) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "demo.json"
        subprocess.run([str(python), "-m", "fxtrain.cli", "bench", "--workload", "demo", "--no-progress",
                        "--json", str(path)], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        modes = json.loads(path.read_text())["modes"]
    return {"demo eager ms": modes["eager"]["median_ms"], "demo fxtrain ms": modes["fxtrain"]["median_ms"],
            "demo speed-up": modes["eager"]["median_ms"] / modes["fxtrain"]["median_ms"],
            "demo eager first s": modes["eager"]["first_step_s"], "demo fxtrain first s": modes["fxtrain"]["first_step_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--releases", default="2.11.0,2.13.0,2.14.1")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    releases = a.releases.split(",")
    pythons = {r: ROOT / ".venv" / f"torch-{r}" / "bin" / "python" for r in releases}
    missing = [r for r, p in pythons.items() if not p.exists()]
    if missing:
        sys.exit(f"no venv for torch {', '.join(missing)}: make test TORCH=<release> builds one")
    rows: Dict[str, List[Dict[str, float]]] = {r: [] for r in releases}
    for k in range(a.rounds):
        order = releases[k % len(releases):] + releases[:k % len(releases)]
        for release in order:
            row = _overhead(pythons[release], a.steps) | _demo(pythons[release])
            rows[release].append(row)
            print(f"round {k + 1} torch {release}: " + ", ".join(f"{key} {v:.3g}" for key, v in row.items()), flush=True)
    keys = sorted({key for runs in rows.values() for run in runs for key in run})
    print("\n| measure | " + " | ".join(f"torch {r}" for r in releases) + " |")
    print("|---|" + "---:|" * len(releases))
    for key in keys:
        cells = [", ".join(f"{run[key]:.3g}" for run in rows[r] if key in run) for r in releases]
        medians = [statistics.median([run[key] for run in rows[r] if key in run]) if any(key in run for run in rows[r])
                   else None for r in releases]
        print(f"| {key} | " + " | ".join(f"{c} (median {m:.3g})" if m is not None else "-"
                                         for c, m in zip(cells, medians)) + " |")


if __name__ == "__main__":
    main()
