"""The compiled tier's background compile on a GPU: which device its worker uses, and how much memory.

    python bench/worker_gpu_memory.py [--device cuda] [--seconds 80] [--seq 128]

Trains the demo model (bert-mlm, 16 x 128, 54% padding) with ``executor="auto"`` and
``compile_after=0``, so the tier's worker starts once the first capture is partitioned, and trains
until the tier has decided (compiled graphs kept or sent back) or ``--seconds`` are up. While it runs, the GPU memory
of each process is read from ``nvidia-smi --query-compute-apps`` every 0.2 s: the worker's own, and the
training process's next to it. The training process's ``torch.cuda.max_memory_allocated`` is read
before and after the switch. Prints one table (and ``--json``). Needs NVIDIA's ``nvidia-smi`` for a
CUDA device; ``--device cpu`` runs the same loop without the memory columns (a dry run of the script).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
import time
from typing import Dict, List

import torch


def _per_process_mib() -> Dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout
    found: Dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            found[int(parts[0])] = int(parts[1])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=80.0, help="train at most this long")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and (shutil.which("nvidia-smi") is None or not torch.cuda.is_available()):
        print("worker_gpu_memory: needs a CUDA device and nvidia-smi")
        return 2
    import fxtrain
    from fxtrain.models import PRESETS, preset_batch
    from fxtrain.runtime import tiered

    torch.manual_seed(0)
    model = fxtrain.TrainModule(PRESETS["bert-mlm"].build().to(device),
                                fxtrain.Options(executor="auto", compile_after=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {k: v.to(device) for k, v in preset_batch("bert-mlm", 16, args.seq, padding=0.54,
                                                       label_density=0.07).items()}
    samples: List[Dict[int, int]] = []
    workers: Dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for proc in list(tiered._workers):
                workers.setdefault(proc.pid, " ".join(proc.args[3:]))
            samples.append(_per_process_mib() if cuda else {})
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    before = after = None
    start = time.perf_counter()
    step = 0
    while time.perf_counter() - start < args.seconds:   # until the tier has decided, or time is up
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 3 and cuda:
            torch.cuda.synchronize()
            before = torch.cuda.max_memory_allocated(device)
        if step % 20 == 0 and workers and not tiered._workers:
            tiers = model.capture_info(wait=False).tiers
            if tiers and not any("compiling" in t or "loading" in t for t in tiers):
                break
    if cuda:
        torch.cuda.synchronize()
        after = torch.cuda.max_memory_allocated(device)
    info = model.capture_info(wait=False)
    stop.set()
    thread.join()
    me = os.getpid()
    worker_peak = max((s.get(pid, 0) for s in samples for pid in workers), default=0)
    mine_peak = max((s.get(me, 0) for s in samples), default=0)
    result = {"gpu": torch.cuda.get_device_name(device) if cuda else str(device), "torch": torch.__version__,
              "steps": step,
              "seconds": round(time.perf_counter() - start, 1), "worker_pids": sorted(workers),
              "worker_gpu_mib_peak": worker_peak, "trainer_gpu_mib_peak": mine_peak,
              "trainer_max_allocated_mib_step3": round((before or 0) / 2 ** 20),
              "trainer_max_allocated_mib_end": round((after or 0) / 2 ** 20), "tiers": info.tiers}
    for key, value in result.items():
        print(f"{key:34} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
