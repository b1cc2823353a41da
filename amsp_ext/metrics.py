"""Throughput, MFU and memory measurements shared by `amsp train` and `amsp compare`.

[Note: the peak behind MFU]
MFU = achieved model FLOP/s / peak FLOP/s. We do not trust a datasheet for the peak: each rank
times a dense matmul of the training dtype on its own device, with all ranks running at once
(on a CPU machine the ranks share the cores, so the per-rank peak is what one rank can get while
the others compute too). The peak used is reported beside every MFU.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

__all__ = ["flops_per_token", "matmul_peak_flops", "median_after_warmup", "mfu", "peak_memory_bytes"]


def flops_per_token(hf_config: dict, seq_len: int) -> float:
    """Model FLOPs per trained token by the Megatron-LM count the paper uses, for a Llama-style
    Hugging Face config (the planner's count: real GQA/SwiGLU matrices, attention not halved for
    causality, recomputation not counted)."""
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.planner.step import model_flops_per_token

    return model_flops_per_token(ModelSpec.from_hf_config(hf_config), seq_len)


def mfu(*, flops_per_token: float, tokens_per_gpu_per_s: float, peak_flops: float) -> float:
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return flops_per_token * tokens_per_gpu_per_s / peak_flops


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, *, n: int = 1024,
                      seconds: float = 0.5) -> float:
    """FLOP/s of repeated ``n x n`` matmuls in ``dtype`` on ``device``: the median of timed
    rounds, so that on a shared device it is the share one rank really gets."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # warm-up (kernel selection, allocations)
    sync()
    rates = []
    deadline = time.perf_counter() + seconds
    while not rates or time.perf_counter() < deadline:
        reps = 4
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
    return float(statistics.median(rates))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def median_after_warmup(values: list[float], num_warmup: int = 1) -> float:
    """Median of ``values`` without the first ``num_warmup`` (all of them if too few)."""
    kept = values[num_warmup:] if len(values) > num_warmup else values
    return float(statistics.median(kept))
