"""The device's peak FLOP/s, measured with a dense matmul.

[Note: how the peak is measured]
Every rank multiplies two n x n matrices in the run's compute dtype, all ranks at once (so on a
shared CPU each rank sees the share of the cores it gets during training), ``reps`` times after
one warm-up; a rank's peak is ``2 n^3 / (best time)``. MFU divides by the median of the ranks'
peaks. On GPUs this is the usual "achievable dense matmul" peak, below the datasheet number.
"""

from __future__ import annotations

import time

__all__ = ["matmul_flops"]


def matmul_flops(dtype, *, n: int = 1024, reps: int = 5) -> float:
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
