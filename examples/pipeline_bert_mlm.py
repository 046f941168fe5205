"""Train BERT-MLM with pipeline parallelism on CPU processes.

    torchrun --nproc-per-node 2 examples/pipeline_bert_mlm.py --steps 6 [--schedule zb1p]

Each process builds the same model (same seed), ``fxtrain.split`` cuts it into stages (one per
process for GPipe/1F1B, two per process for the interleaved, zero-bubble and V schedules;
balanced by FLOPs), and ``pipe.build`` runs this rank's stages under torch's schedule.
Only the first rank's batch is read; every rank passes it here to keep the loop identical.
Prints the plan, the loss per step, the median step time and the measured bubble fraction
(the share of the step a rank spends not computing) next to the schedule's textbook bubble and
the ones simulated from the stage FLOPs and from the measured compute times, and where the idle
time went (``timeline.idle_breakdown``): waiting on a peer's compute (the schedule's own bubble),
transfers and dispatch (from an action's inputs being computed to its start), and the
all-reduce of parameters shared across ranks after the schedule (the tied decoder, unless the V
placement puts both its stages on rank 0). For ZB1P it also splits the measured bubble into the
schedule's own (the schedule replayed with the measured compute times and free communication)
and the rest, communication and dispatch, and checks the former against 1.2 x (p-1)/(3m).
``--balance measured`` cuts where the stages' measured times are even for the schedule run
(``build`` times candidate plans as this pipeline). ``--plot`` draws the measured timeline.
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
from fxtrain.pipeline.costs import COST_FUNCTIONS
from fxtrain.pipeline.schedules import SCHEDULE_INFO
from fxtrain.pipeline.timeline import action_times, idle_breakdown, measured, plot, simulate


def stage_costs(plan, cost_fn) -> list:
    """A plan's stages priced by ``cost_fn``, per microbatch (the runner's plan is captured at microbatch shape)."""
    gm = plan.captured.gm
    per_node = dict(zip(gm.graph.nodes, cost_fn(gm)))
    return [sum(per_node[n] for n in st.nodes + st.replicated) for st in plan.stages]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert-mlm", choices=sorted(models.PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=list(SCHEDULE_INFO), default="1f1b")
    ap.add_argument("--stages-per-rank", type=int, default=None,
                    help="default: 1 for gpipe/1f1b, 2 for the others")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--padding", type=float, default=0.0)
    ap.add_argument("--label-density", type=float, default=0.15)
    ap.add_argument("--balance", choices=("flops", "sparse_flops", "time", "params", "measured"), default="flops",
                    help="what the automatic plan balances (sparse_flops: FLOPs after label sparsity; "
                         "time: those FLOPs plus the bytes each op moves; measured: the stages' times, "
                         "measured on this machine, cut for the schedule)")
    ap.add_argument("--split-at", metavar="MODULE", help="2 stages cut before this module instead of "
                    "balancing FLOPs (e.g. bert.encoder.layer.3)")
    ap.add_argument("--plot", metavar="PNG", help="draw the last step's measured timeline here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()

    model = models.build(args.model, seed=0).to(device)
    batch = models.preset_batch(args.model, args.batch, args.seq, padding=args.padding,
                                label_density=args.label_density, device=device)
    info = SCHEDULE_INFO[args.schedule]
    v = args.stages_per_rank or (1 if info.placement == "single" else 2)
    if args.split_at:
        pipe = fxtrain.split(model, example_kwargs=batch, split_points=[args.split_at])
    else:
        pipe = fxtrain.split(model, example_kwargs=batch, num_stages=world * v, balance=args.balance)
    if rank == 0:
        pipe.describe(n_microbatches=args.microbatches)
    runner = pipe.build(args.schedule, n_microbatches=args.microbatches)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)

    times, bubbles, busy, reduces, timelines = [], [], [], [], []
    for step in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = runner.step(**batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        stats = [None] * world
        dist.all_gather_object(stats, runner.last_stats)
        actions = [None] * world
        dist.all_gather_object(actions, runner.last_actions)
        if step > 0:  # step 0 captures each stage's graphs
            timelines.append(measured(args.schedule, args.microbatches, actions, stats, runner.num_stages))
            times.append(elapsed)
            bubbles.append(sum(s["bubble_fraction"] for s in stats) / world)
            busy.append([s["busy_time"] for s in stats])
            reduces.append(max(s["reduce_time"] for s in stats))
        if runner.is_last:
            print(f"step {step}: loss {loss.item():.4f}, {elapsed:.3f} s"
                  f"{' (first step: captures the stage graphs)' if step == 0 else ''}", flush=True)
    if runner.is_last:
        last = runner.modules[runner.num_stages - 1]
        print(f"last stage label_sparsity: {last.capture_info().optimizations.get('label_sparsity')}", flush=True)
    p, m = world, args.microbatches
    if rank == 0:
        step = statistics.median(times)
        bubble = statistics.median(bubbles)
        textbook = info.bubble(p, v, m)
        # The schedule replayed with the measured compute times and free communication: its own
        # bubble on this machine, to compare with what the ranks measured waiting on each other.
        typical = sorted(timelines, key=lambda t: t.makespan)[len(timelines) // 2]
        fwd, bwd, wgt = action_times(typical)
        replay = simulate(fwd, bwd, args.schedule, m, weight=wgt, ranks=p).bubble_fraction
        parts = {k: statistics.median(idle_breakdown(t)[k] for t in timelines) for k in ("schedule", "transfer", "after")}
        print(f"{args.schedule}, {p} ranks x {v} stages, {m} microbatches of {args.batch // m}: "
              f"median step {step:.3f} s; measured bubble {bubble:.1%} (textbook {textbook:.1%} {info.textbook}; "
              f"simulated from stage FLOPs {pipe.simulate(args.schedule, m, ranks=p).bubble_fraction:.1%}, "
              f"from the measured compute times {replay:.1%})", flush=True)
        print(f"measured idle, share of the step: waiting on a peer's compute {parts['schedule']:.1%}; "
              f"transfers and dispatch {parts['transfer']:.1%}; after the last action (shared-parameter "
              f"all-reduce, median {statistics.median(reduces) * 1e3:.0f} ms) {parts['after']:.1%}", flush=True)
        if runner.plan.balance == "measured":
            print("planned (measured at build) per stage F/B/W (ms): " + ", ".join(
                f"{st.forward_time * 1e3:.0f}/{st.backward_time * 1e3:.0f}/{st.weight_time * 1e3:.0f}"
                for st in runner.plan.stages)
                + f"; cuts {runner.plan.cuts}; {runner.plan.how}", flush=True)
        print("per stage F/B/W (ms): " + ", ".join(f"{f * 1e3:.0f}/{b * 1e3:.0f}/{w * 1e3:.0f}"
                                                   for f, b, w in zip(fwd, bwd, wgt)), flush=True)
        # How well each cost predicts the measured stage times: measured ms per unit of cost, per
        # stage (equal numbers across stages = a cost the balancer can trust).
        measured_ms = [(f + b) * 1e3 for f, b in zip(fwd, bwd)]
        for name in ("sparse_flops", "time"):
            per_stage = stage_costs(runner.plan, COST_FUNCTIONS[name])
            print(f"measured ms per G{'FLOP' if name != 'time' else 'FLOP-equivalent'} of {name}, per stage: "
                  + ", ".join(f"{t / (c / 1e9):.1f}" if c else "-" for t, c in zip(measured_ms, per_stage)),
                  flush=True)
        if args.schedule == "zb1p":
            # The schedule's own bubble is the replay's (measured compute, free communication);
            # the rest of the measured bubble is communication and dispatch, including the waits a
            # late transfer causes on the peer (the "waiting on a peer" category counts those).
            comm = max(0.0, bubble - replay)
            print(f"zb1p check: schedule's own bubble (replayed) {replay:.1%} "
                  f"{'<=' if replay <= 1.2 * textbook else '>'} 1.2 x textbook = {1.2 * textbook:.1%}; "
                  f"measured bubble {bubble:.1%} = that + communication and dispatch {comm:.1%} "
                  f"(direct categories: waiting on a peer {parts['schedule']:.1%}, transfers and dispatch "
                  f"{parts['transfer']:.1%}, after {parts['after']:.1%})", flush=True)
        per_rank = [statistics.median(b[r] for b in busy) for r in range(world)]
        print("compute per rank and step (s): " + ", ".join(f"rank {r} {t:.3f}" for r, t in enumerate(per_rank)),
              flush=True)
        if args.plot:
            plot(typical, args.plot, title="measured")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
