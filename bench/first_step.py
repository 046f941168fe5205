"""First training step of a fresh process: eager vs fxtrain without cache, with an empty cache
(capture + write) and with a warm cache (load), on built-in models.

Every measurement is its own Python process (a "fresh process" is the point), and the variants run
interleaved round by round so that machine load hits them alike. Two times per run: the first step
(forward + backward + AdamW step, from just before the call) and the wall time from interpreter
start to the end of that step (imports, model build and all).

    python bench/first_step.py [--models bert-mlm,roberta-mlm] [--rounds 3] [--json out.json] [--executor inductor]

With ``--executor inductor`` inductor's own kernel cache (TORCHINDUCTOR_CACHE_DIR) lives beside
fxtrain's: a fresh one for "no cache", the round's for "empty cache" (cold, filled) and "warm cache".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import time
    started = time.time()
    import json, sys, torch, fxtrain
    from fxtrain import models
    name, variant, cache_dir, process_start, executor = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
    model = models.build(name)
    batch = models.preset_batch(name, 16, 128, padding=0.53, label_density=0.07)
    if variant != "eager":
        model = fxtrain.TrainModule(model, fxtrain.Options(cache_dir=cache_dir if variant != "no cache" else None,
                                                           executor=executor))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    loss = model(**batch).loss
    loss.backward(); opt.step(); opt.zero_grad()
    first = time.perf_counter() - t
    to_first = time.time() - process_start
    info = model.capture_info() if variant != "eager" else None   # waits for a pending partition
    print(json.dumps(dict(first=first, to_first=to_first, loss=loss.item(),
                          hits=info.cache_hits if info else 0)))
""")

VARIANTS = ("eager", "no cache", "empty cache", "warm cache")


def run_one(name: str, variant: str, cache_dir: str, executor: str = "auto") -> Dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FXTRAIN_CACHE_DIR", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = (tempfile.mkdtemp() if variant == "no cache"
                                      else os.path.join(cache_dir, "inductor"))
    import time
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, name, variant, cache_dir, str(start), executor], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert-mlm,roberta-mlm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--executor", default="auto", choices=("auto", "eager", "inductor"),
                        help="fxtrain's executor (auto, the default: the eager executor's first step)")
    args = parser.parse_args()
    results: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    for name in args.models.split(","):
        results[name] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as cache_dir:
                order = list(VARIANTS) if r % 2 == 0 else ["no cache", "eager", "empty cache", "warm cache"]
                for variant in order:  # "empty cache" fills the directory "warm cache" reads
                    run = run_one(name, variant, cache_dir, args.executor)
                    if variant == "warm cache" and run["hits"] != 1:
                        raise SystemExit(f"{name}: the warm run did not hit the cache")
                    results[name][variant].append(run)
                    print(f"{name:12} round {r} {variant:12} first step {run['first']:6.2f} s, "
                          f"start to first step {run['to_first']:6.2f} s", flush=True)
    print()
    print("| model | variant | first step s (median) | vs eager | process start to end of first step s |")
    print("|---|---|---:|---:|---:|")
    for name, by_variant in results.items():
        eager = statistics.median(r["first"] for r in by_variant["eager"])
        for variant, runs in by_variant.items():
            first = statistics.median(r["first"] for r in runs)
            total = statistics.median(r["to_first"] for r in runs)
            print(f"| {name} | {variant} | {first:.2f} | {first - eager:+.2f} | {total:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
