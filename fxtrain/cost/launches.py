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

The same weighing chooses how the eager executor runs a step's backward (``replay_pays``; the
runtime's modes, runtime/runner.py): PyTorch's C++ engine over the torch-level graph (the "autograd"
mode), or fxtrain's aten backward graph replayed from Python (the "graph" mode), which is the only
one its backward passes (the one-hot of cross-entropy, a tied embedding's zero-filled gradient) can
rewrite. Replaying costs the host more per op than the engine: 4.6-5.6 µs a backward op on the CPU
machine (one thread; tiny BERT-, GPT-2- and Llama-style models, 173-303 backward ops, whose
arithmetic is negligible: the graph mode's step minus the autograd mode's, over the backward graph's
ops; this host's eager step costs 95 µs per forward kernel op where the H200's host took 93, so the
figure carries), 5 µs in ``host_per_replayed_op``. What a backward pass saves is memory traffic:
on an accelerator it runs at the device's memory bandwidth (4 TB/s in ``bytes_per_second``: the
H200's data sheet gives 4.8, not measured), so the graph mode pays only where the step is
device-bound and stays so after the replay's host time is added:

    max(host + replayed ops x host per replayed op, device - saved bytes / bandwidth)  <  max(host, device)

with host and device the step's after the forward passes that stay on. The demo on an accelerator is
host-bound (~8.1 ms against ~3.5 ms): its backward passes' 805 MiB would save ~0.2 ms of device time,
and replaying its 396 backward ops would add ~2 ms of host time, so it runs the autograd mode.

On the CPU the host's dispatch and the arithmetic share the same cores, so the two add up rather
than overlap, and a pass pays where the host work it adds takes less than the arithmetic it skips:

    added host  <  3 x forward FLOPs the pass skips / the CPU's FLOP rate

The added host work is the kernel ops it adds (``host_per_added_op``) and, above all, its
attention: the CPU runs variable-length attention one kernel call per run of equal lengths
(runtime/varlen_attention.py), each with its views and copies, where the padded step made one call.
Measured on this project's 2-core CPU machine (torch 2.13.0, 2 threads, 2026-12-07,
``runtime/varlen_attention`` forward and backward through autograd against SDPA's on the padded
``[sequences, heads, longest, 16]``, both at sizes where the kernels cost their fixed part): 470 µs
for one run and ~140 µs more per run (616, 885, 1463, 2403 µs for 2, 4, 8, 16 runs of 8-23 tokens;
500 to 2794 µs at 32-47 tokens) against SDPA's 135-250 µs, so ~200 µs a call
(``host_per_attention_call``) and 140 µs a run (``host_per_attention_run``); an added gather,
forward and backward, ~60 µs (``index_select`` of 200 of 512 rows: 130 µs against 68 µs for the
same step without it). The FLOP rate is 80 GFLOP/s a thread (fp32 ``mm`` of 2048 x 256 x 256 up
to 4096 x 768 x 3072: 149-179 GFLOP/s on 2 threads; 64-92 at 256 x 32 x 32, where a step of tiny
matmuls skips less time than its FLOPs say: the model then keeps a pass it could have turned off).
What it decides: a 12-layer BERT of hidden 32 at 4 x 64 (50% padding) skips ~1 ms of arithmetic
with padding elimination and adds 12 attention calls of 4 runs, ~9 ms: off (measured: 26.5 ms a
step with it against 21.2 ms without, eager 25.2 ms; `auto` executor); its label sparsity stays on.
The bench's CPU workloads keep every pass with a margin of about 10x or more (the demo's padding
elimination skips 6.9 GFLOP forward, ~130 ms of arithmetic, for ~10 ms of attention runs; gpt2-sft's
5.1 GFLOP, ~96 ms, for 4 attentions of 16 runs).

On the CPU the replay and the arithmetic share the cores too, and a byte of memory traffic a
backward pass removes is worth ~0.1-0.2 ns against the replay's ~5 µs an op
(``BYTES_PER_BACKWARD_OP``, 50 kB: bench/overhead.py's tiny GPT-2, whose passes save 1.8 MiB over
183 backward ops, ran 0.90x eager in the graph mode and ~1.0x in the autograd mode; the demo's
90 MiB over 325 ops gains from the graph mode: 253 against 266 ms a step, medians of 10 interleaved
steps, 375c680).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

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
    host_per_replayed_op: float = 5e-6      # a backward op replayed from Python, beyond the C++ engine's
    bytes_per_second: float = 4e12          # the device's memory bandwidth
    # The CPU's: host work and arithmetic on the same cores (they add up), and the per-run attention.
    shares_cores: bool = False
    host_per_attention_call: float = 0.0
    host_per_attention_run: float = 0.0

    def host(self, kernels: int, dtype: torch.dtype) -> float:
        precision = _precision(dtype)
        return kernels * self.host_per_op["float32" if precision == "tf32" else precision]

    def rate(self, dtype: torch.dtype) -> float:
        return self.flops_per_second[_precision(dtype)]


# Any accelerator the host launches kernels on; the figures are an H200's (module docstring).
ACCELERATOR = DeviceRates("accelerator", host_per_op={"float32": 93e-6, "16-bit": 148e-6}, host_per_added_op=233e-6,
                          flops_per_second={"float32": 40e12, "tf32": 100e12, "16-bit": 220e12})


