"""First and second capture times of each HF family the tests train, with default options.

Each family runs in a fresh process: step 1 captures (the first capture a user waits for), step 2
brings new sizes (batch and sequence length; for images the batch size, or the image size too in
the ``-image`` rows) and captures once more, step 3 brings sizes never run before and should not
capture. A family that does not finish within ``--timeout`` is reported as such (the stall of
issue #31: HF Swin's second batch size did not finish in 8 minutes).

    PYTHONPATH=<checkout> python bench/capture_times.py [--families swin,bert] [--timeout 300] [--json out.json]

Times are of the whole training step (forward, backward, AdamW step) that captured. The ``cpu``
ratio uses the process's CPU time (all its threads): on a shared machine the wall clock of a
capture moves with whatever else runs (T5's wall ratio spanned 2.1x-3.9x in one series at load 3),
the work it does far less (2.2x-2.7x in the same runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, sys, time, torch, fxtrain
    from fxtrain import models
    family = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    text = {
        "bert-mlm": (lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 1000, 0),
        "gpt2": (lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64), "clm", 1000, 0),
        "roberta-cls": (lambda: models.roberta_cls(hidden=32, layers=2, heads=2, vocab=1000), "cls", 1000, 1),
        "distilbert-mlm": (lambda: models.distilbert_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 1000, 0),
        "electra-mlm": (lambda: models.electra_mlm(hidden=32, layers=2, heads=2, vocab=1000), "mlm", 1000, 0),
        "llama": (lambda: models.llama_lm(hidden=32, layers=2, heads=2, vocab=1000), "clm", 1000, 0),
        "t5": (lambda: models.t5(d_model=32, layers=2, heads=2, vocab=1000), "t5", 1000, 0),
    }
    images = {"swin": models.swin_cls, "convnext": models.convnext_cls, "vit": models.vit_cls,
              "resnet": models.resnet_cls}
    torch.manual_seed(0)
    if family in text:
        build, kind, vocab, pad = text[family]
        model = build()
        def batch(b, s):
            if kind == "t5":
                enc = models.synthetic_batch("cls", b, s, vocab, padding=0.3, generator=g)
                dec = models.synthetic_batch("clm", b, max(2, s // 2), vocab, padding=0.2, generator=g)
                return dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=dec["labels"])
            return models.synthetic_batch(kind, b, s, vocab, padding=0.3, label_density=0.25, pad_id=pad, generator=g)
        shapes = [(4, 16), (3, 11), (5, 20)]
    else:
        name = family.split("-")[0]
        model = images[name]()
        extra = dict(interpolate_pos_encoding=True) if name == "vit" else {}
        def batch(b, s):
            return models.image_batch(b, s, generator=g, **extra)
        shapes = [(4, 32), (3, 48), (5, 40)] if family.endswith("-image") else [(4, 32), (3, 32), (5, 32)]
    model = fxtrain.TrainModule(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    info = model.capture_info()
    steps = []
    for b, s in shapes:
        data = batch(b, s)
        before = info.graphs
        t, cpu = time.perf_counter(), time.process_time()
        model(**data).loss.backward()
        opt.step(); opt.zero_grad()
        steps.append(dict(seconds=time.perf_counter() - t, cpu_seconds=time.process_time() - cpu,
                          captures=info.graphs - before, shape=[b, s]))
        print(json.dumps(dict(step=steps[-1])), flush=True)
    print(json.dumps(dict(steps=steps, fallback=info.fallback_reason, reasons=info.capture_reasons)), flush=True)
""")

FAMILIES = ["bert-mlm", "gpt2", "roberta-cls", "distilbert-mlm", "electra-mlm", "llama", "t5",
            "swin", "convnext", "vit", "resnet", "swin-image", "convnext-image", "vit-image", "resnet-image"]


def run(family: str, timeout: float) -> Dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = {k: v for k, v in env.items() if not k.startswith("FXTRAIN_")}   # the defaults users get
    steps: List[dict] = []
    try:
        # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH.
        proc = subprocess.run([sys.executable, "-c", CHILD, family], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        steps = [json.loads(line)["step"] for line in out.splitlines() if line.startswith('{"step"')]
        return dict(family=family, steps=steps, timed_out=True)
    if proc.returncode != 0:
        return dict(family=family, steps=steps, error=proc.stderr.strip().splitlines()[-1:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(family=family, **result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per family (its three steps)")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    rows = [run(f, a.timeout) for f in tqdm(a.families.split(","), desc="capture times", unit="family")]
    print(f"{'family':<16} {'shapes':<26} {'1st capture s':>13} {'2nd capture s':>13} {'2nd/1st':>8} "
          f"{'2nd/1st cpu':>11} {'3rd step captures':>17}  note")
    for row in rows:
        steps = row["steps"]
        shapes = " -> ".join("x".join(map(str, s["shape"])) for s in steps) or "-"
        first = f"{steps[0]['seconds']:.2f}" if steps else "-"
        second = (f"{steps[1]['seconds']:.2f}" if len(steps) > 1 else
                  f"> {a.timeout:.0f}" if row.get("timed_out") else "-")
        ratio = f"{steps[1]['seconds'] / steps[0]['seconds']:.2f}" if len(steps) > 1 else "-"
        cpu = (f"{steps[1]['cpu_seconds'] / steps[0]['cpu_seconds']:.2f}"
               if len(steps) > 1 and "cpu_seconds" in steps[0] else "-")
        third = str(steps[2]["captures"]) if len(steps) > 2 else "-"
        note = ("did not finish" if row.get("timed_out") else row.get("error") or
                (f"fell back: {row['fallback']}" if row.get("fallback") else ""))
        print(f"{row['family']:<16} {shapes:<26} {first:>13} {second:>13} {ratio:>8} {cpu:>11} {third:>17}  {note}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
