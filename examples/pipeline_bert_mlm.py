"""Train BERT-MLM with pipeline parallelism on CPU processes (one stage per process).

    torchrun --nproc-per-node 2 examples/pipeline_bert_mlm.py --steps 6

Each process builds the same model (same seed), ``fxtrain.split`` cuts it into one stage per
process (balanced by FLOPs), and ``pipe.build`` runs this rank's stage under torch's schedule.
Only the first rank's batch is read; every rank passes it here to keep the loop identical.
Prints the plan, the loss per step, the median step time and the measured bubble fraction
(the share of the step a stage spends not computing) next to the textbook (p-1)/(m+p-1).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxtrain
from fxtrain import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert-mlm", choices=sorted(models.PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--padding", type=float, default=0.0)
    ap.add_argument("--label-density", type=float, default=0.15)
    ap.add_argument("--balance", choices=("flops", "sparse_flops", "params"), default="flops",
                    help="what the automatic plan balances (sparse_flops: FLOPs after label sparsity)")
    ap.add_argument("--split-at", metavar="MODULE", help="2 stages cut before this module instead of "
                    "balancing FLOPs (e.g. bert.encoder.layer.3)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()

    model = models.build(args.model, seed=0).to(device)
    batch = models.preset_batch(args.model, args.batch, args.seq, padding=args.padding,
                                label_density=args.label_density, device=device)
    if args.split_at:
        pipe = fxtrain.split(model, example_kwargs=batch, split_points=[args.split_at])
    else:
        pipe = fxtrain.split(model, example_kwargs=batch, num_stages=world, balance=args.balance)
    if rank == 0:
        pipe.describe()
    runner = pipe.build(args.schedule, n_microbatches=args.microbatches)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)

    times, bubbles, busy = [], [], []
    for step in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = runner.step(**batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        stats = [None] * world
        dist.all_gather_object(stats, runner.last_stats)
        if step > 0:  # step 0 captures each stage's graphs
            times.append(elapsed)
            bubbles.append(sum(s["bubble_fraction"] for s in stats) / world)
            busy.append([s["busy_time"] for s in stats])
        if runner.is_last:
            print(f"step {step}: loss {loss.item():.4f}, {elapsed:.3f} s"
                  f"{' (first step: captures the stage graphs)' if step == 0 else ''}", flush=True)
    if runner.is_last:
        print(f"last stage label_sparsity: {runner.module.capture_info().optimizations.get('label_sparsity')}", flush=True)
    p, m = world, args.microbatches
    if rank == 0:
        print(f"{args.schedule}, {p} stages, {m} microbatches of {args.batch // m}: "
              f"median step {statistics.median(times):.3f} s; measured bubble {statistics.median(bubbles):.1%} "
              f"(textbook (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}; "
              f"simulated from stage FLOPs {pipe.simulate(args.schedule, m).bubble_fraction:.1%})", flush=True)
        per_stage = [statistics.median(b[s] for b in busy) for s in range(world)]
        print("compute per stage and step (s): " + ", ".join(f"stage {s} {t:.3f}" for s, t in enumerate(per_stage)),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
