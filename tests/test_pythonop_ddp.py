"""A Function that all-reduces in its forward, under DistributedDataParallel, in 2 gloo processes.

``fxtrain.is_capturing()`` lets the Function skip the collective in what is not a real run: dynamo's
trace of its forward, which learns the outputs' shapes without running it, sees it true; every real
run, the capturing step's included, all-reduces. ``DDP(TrainModule(model))`` must match ``DDP(model)`` step by step.
"""
import gc
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxtrain

WORLD = 2
TIMEOUT_S = 120

# Inherently CPU: DDP over gloo in 2 CPU processes; FXTRAIN_TEST_DEVICE does not apply.
pytestmark = pytest.mark.cpu_only("DDP over gloo in 2 CPU processes")


class AllReduceSum(torch.autograd.Function):
    """Sums activations over ranks in forward (a tensor-parallel style 'reduce'); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        if not fxtrain.is_capturing():
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class Net(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.group = group  # a process group, passed to the Function by reference

    def forward(self, x):
        h = AllReduceSum.apply(torch.tanh(self.a(x)), self.group)
        return self.b(h).pow(2).mean()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_and_compare(rank: int, group: dist.ProcessGroup, out_dir: str) -> None:
    """Everything that holds a DDP Reducer lives here, so that the Reducers die before the process
    groups: a Reducer destroyed last destroys its ProcessGroupGloo while holding the GIL, and torch
    deadlocks if a gloo worker thread needs the GIL at that moment (pytorch/pytorch#56297)."""
    torch.manual_seed(0)
    model = Net(group)
    torch.manual_seed(0)
    ref_model = Net(group)
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", dynamic=True))
    ddp, ref = DDP(tm), DDP(ref_model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1000 + rank)  # each rank its own data
    for b in (3, 5, 2):
        x = torch.randn(b, 4)
        out, r = ddp(x), ref(x)
        torch.testing.assert_close(out, r, atol=1e-6, rtol=1e-5)
        out.backward(); r.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            # DDP averaged them over ranks: equal grads also mean the same all-reduces ran
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks) == (1, 0), (info.graphs, info.graph_breaks)
    assert info.python_ops == [f"{__name__}.AllReduceSum"], info.python_ops
    # the ranks' parameters stayed in sync, and equal eager's
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def _worker(rank: int, port: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        group = dist.new_group(list(range(WORLD)))
        _train_and_compare(rank, group, out_dir)
        gc.collect()  # DDP's Reducers, held in reference cycles, go while the groups are alive
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.ok"), "w") as f:
            f.write("ok")
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_of_train_module_matches_ddp_of_model(tmp_path):
    ctx = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                errors = {p.name: p.read_text() for p in tmp_path.glob("*.err")}
                pytest.fail(f"the 2 DDP workers did not finish within {TIMEOUT_S} s; errors so far: {errors}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == ["rank0.ok", "rank1.ok"]
