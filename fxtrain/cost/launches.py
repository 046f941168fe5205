"""Whether a sparsity pass pays on the graph's device: the FLOPs it skips against the kernels it adds.

A GPU computes a step's kernels while the host is still launching the next ones. A step whose host
spends longer launching than the device spends computing is host-bound, and there a rewrite that
adds launches (row gathers, the batch guard's reads, per-sequence attention) to skip arithmetic
the device would have done in less time makes the step slower. Issue 17's demo on an H100 was that
case: 2,805 launches in 5 steps, 259 ms of host time against 12 ms of GPU time, 0.26x eager.

The sparsity passes measure what they skip on the capturing batch (``PassReport.saved_flops``:
forward FLOPs) and ``run_passes`` counts the kernels each adds to the forward
(``PassReport.added_kernels``). A pass in ``"auto"`` is turned off for the capture when

    2 * added_kernels * seconds_per_launch  >  3 * saved_flops / flops_per_second(dtype)

The factors: the backward launches about one kernel per forward kernel the pass adds (a gather's
backward is a scatter); a contraction's backward is two of its forward's size. This is the eager
executor's cost, the step's first tier and its fallback: the compiled tier fuses some of the added
kernels, so the model is conservative there.

On the CPU no pass is turned off by this model. Each op's dispatch and its arithmetic share the
same cores, so there is no idle device for the launches to starve. The sparse workloads measured
there (docs/benchmarks.md: demo 5.8-6.1x eager, llama-packed 1.5-2.0x) gain from every pass at
the sizes they train.

The accelerator figures are estimates, not measurements of this project: the host cost of one
eager op on CUDA (Python dispatch to kernel launch, ~5-10 µs in the PyTorch profiler's traces) and a
sustained matmul rate of H100/H200-class cards (float32 ~40 TFLOP/s of the data sheet's 67, TF32 ~200
and 16-bit ~400 of 495/989). ``bench/gpu_report.sh`` measures the kernels per step and the step
times these should predict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class DeviceRates:
    """What one launched kernel costs the host, and how fast the device does contractions."""

    name: str
    seconds_per_launch: float
    flops_per_second: Dict[str, float]    # "float32", "tf32", "16-bit"

    def rate(self, dtype: torch.dtype) -> float:
        if dtype in (torch.float16, torch.bfloat16):
            return self.flops_per_second["16-bit"]
        if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
            return self.flops_per_second["tf32"]
        return self.flops_per_second["float32"]


# Any accelerator the host launches kernels on; the figures are an H100/H200's (the lent machines).
ACCELERATOR = DeviceRates("accelerator", 8e-6, {"float32": 40e12, "tf32": 200e12, "16-bit": 400e12})


def rates_for(device_type: str) -> Optional[DeviceRates]:
    """The rates of ``device_type``; None on the CPU, where launches cost no idle device (see above)."""
    return None if device_type == "cpu" else DeviceRates(device_type, ACCELERATOR.seconds_per_launch,
                                                           ACCELERATOR.flops_per_second)


def launch_bound(saved_flops: Optional[int], added_kernels: int, rates: Optional[DeviceRates],
                 dtype: torch.dtype) -> Optional[str]:
    """Why a pass that skips ``saved_flops`` forward FLOPs and adds ``added_kernels`` forward
    kernels costs more than it saves on the device (None: it pays, or nothing is known)."""
    if rates is None or saved_flops is None or added_kernels <= 0:
        return None
    launches = 2 * added_kernels * rates.seconds_per_launch
    compute = 3 * saved_flops / rates.rate(dtype)
    if launches <= compute:
        return None
    skipped = 3 * saved_flops
    amount = f"{skipped / 1e9:.3g} GFLOP" if skipped >= 1e9 else f"{skipped / 1e6:.3g} MFLOP"
    return (f"on {rates.name} its {2 * added_kernels} extra kernel launches per step (~{launches * 1e6:.3g} µs of "
            f"host time) cost more than the {amount} it skips in forward and backward (~{compute * 1e6:.2g} µs at "
            f"{rates.rate(dtype) / 1e12:.0f} TFLOP/s, {str(dtype).split('.')[-1]})")
