"""Whether a sparsity pass pays on the graph's device: the step's host time against its device time.

A GPU computes a step's kernels while the host is still launching the next ones, so a step takes
about the longer of the two: the host's time to dispatch its ops, and the device's time to run
them. A sparsity pass moves both: it skips FLOPs (device time) and adds ops (row gathers, the batch
guard's reads, the attention over real tokens: host time). It pays only where the longer of the two
gets shorter:

    max(host + added_host, device - skipped_device)  <  max(host, device)

So a host-bound step (the host's time the longer) never gains from a pass that adds ops, whatever
it skips; a device-bound one gains until the host becomes the bound. On the eager executor, the
step's first tier and its fallback, for the dense step as dynamo traced it (``StepLoad``):

    host           = forward kernel ops x host seconds per op (per dtype)
    device         = 3 x forward FLOPs / the step's FLOP rate (per dtype)
    added_host     = forward kernel ops the pass adds x host seconds per added op
    skipped_device = 3 x forward FLOPs the pass skips / the same rate

The factor 3: forward plus backward of a contraction. A forward op's host seconds cover the whole
step's share of it: its backward, autograd's bookkeeping, the optimizer (counted per forward op).

The rates (``ACCELERATOR``) were measured on an NVIDIA H200 with torch 2.11.0+cu130, `fxtrain bench`,
2026-11-29 (docs/benchmarks.md, "GPU"), 5 steps, medians:

- host seconds per forward kernel op: float32 93 µs (the demo's eager step, BERT-MLM 16x128: 8.10 ms
  for the 87 kernel ops of its forward graph, host-bound: 549 ops dispatched per step); under
  bfloat16 autocast 148 µs (12.89 ms, the same 87: autocast's casts are host work too);
- host seconds per added op: 233 µs (the demo in float32 with label sparsity and padding
  elimination on, fxtrain's eager executor: 10.90 ms, +2.80 ms for the 12 forward kernel ops they add,
  their variable-length attention op included; 793 ops dispatched per step);
- FLOP rate: 16-bit 220 TFLOP/s (BERT-base MLM 32x512, eager under bf16 autocast: 3 x 3.88 TFLOP of
  forward contractions in 52.65 ms, device-bound: what a whole step sustains, its memory-bound ops
  included, against the data sheet's 989); float32 40 and TF32 100 TFLOP/s are the same fraction of
  the data sheet's 67 and 495, not yet measured.

What the model then says of the measured workloads: the demo (both dtypes) is host-bound, so its
passes are off (under bf16, with padding elimination off and label sparsity on, fxtrain's eager
executor ran at eager's 12.89 ms; in float32, with both on, at 0.74x eager); BERT-base MLM
(host ~32 ms, device ~53 ms) keeps both (1.24x eager on the eager executor, 1.58x compiled).

On the CPU no pass is turned off by this model. Each op's dispatch and its arithmetic share the
same cores, so there is no idle device for the launches to starve. The sparse workloads measured
there (docs/benchmarks.md: demo 5.8-6.1x eager, llama-packed 1.5-2.0x) gain from every pass at
the sizes they train.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class StepLoad:
    """What the dense step asks per step, read off dynamo's forward graph before any pass: its
    kernel ops (``passes.rows.kernel_ops``) and its contractions' FLOPs at the capturing batch."""

    kernels: int
    flops: int


def _precision(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "16-bit"
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "float32"


@dataclass(frozen=True)
class DeviceRates:
    """What an op costs the host and how fast the device does a step's contractions, per precision
    ("float32", "tf32", "16-bit": the dtype of the graph's largest contraction)."""

    name: str
    host_per_op: Dict[str, float]
    host_per_added_op: float
    flops_per_second: Dict[str, float]

    def host(self, kernels: int, dtype: torch.dtype) -> float:
        precision = _precision(dtype)
        return kernels * self.host_per_op["float32" if precision == "tf32" else precision]

    def rate(self, dtype: torch.dtype) -> float:
        return self.flops_per_second[_precision(dtype)]


# Any accelerator the host launches kernels on; the figures are an H200's (module docstring).
ACCELERATOR = DeviceRates("accelerator", host_per_op={"float32": 93e-6, "16-bit": 148e-6}, host_per_added_op=233e-6,
                          flops_per_second={"float32": 40e12, "tf32": 100e12, "16-bit": 220e12})


def rates_for(device_type: str) -> Optional[DeviceRates]:
    """The rates of ``device_type``; None on the CPU, where launches cost no idle device (see above)."""
    return None if device_type == "cpu" else DeviceRates(device_type, ACCELERATOR.host_per_op,
                                                           ACCELERATOR.host_per_added_op, ACCELERATOR.flops_per_second)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2g} µs"


def launch_bound(saved_flops: Optional[int], added_kernels: int, step: Optional[StepLoad],
                 rates: Optional[DeviceRates], dtype: torch.dtype) -> Optional[str]:
    """Why a pass that skips ``saved_flops`` forward FLOPs and adds ``added_kernels`` forward
    kernel ops makes ``step`` slower on the device (None: it pays, or nothing is known)."""
    if rates is None or step is None or saved_flops is None or added_kernels <= 0:
        return None
    rate = rates.rate(dtype)
    host, device = rates.host(step.kernels, dtype), 3 * step.flops / rate
    added, skipped = added_kernels * rates.host_per_added_op, 3 * saved_flops / rate
    before, after = max(host, device), max(host + added, device - skipped)
    if after < before:
        return None
    amount = f"{3 * saved_flops / 1e9:.3g} GFLOP" if 3 * saved_flops >= 1e9 else f"{3 * saved_flops / 1e6:.3g} MFLOP"
    return (f"on {rates.name} the step is bound by the host's launches: its {added_kernels} extra forward kernel "
            f"op(s) add ~{_ms(added)} of host time to the step's ~{_ms(host)}; the {amount} it skips in forward and "
            f"backward save ~{_ms(skipped)} of the device's ~{_ms(device)} ({rate / 1e12:.0f} TFLOP/s, "
            f"{str(dtype).split('.')[-1]}): ~{_ms(after)} per step against ~{_ms(before)}")
