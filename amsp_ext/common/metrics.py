"""Throughput, MFU and memory measurements shared by `amsp train`, `amsp compare` and `amsp tune`.

[Note: one MFU]
MFU = model FLOPs per token (the planner's count: planner/step.py ``model_flops_per_token``)
x tokens per second per GPU / the peak FLOP/s of one GPU. Every command computes it with
``mfu()`` below and a peak from runtime/measure/peak.py ``device_peak()``, and reports the peak and its
source beside it.

[Note: a peak that is stable for the device]
* GPU: the datasheet's dense bf16/fp16 peak of the device, looked up by name in
  ``GPU_PEAK_FLOPS`` (``--peak-tflops`` overrides it; an unknown device is measured as below and
  says so).
* CPU: there is no datasheet figure for "one rank's share of a shared machine", so it is
  measured once per run, before training: every rank runs the same dense matmuls at the same
  time (after a barrier), a trial's rate is the work of one rank divided by the *slowest* rank's
  time (so a rank that got a core to itself while the others waited cannot inflate it), and the
  best of several trials is kept (load from other jobs only ever lowers a trial). The earlier
  figure, a median of short rounds timed by each rank on its own, measured a whole core whenever
  the scheduler gave one rank a time slice alone, and varied 10x between runs (MFU from 8% to
  210% for runs of one plan, FIELD_NOTES "Measuring plans on the lab").
Because the peak is the best a rank achieves on large dense matmuls while every rank computes,
a training run (smaller matmuls, other kernels, communication) cannot exceed it: MFU > 1 means
the peak is wrong, and ``mfu()`` says so in ``mfu_check``.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch

from amsp_ext.planner.defaults import A800_PEAK_FLOPS

__all__ = ["GPU_PEAK_FLOPS", "Peak", "flops_per_token", "matmul_peak_flops", "median_after_warmup",
           "mfu", "mfu_check", "peak_memory_bytes", "table_peak"]

# Dense (no sparsity) bf16/fp16 tensor-core peak per GPU, FLOP/s, from the vendors' datasheets.
# Matched in order against torch.cuda.get_device_name(): more specific names first.
GPU_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("H800", 989e12), ("H20", 148e12), ("B200", 2250e12), ("A100", A800_PEAK_FLOPS), ("A800", A800_PEAK_FLOPS),
    ("A40", 149.7e12), ("A30", 165e12), ("A10G", 70e12), ("A10", 125e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("V100", 125e12), ("T4", 65e12), ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def flops_per_token(hf_config: dict, seq_len: int) -> float:
    """Model FLOPs per trained token by the Megatron-LM count the paper uses, for a Llama-style
    Hugging Face config (the planner's count: real GQA/SwiGLU matrices, attention not halved for
    causality, recomputation not counted)."""
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.planner.step import model_flops_per_token

    return model_flops_per_token(ModelSpec.from_hf_config(hf_config), seq_len)


def mfu(*, flops_per_token: float, tokens_per_gpu_per_s: float, peak_flops: float) -> float:
    """The one MFU (see the Note): model FLOPs per token x tokens/s per GPU / peak per GPU."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return flops_per_token * tokens_per_gpu_per_s / peak_flops


def mfu_check(value: float | None) -> str | None:
    """None when ``value`` is a possible MFU, else a one-line reason (MFU above 100%)."""
    if value is not None and value > 1.0:
        return (f"MFU {value:.0%} exceeds 100%: the peak is wrong for this run (measured under "
                f"other load, or a device table entry too low); not comparable")
    return None


@dataclass(frozen=True, kw_only=True)
class Peak:
    flops: float  # per GPU / rank, FLOP/s
    source: str  # how it was obtained, reported beside every MFU
    measured: bool

    def as_dict(self) -> dict:
        return {"peak_flops_per_gpu": self.flops, "peak_flops_source": self.source,
                "peak_flops_measured": self.measured}


def table_peak(name: str) -> float | None:
    """The datasheet peak of a GPU by its name (``GPU_PEAK_FLOPS``), or None."""
    for key, flops in GPU_PEAK_FLOPS:
        if key.lower() in name.lower():
            return flops
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, *, n: int = 1024,
                      seconds: float = 0.5) -> float:
    """FLOP/s of repeated ``n x n`` matmuls in ``dtype`` on ``device`` by this process alone,
    best of timed rounds: the device's compute rate (comparisons/gpu_check.py). Not an MFU
    denominator on a shared CPU: use runtime/measure/peak.py ``device_peak``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    rates = []
    deadline = time.perf_counter() + seconds
    while not rates or time.perf_counter() < deadline:
        reps = 4
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
    return float(max(rates))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def median_after_warmup(values: list[float], num_warmup: int = 1) -> float:
    """Median of ``values`` without the first ``num_warmup`` (all of them if too few)."""
    kept = values[num_warmup:] if len(values) > num_warmup else values
    return float(statistics.median(kept))
