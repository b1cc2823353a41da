"""The CPU precision check every command shares (runtime/measure/cpu_bf16.py [Note: why the
flags alone do not decide]): on a CPU without fast bf16, a default of bf16 becomes fp32 (said in
one line) and an explicit bf16 runs with a warning that quotes the measured slowdown."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["cpu_precision"]


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_precision(requested: str | None, default: str, *, flag: str = "--precision",
                  say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> str:
    """The precision to run: ``requested`` (an explicit flag) or ``default``, checked against
    this CPU when it is bf16."""
    precision = requested or default
    if precision != "bf16" or _on_gpu():
        return precision
    from amsp_ext.runtime.measure.cpu_bf16 import probe_cpu_bf16

    probe = probe_cpu_bf16()
    if probe.fast:
        return precision
    if requested is None:
        say(f"precision: fp32, not the default bf16: this CPU has no native bf16 "
            f"({probe.describe()}); pass {flag} bf16 to run bf16 anyway")
        return "fp32"
    say(f"warning: {flag} bf16 on a CPU without native bf16 ({probe.describe()}): every "
        f"step runs about {probe.slowdown:.0f}x slower than in fp32")
    return precision
