"""``fxtrain profile MODEL``: the profiler from the command line (built-in models or a factory file)."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
from typing import Any, Dict, Tuple

import torch

from ..options import parse_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..models import PRESETS
    p.add_argument("model", help=f"a built-in model ({', '.join(sorted(PRESETS))}) or path/to/file.py:factory, "
                                 f"where factory(batch=, seq=) returns (model, inputs) with inputs a dict of "
                                 f"keyword inputs or a tuple of positional ones")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--optimizer", default=None, help="adamw, adam, sgd, adagrad or rmsprop (default: none)")
    p.add_argument("--budget", default=None, help="memory budget, e.g. 80GiB: also report the largest batch that fits, "
                                                  "without and with recomputation (Options.memory_budget's plan)")
    p.add_argument("--plot", metavar="PNG", default=None, help="write the per-module and memory plot here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--no-optimizations", action="store_true", help="cost eager PyTorch instead of fxtrain's graph")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--keep-outputs", dest="keep_outputs", action="store_true", default=True,
                      help="the loop holds the model's outputs through backward: out = model(**b); "
                           "out.loss.backward() (default)")
    loop.add_argument("--drop-outputs", dest="keep_outputs", action="store_false",
                      help="the loop keeps only the loss: loss = model(**b).loss; loss.backward() "
                           "(HF Trainer); the peak is lower by what the outputs hold (the logits)")
    p.add_argument("--padding", type=float, default=0.0, help="built-in models: fraction of padding positions")
    p.add_argument("--label-density", type=float, default=1.0, help="built-in MLM models: fraction of labelled positions")
    p.add_argument("--sample-batch", type=int, default=8,
                   help="built-in models with optimizations: rows of real token ids the densities are read "
                        "from; the step is then costed at --batch with those densities")
    p.add_argument("--cache-dir", default=None,
                   help="on-disk cache of captured graphs (as Options.cache_dir / FXTRAIN_CACHE_DIR): a later run "
                        "of the same model, inputs and options loads the graphs instead of capturing")
    p.add_argument("--device", default="cpu",
                   help="built-in models: the device the step is costed for (cuda, ...; default cpu): its kernels "
                        "and FLOPs, the launch model's rates. The weights stay on the meta device; only the "
                        "sample batch the capture reads is made there. A factory's model and inputs keep their own")
    p.add_argument("--no-progress", action="store_true")


def _load_factory(spec: str, batch: int, seq: int) -> Tuple[torch.nn.Module, Tuple[Any, ...], Dict[str, Any]]:
    path, _, name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r} (expected path/to/file.py:factory)")
    module_spec = importlib.util.spec_from_file_location(f"fxtrain_profile_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    assert module_spec.loader is not None
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if factory is None:
        raise ValueError(f"{path} has no {name!r}")
    made = factory(batch=batch, seq=seq)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"{spec} must return (model, inputs); got {type(made).__name__}")
    model, inputs = made
    if isinstance(inputs, dict):
        return model, (), inputs
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    return model, tuple(inputs), {}


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from ..models import PRESETS, preset_batch
    from ..options import Options
    from .entry import profile
    from .inputs import fake_inputs

    optimizations = not args.no_optimizations
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"--device {args.device}: {e}") from None
    if device.type == "meta":
        raise ValueError("--device meta: the step is costed without allocating anyway; name the device it runs on")
    if args.model in PRESETS:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:   # a torch without CUDA asserts
            raise ValueError(f"--device {args.device}: {str(e).strip().splitlines()[0]}") from None
    stages = 3 + 2 * bool(args.budget) + bool(args.plot)
    with tqdm(total=stages, disable=args.no_progress, desc="build model", leave=False) as bar:
        if args.model in PRESETS:
            preset = PRESETS[args.model]
            with torch.device("meta"):   # random weights are not needed to cost a step: none are made
                model = preset.build()
            call_args: Tuple[Any, ...] = ()
            if optimizations:
                first = min(args.batch, args.sample_batch)
                call_kwargs: Dict[str, Any] = preset_batch(args.model, first, args.seq, padding=args.padding,
                                                           label_density=args.label_density, device=device)
            else:
                sample = preset_batch(args.model, 1, args.seq)
                call_kwargs = fake_inputs(**{k: ((args.batch,) + tuple(v.shape[1:]), v.dtype) for k, v in sample.items()})
        elif ":" in args.model:
            model, call_args, call_kwargs = _load_factory(args.model, args.batch, args.seq)
        else:
            raise ValueError(f"unknown model {args.model!r}; built-in: {', '.join(sorted(PRESETS))}, "
                             f"or path/to/file.py:factory")
        bar.update(1)
        bar.set_description("capture and fake step" if optimizations else "fake step")
        options = Options(cache_dir=args.cache_dir) if args.cache_dir else None
        # Meta weights with shapes-only (meta) inputs are costed on torch's default device; with a
        # sample batch, on the batch's device (no device mode then: dynamo captures under none).
        shapes_only = args.model in PRESETS and not optimizations and device.type != "cpu"
        with torch.device(device) if shapes_only else contextlib.nullcontext():
            report = profile(model, *call_args, optimizer=args.optimizer, optimizations=optimizations,
                             options=options, keep_outputs=args.keep_outputs, **call_kwargs)
        bar.update(1)
        bar.set_description(f"scale to batch {args.batch}")
        if report.batch is not None and report.batch != args.batch and args.model in PRESETS:
            report = report.at_batch(args.batch)
        report.model = args.model
        bar.update(1)
        if args.budget:
            bar.set_description("fit the memory budget")
            report.max_batch(parse_bytes(args.budget))
            bar.update(1)
            if optimizations:
                bar.set_description("fit the memory budget, recomputing")
                try:
                    report.max_batch_recomputed(parse_bytes(args.budget))
                except RuntimeError as e:   # costed eagerly, static sizes: say why, keep the report
                    logging.getLogger("fxtrain").warning("fxtrain profile: no largest batch with recomputation: %s", e)
            bar.update(1)
        if args.plot:
            bar.set_description("plot")
            report.plot(args.plot)
            bar.update(1)
    if args.json:
        print(report.to_json())
    else:
        print(report)
        if args.plot:
            print(f"\nwrote {args.plot}")
    return 0
