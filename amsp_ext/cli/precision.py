"""The CPU precision check every command shares (runtime/measure/cpu_bf16.py [Note: why the
flags alone do not decide]): on a CPU without fast bf16, a default of bf16 becomes fp32 (said in
one line) and an explicit bf16 runs with a warning that quotes the measured slowdown."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["cpu_precision", "warn_if_slow_bf16"]


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _say(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _slow_bf16_probe():
    """The probe when bf16 is slow here (a CPU run without native bf16), else None."""
    if _on_gpu():
        return None
    from amsp_ext.runtime.measure.cpu_bf16 import probe_cpu_bf16

    probe = probe_cpu_bf16()
    return None if probe.fast else probe


def warn_if_slow_bf16(precision: str, *, flag: str = "--precision",
                      say: Callable[[str], None] = _say) -> None:
    """A precision that is already decided (given on the command line, or a config's default
    that is not bf16) runs as it is; bf16 on a CPU without fast bf16 gets one warning that
    quotes the measured slowdown."""
    if precision != "bf16":
        return
    probe = _slow_bf16_probe()
    if probe is not None:
        say(f"warning: {flag} bf16 on a CPU without native bf16 ({probe.describe()}): every "
            f"step runs about {probe.slowdown:.0f}x slower than in fp32")


def cpu_precision(requested: str | None, default: str, *, flag: str = "--precision",
                  say: Callable[[str], None] = _say) -> str:
    """The precision to run: ``requested`` (an explicit flag, None when not given) as it is
    (``warn_if_slow_bf16``), else ``default``, which a CPU without fast bf16 turns from bf16
    into fp32 (said in one line)."""
    if requested is not None:
        warn_if_slow_bf16(requested, flag=flag, say=say)
        return requested
    if default != "bf16":
        return default
    probe = _slow_bf16_probe()
    if probe is None:
        return default
    say(f"precision: fp32, not the default bf16: this CPU has no native bf16 "
        f"({probe.describe()}); pass {flag} bf16 to run bf16 anyway")
    return "fp32"
