"""`fxtrain` command line: each subcommand is a pair of functions registered in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .extras import MissingExtra
from .options import options_table

Command = Tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]


def _bench_args(p: argparse.ArgumentParser, steps: int) -> None:
    from .bench import WORKLOADS
    from .models import PRESETS
    # Settings default to None: a named workload fills them, an explicit flag overrides it.
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a named setting of docs/benchmarks.md (see --list-workloads); other flags override it")
    p.add_argument("--list-workloads", action="store_true", help="print the named workloads and exit")
    p.add_argument("--model", default=None, choices=sorted(PRESETS), help="default bert-mlm")
    p.add_argument("--batch", type=int, default=None, help="default 16")
    p.add_argument("--seq", type=int, default=None, help="default 128")
    p.add_argument("--padding", type=float, default=None, help="fraction of positions that are padding (default 0.54)")
    p.add_argument("--label-density", type=float, default=None,
                   help="fraction of positions with a label (MLM; default 0.07)")
    p.add_argument("--padding-side", choices=("right", "left"), default=None)
    p.add_argument("--labels-at-end", type=float, default=None,
                   help="causal LM: only the last FRACTION of each sequence carries labels")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="torch device every mode trains on (cuda, cuda:1, ...); default cpu. The test suite "
                        "takes its device from FXTRAIN_TEST_DEVICE instead")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                   help="run every mode's forward under torch.autocast with this dtype (default: float32)")
    p.add_argument("--flop-ideal", action="store_true",
                   help="also cost eager's and fxtrain's step FLOPs with the profiler and print their ratio")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true")


_SETTINGS = ("model", "batch", "seq", "padding", "label_density", "padding_side", "labels_at_end")


def _config(args: argparse.Namespace, modes: List[str]):
    from .bench import WORKLOADS, BenchConfig
    settings = dict(WORKLOADS[args.workload].settings) if args.workload else {}
    settings.update({k: getattr(args, k) for k in _SETTINGS if getattr(args, k) is not None})
    return BenchConfig(**settings, steps=args.steps, warmup=args.warmup, modes=tuple(modes), seed=args.seed,
                       device=args.device, await_compiles=getattr(args, "await_compiles", False),
                       autocast=args.autocast)


def _run_and_print(args: argparse.Namespace, modes: List[str]) -> int:
    from .bench import flop_ideal_ratio, run_benchmark, workload_table, write_json
    if args.list_workloads:
        print(workload_table())
        return 0
    config = _config(args, modes)
    result = run_benchmark(config, progress=not args.no_progress)
    if args.flop_ideal:
        result.flop_ideal = flop_ideal_ratio(config)
    print(result.table())
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    _bench_args(p, steps=4)


def _demo(args: argparse.Namespace) -> int:
    return _run_and_print(args, ["eager", "fxtrain"])


def _bench_cmd_args(p: argparse.ArgumentParser) -> None:
    from .bench import MODES
    _bench_args(p, steps=5)
    p.add_argument("--modes", default="eager,compile,fxtrain",
                   help=f"comma-separated, from: {', '.join(MODES)}")
    p.add_argument("--await-compiles", action="store_true",
                   help='executor="auto" (fxtrain:auto): wait for the background compiles after the second step, '
                        "untimed, so the timed steps show the compiled tier")


def _bench(args: argparse.Namespace) -> int:
    return _run_and_print(args, [m.strip() for m in args.modes.split(",") if m.strip()])


def _options(args: argparse.Namespace) -> int:
    print(options_table())
    return 0


def _later(module: str, name: str) -> Callable[[Any], Any]:
    """``fxtrain.<module>.<name>``, imported when the subcommand runs: one subcommand's imports
    (the profiler's, the fuzzer's transformers) do not slow the others' start."""
    return lambda arg: getattr(importlib.import_module(f".{module}", __package__), name)(arg)


def _split_args(p: argparse.ArgumentParser) -> None:
    from .models import PRESETS
    p.add_argument("model", choices=sorted(PRESETS), metavar="MODEL", help=f"one of: {', '.join(sorted(PRESETS))}")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stages", type=int, help="number of stages, balanced automatically")
    where.add_argument("--split-points", nargs="+", metavar="MODULE[:after]",
                       help="cut before (or after) these modules, by qualified name")
    p.add_argument("--balance", choices=("flops", "sparse_flops", "time", "params", "measured"), default="flops",
                   help="what --stages balances: training FLOPs, FLOPs after label sparsity, those plus the "
                        "bytes each op moves (time), parameters, or the stages' times measured here")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--plot", metavar="PATH", help="draw the simulated schedule timeline (PNG/SVG/PDF)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev"),
                   default="1f1b", help="schedule to plot (GPipe/1F1B: one stage per rank; the others: two)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches to plot")


def _split(args: argparse.Namespace) -> int:
    from . import models
    from .pipeline import split
    model = models.build(args.model)
    batch = models.preset_batch(args.model, args.batch, args.seq)
    points = None
    if args.split_points:
        points = {p.split(":")[0]: (p.split(":")[1] if ":" in p else "before") for p in args.split_points}
    pipe = split(model, example_kwargs=batch, num_stages=args.stages, split_points=points, balance=args.balance)
    print(f"{args.model}, batch {args.batch} x {args.seq}")
    pipe.describe(n_microbatches=args.microbatches)
    if args.plot:
        try:
            pipe.plot(args.plot, schedule=args.schedule, n_microbatches=args.microbatches)
        except ValueError as e:   # a layout the schedule cannot run
            print(f"fxtrain split: cannot plot {args.schedule}: {e}")
            return 2
        print(f"wrote {args.plot}")
    return 0


# Subcommand -> (add its arguments, run it, one-line help). Later features register here.
COMMANDS: Dict[str, Command] = {
    "demo": (_demo_args, _demo, "train the DESIGN §7 BERT-MLM with eager and with fxtrain side by side"),
    "bench": (_bench_cmd_args, _bench, "eager vs torch.compile vs fxtrain, interleaved in one process"),
    "profile": (_later("profile.command", "add_arguments"), _later("profile.command", "run"),
                "cost a training step on fake tensors: FLOPs, peak memory, per module"),
    "options": (lambda p: None, _options, "print every option with its environment variable and default"),
    "split": (_split_args, _split, "cut a built-in model into pipeline stages and print the plan"),
    "cache": (_later("cache.command", "add_arguments"), _later("cache.command", "run"),
              "list (ls) or delete (clear) the entries of the on-disk graph cache"),
    "fuzz": (_later("fuzz", "add_arguments"), _later("fuzz", "run_command"),
             "train small HF models on edge batches against eager PyTorch (differential fuzzer)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxtrain", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO on the fxtrain logger")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (configure, _, help) in COMMANDS.items():
        configure(sub.add_parser(name, help=help, description=help))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    level = "INFO" if args.verbose else os.environ.get("FXTRAIN_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fxtrain").setLevel(level.upper())
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, MissingExtra) as e:  # bad arguments argparse could not see, or a missing extra:
        print(f"fxtrain {args.command}: error: {e}", file=sys.stderr)   # one line, no traceback
        return 2


if __name__ == "__main__":
    sys.exit(main())