# The CPU's, per thread (module docstring): rates_for scales the FLOP rate by torch's thread count.
CPU = DeviceRates("the cpu", host_per_op={"float32": 95e-6, "16-bit": 95e-6}, host_per_added_op=60e-6,
                  flops_per_second={"float32": 80e9, "tf32": 80e9, "16-bit": 80e9}, shares_cores=True,
                  host_per_attention_call=200e-6, host_per_attention_run=140e-6)


def rates_for(device_type: str) -> DeviceRates:
    """The rates of ``device_type``: the CPU's at this process's thread count, else an accelerator's."""
    if device_type == "cpu":
        threads = torch.get_num_threads()
        return dataclasses.replace(CPU, flops_per_second={k: v * threads for k, v in CPU.flops_per_second.items()})
    return dataclasses.replace(ACCELERATOR, name=device_type)


@dataclass(frozen=True)
class DeviceStep:
    """A capture's step as this model sees it on its device: the device's rates, the step's load
    after the forward passes that stay on, and the dtype its contractions run in."""

    rates: DeviceRates
    load: StepLoad
    dtype: torch.dtype


# The CPU's exchange of replayed backward ops against the memory traffic backward passes remove
# (module docstring).
BYTES_PER_BACKWARD_OP = 50_000


def _ms(seconds: float) -> str:
    value, unit = (seconds * 1e3, "ms") if seconds >= 1e-3 else (seconds * 1e6, "µs")
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.2g} {unit}"   # 2 digits, no exponent


def launch_bound(saved_flops: Optional[int], added_kernels: int, step: Optional[StepLoad],
                 rates: Optional[DeviceRates], dtype: torch.dtype, attention_calls: int = 0,
                 attention_runs: int = 0) -> Optional[str]:
    """Why a pass that skips ``saved_flops`` forward FLOPs and adds ``added_kernels`` forward
    kernel ops (and ``attention_calls`` variable-length attentions making ``attention_runs`` kernel
    calls on a per-run route) makes ``step`` slower on the device (None: it pays, or nothing is known)."""
    if rates is not None and rates.shares_cores and saved_flops is not None:
        return _cpu_bound(saved_flops, added_kernels, rates, dtype, attention_calls, attention_runs)
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


def _cpu_bound(saved_flops: int, added_kernels: int, rates: DeviceRates, dtype: torch.dtype,
               attention_calls: int, attention_runs: int) -> Optional[str]:
    """The CPU's rule (module docstring): the host work added against the arithmetic skipped."""
    rate = rates.rate(dtype)
    added = (added_kernels * rates.host_per_added_op + attention_calls * rates.host_per_attention_call
             + attention_runs * rates.host_per_attention_run)
    skipped = 3 * saved_flops / rate
    if added <= 0 or added < skipped:   # fewer ops than before (a pass that only removes work) pays too
        return None
    amount = f"{3 * saved_flops / 1e9:.3g} GFLOP" if 3 * saved_flops >= 1e9 else f"{3 * saved_flops / 1e6:.3g} MFLOP"
    what = [f"{added_kernels} extra forward kernel op(s)"] if added_kernels > 0 else []
    if attention_calls:
        per_run = " (one per run of equal lengths)" if attention_runs > attention_calls else ""
        what.append(f"{attention_calls} attention(s) run as {attention_runs} kernel calls{per_run}")
    return (f"on {rates.name} the host's work and the arithmetic share the cores: {' and '.join(what)} "
            f"add ~{_ms(added)} of host work a step; the {amount} it skips in forward and backward take "
            f"~{_ms(skipped)} at {rate / 1e9:.0f} GFLOP/s")


def replay_pays(saved_bytes: int, replayed_ops: int, device: Optional[DeviceStep]) -> Tuple[bool, str]:
    """Whether the eager executor should replay the aten backward graph (``replayed_ops`` ops,
    through which fxtrain's backward passes save ``saved_bytes`` of memory traffic) rather than let
    PyTorch's engine run the backward; and why. ``device`` None or the CPU's: the CPU's rule (module
    docstring)."""
    if not saved_bytes:
        return False, "no backward pass applies: PyTorch's engine runs the backward"
    mib = f"{saved_bytes / 2 ** 20:.1f} MiB"
    if device is None or device.rates.shares_cores:
        if saved_bytes > replayed_ops * BYTES_PER_BACKWARD_OP:
            return True, (f"backward passes save {mib} of memory traffic, more than replaying "
                          f"{replayed_ops} backward ops costs")
        return False, (f"backward passes would save {saved_bytes / 2 ** 20:.2f} MiB, less than replaying "
                       f"{replayed_ops} backward ops costs")
    rates, load, dtype = device.rates, device.load, device.dtype
    host, busy = rates.host(load.kernels, dtype), 3 * load.flops / rates.rate(dtype)
    added, saved = replayed_ops * rates.host_per_replayed_op, saved_bytes / rates.bytes_per_second
    before, after = max(host, busy), max(host + added, busy - saved)
    what = (f"replaying {replayed_ops} backward ops adds ~{_ms(added)} to the host's ~{_ms(host)} per step, the "
            f"{mib} of memory traffic the backward passes remove take ~{_ms(saved)} of the device's ~{_ms(busy)} "
            f"on {rates.name}: ~{_ms(after)} per step against ~{_ms(before)}")
    return after < before, what
