"""Fault injection for the resilience tests of ``amsp train`` (never set in normal runs).

``AMSP_FAULTS`` holds ``;``-separated faults ``KIND:rank=R:step=S[-E]``:

- ``nan``: rank R's loss is multiplied by NaN at steps S..E (the non-finite guard's input);
- ``kill``: rank R SIGKILLs itself at the start of step S, in the first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` 0), so an elastic restart replaces it and resumes;
- ``slow`` (``slow:rank=R:step=S[-E]:x=F``): what ``amsp train --adaptive`` measured on rank R
  at steps S..E for the collective kinds that cross nodes is multiplied by F (a fake slow
  link: only the adaptive monitor's input changes, not the collectives; runtime/replan/adaptive.py).

A malformed value is a one-line ValueError (it is read once, at start-up).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["Fault", "faults", "kill_now", "nan_now", "slow_factor"]

ENV = "AMSP_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first: int
    last: int
    factor: float = 1.0


def faults(text: str | None = None) -> list[Fault]:
    text = os.environ.get(ENV, "") if text is None else text
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        try:
            kind, *kv = item.split(":")
            d = dict(x.split("=", 1) for x in kv)
            first, _, last = d["step"].partition("-")
            factor = float(d.pop("x")) if kind == "slow" else 1.0
            out.append(Fault(kind, int(d["rank"]), int(first), int(last or first), factor))
        except (ValueError, KeyError):
            raise ValueError(f"{ENV}: {item!r} is not KIND:rank=R:step=S[-E] "
                             f"(slow: slow:rank=R:step=S[-E]:x=F)") from None
        if kind not in ("nan", "kill", "slow"):
            raise ValueError(f"{ENV}: fault kind must be nan, kill or slow, got {kind!r}")
        if not factor > 0:
            raise ValueError(f"{ENV}: {item!r}: x must be a number > 0, got {factor!r}")
    return out


def nan_now(fs: list[Fault], *, rank: int, step: int) -> bool:
    return any(f.kind == "nan" and f.rank == rank and f.first <= step <= f.last for f in fs)


def kill_now(fs: list[Fault], *, rank: int, step: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if any(f.kind == "kill" and f.rank == rank and f.first <= step <= f.last for f in fs):
        os.kill(os.getpid(), signal.SIGKILL)


def slow_factor(fs: list[Fault], *, rank: int, step: int) -> float:
    """The factor on rank ``rank``'s measured cross-node times of ``step`` (1: none)."""
    f = 1.0
    for x in fs:
        if x.kind == "slow" and x.rank == rank and x.first <= step <= x.last:
            f *= x.factor
    return f
