"""The MFU denominator of a run: the device's peak (common/metrics.py [Note: one MFU]).

On a GPU the datasheet figure by device name; on a CPU a measurement every rank makes at once,
so it needs collectives (a barrier and a MAX all-reduce, issued through collectives.py): that is
why it lives in the runtime and common/metrics.py, which the launchers import, only has the table.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from amsp_ext.common.metrics import Peak, table_peak
from amsp_ext.runtime import collectives as C

__all__ = ["device_peak", "measure_shared_peak"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_shared_peak(device: torch.device, dtype: torch.dtype, *, n: int = 1024,
                        reps: int = 4, trials: int = 5, group=None,
                        comm: C.CollectiveContext | None = None) -> float:
    """Per-rank dense-matmul FLOP/s with every rank of ``group`` busy (common/metrics.py [Note: a peak that is stable for the device]): per trial,
    a barrier, ``reps`` ``n x n`` matmuls per rank, rate = work / slowest rank's time; the best
    trial. Without torch.distributed initialised, one process alone; with it, the barrier and
    the all-reduce go through ``comm`` (the caller's collective context, with its timeout)."""
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and comm is None:
        raise ValueError("measure_shared_peak: torch.distributed is initialized, so pass comm= "
                         "(a collectives.CollectiveContext) for its barrier and all-reduce")
    if distributed and group is None:
        group = dist.group.WORLD
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up (kernel selection, allocations)
    _sync(device)
    best = 0.0
    for _ in range(trials):
        if distributed:
            C.barrier(comm, group, name="world")
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if distributed:
            if dist.get_backend(group) == "nccl":
                elapsed = elapsed.to(device)
            C.all_reduce(comm, elapsed, group, name="world", stream=None, op=dist.ReduceOp.MAX,
                         async_op=False)  # blocking, after _sync
        best = max(best, 2.0 * n**3 * reps / float(elapsed.item()))
    return best


def device_peak(device: torch.device, dtype: torch.dtype, *, override_flops: float | None = None,
                group=None, comm: C.CollectiveContext | None = None) -> Peak:
    """The MFU denominator for this run (common/metrics.py [Note: one MFU]). Collective when measured on CPU: every
    rank of ``group`` must call it at the same point."""
    if override_flops is not None:
        if not override_flops > 0:
            raise ValueError(f"--peak-tflops must be positive, got {override_flops / 1e12:g}")
        return Peak(flops=float(override_flops), source="given (--peak-tflops)", measured=False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        table = table_peak(name)
        if table is not None:
            return Peak(flops=table, source=f"datasheet dense bf16/fp16 peak of {name}", measured=False)
    flops = measure_shared_peak(device, dtype, group=group, comm=comm)
    dt = str(dtype).replace("torch.", "")
    return Peak(flops=flops, measured=True,
                source=f"measured on {name}: best of 5 trials of {dt} 1024x1024 matmuls, every "
                       f"rank at once, timed by the slowest rank")
