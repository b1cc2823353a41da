"""Is bf16 fast on this CPU? A capability check, confirmed by a short timed matmul.

[Note: why the flags alone do not decide]
Without AVX512_BF16 or AMX-BF16, oneDNN emulates bf16 matmuls through fp32 conversions, about
10x slower than fp32 (comparisons/results/design_history.md, "CPU bf16"): a bf16 job must not
run that slowly without a word. The CPU flags say whether the instructions exist, not whether
the torch build in use reaches them (and a VM may hide or show flags the host lacks), so the
answer is the flags *and* a timing of both dtypes: 256^3, best of 3, single thread - about 50 ms
on an emulating CPU, a few ms on a native one. The measured ratio is what a warning quotes.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

__all__ = ["SLOW_RATIO", "Bf16Probe", "probe_cpu_bf16"]

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
SLOW_RATIO = 1.5  # bf16 matmul time / fp32 above which bf16 counts as "not native"
# tests: force the answer ("slow" / "fast") without depending on the machine
FORCE_ENV = "AMSP_CPU_BF16"


@dataclass(frozen=True)
class Bf16Probe:
    flags: tuple[str, ...]  # which of NATIVE_FLAGS /proc/cpuinfo lists
    slowdown: float  # bf16 matmul time / fp32 matmul time (timed here)
    fast: bool

    def describe(self) -> str:
        flags = ", ".join(self.flags) if self.flags else f"none of {', '.join(NATIVE_FLAGS)}"
        return f"a bf16 matmul takes {self.slowdown:.1f}x the fp32 time; CPU flags: {flags}"


def _flags() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(x for x in NATIVE_FLAGS if x in have)
    except OSError:
        pass
    return ()


def _time_matmul(dtype: torch.dtype, n: int = 256, reps: int = 3) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=1)
def probe_cpu_bf16() -> Bf16Probe:
    forced = os.environ.get(FORCE_ENV)
    if forced in ("slow", "fast"):
        return Bf16Probe(flags=(), slowdown=10.0 if forced == "slow" else 1.0, fast=forced == "fast")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratio = _time_matmul(torch.bfloat16) / _time_matmul(torch.float32)
    finally:
        torch.set_num_threads(threads)
    flags = _flags()
    return Bf16Probe(flags=flags, slowdown=ratio, fast=bool(flags) and ratio < SLOW_RATIO)
