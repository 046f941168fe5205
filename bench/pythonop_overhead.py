"""Per-call cost of a custom autograd.Function: eager ``Function.apply`` vs the same call as a
PythonOp inside a TrainModule graph (``fxtrain``: AOTAutograd's graphs replayed op by op, the
backward through ``python_op_backward``) and inside the dynamo-level graph run directly under eager
autograd (``autograd``: ``python_op``'s Autograd kernel builds the gradient).

``inductor``: the TrainModule with ``Options(executor="inductor")``, whose compiled aten graphs call
the op pair. A tiny Function (``x * 2`` / ``g * 2`` on a small tensor) makes the per-call bookkeeping
the whole cost. Each model chains the Function ``calls`` times; the per-call figure is the step-time slope
between the long chain and a chain of one, so fixed per-step costs (graph launch, optimizer-free
loss.backward()) cancel out. Eager and fxtrain run interleaved round by round in one process, in
alternating order, because the machine is shared and noisy: compare the columns of one run.
``--clock cpu`` times the thread's CPU time instead of the wall clock (one torch thread): on a
machine that other processes load, waiting for a core then does not count.

    python bench/pythonop_overhead.py [--calls 33] [--rounds 15] [--steps 40] [--size 8] [--clock cpu]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

import fxtrain


class Tiny(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class Chain(nn.Module):
    def __init__(self, calls: int, size: int) -> None:
        super().__init__()
        self.calls = calls
        self.w = nn.Parameter(torch.full((size,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        for _ in range(self.calls):
            h = Tiny.apply(h)
        return h.sum()


class AutogradChain(nn.Module):
    """Chain with its own forward code object (dynamo's cache is per code object)."""

    def __init__(self, calls: int, size: int) -> None:
        super().__init__()
        self.calls = calls
        self.w = nn.Parameter(torch.full((size,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        for _ in range(self.calls):
            h = Tiny.apply(h)
        return h.sum()


class DynamoGraph(nn.Module):
    """The dynamo-level graph, Function.apply routed to PythonOps as fxtrain captures it, run as is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from fxtrain.pythonop import routing
        self.model = model
        self.python_ops = 0
        self._routing = routing
        self._compiled = torch.compile(model, backend=self._backend, fullgraph=True, dynamic=False)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        calls = sum(1 for n in gm.graph.nodes if n.target is torch.ops.fxtrain.python_op)
        self.python_ops = max(self.python_ops, calls)   # one graph per grad mode
        return gm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._routing(lambda name: None):
            return self._compiled(x)


def _train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).backward()
    model.zero_grad(set_to_none=True)


def _forward_no_grad(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def _time(fn: Callable[[nn.Module, torch.Tensor], None], model: nn.Module, x: torch.Tensor, steps: int,
          clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(steps):
        fn(model, x)
    return (clock() - start) / steps


def measure(calls: int, rounds: int, steps: int, size: int, clock: Callable[[], float] = time.perf_counter
            ) -> Dict[str, Dict[str, float]]:
    x = torch.randn(size, size)
    models: Dict[str, Dict[int, nn.Module]] = {
        "eager": {n: Chain(n, size) for n in (1, calls)},
        "fxtrain": {n: fxtrain.TrainModule(Chain(n, size), fxtrain.Options(fallback="raise")) for n in (1, calls)},
        "inductor": {n: fxtrain.TrainModule(Chain(n, size), fxtrain.Options(fallback="raise", executor="inductor"))
                     for n in (1, calls)},
        "autograd": {n: DynamoGraph(AutogradChain(n, size)) for n in (1, calls)},
    }
    kinds = {"train step": _train_step, "forward, no_grad": _forward_no_grad}
    samples: Dict[str, Dict[str, List[float]]] = {k: {m: [] for m in models} for k in kinds}
    for kind, fn in kinds.items():  # warm up: capture every graph before timing
        for chains in models.values():
            for model in chains.values():
                for _ in range(3):
                    fn(model, x)
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(list(models)))
        for kind, fn in kinds.items():
            for mode in order:
                long_chain = _time(fn, models[mode][calls], x, steps, clock)
                short_chain = _time(fn, models[mode][1], x, steps, clock)
                samples[kind][mode].append((long_chain - short_chain) / (calls - 1))
    info = models["fxtrain"][calls].capture_info()
    assert info.graph_breaks == 0 and info.python_ops, "the Function must be a PythonOp in one graph"
    assert models["autograd"][calls].python_ops == calls, "the Function must be a PythonOp in the dynamo graph"
    return {kind: {mode: statistics.median(v) * 1e6 for mode, v in per_mode.items()}
            for kind, per_mode in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=33, help="Function calls in the long chain (>= 2)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40, help="steps per timing sample")
    parser.add_argument("--size", type=int, default=8, help="the tensor is size x size")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (torch.set_num_threads(1)), blind to other processes' load")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    logging.getLogger("fxtrain").setLevel(logging.WARNING)
    torch.manual_seed(0)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    result = measure(args.calls, args.rounds, args.steps, args.size, clock)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tensor {args.size}x{args.size}, "
          f"{args.calls} vs 1 chained calls, median of {args.rounds} interleaved rounds x {args.steps} steps, "
          f"{args.clock} clock")
    print(f"{'per Function call':<20} {'eager us':>10} {'fxtrain us':>11} {'extra us':>9} "
          f"{'inductor us':>12} {'extra us':>9} {'autograd us':>12} {'extra us':>9}")
    for kind, per_mode in result.items():
        e, f, i, a = per_mode["eager"], per_mode["fxtrain"], per_mode["inductor"], per_mode["autograd"]
        print(f"{kind:<20} {e:>10.1f} {f:>11.1f} {f - e:>9.1f} {i:>12.1f} {i - e:>9.1f} {a:>12.1f} {a - e:>9.1f}")


if __name__ == "__main__":
    main()
