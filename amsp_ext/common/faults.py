"""Fault injection for the resilience tests of ``amsp train`` (never set in normal runs).

``AMSP_FAULTS`` holds ``;``-separated faults ``KIND:rank=R:step=S[-E]``:

- ``nan``: rank R's loss is multiplied by NaN at steps S..E (the non-finite guard's input);
- ``kill``: rank R SIGKILLs itself at the start of step S, in the first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` 0), so an elastic restart replaces it and resumes;
- ``slow`` (``slow:rank=R:step=S[-E]:x=F``): what ``amsp train --adaptive`` measured on rank R
  at steps S..E for the collective kinds that cross nodes is multiplied by F (a fake slow
  link: only the adaptive monitor's input changes, not the collectives; runtime/replan/adaptive.py).
- ``hang`` (``hang:rank=R:step=S[:system=NAME]``): rank R spins forever at the start of step S,
  ignoring SIGTERM, as a rank stuck in a computation would (``amsp compare``'s leave-nothing-
  behind test; ``system=`` limits it to that compare system, so the next one runs clean).

A malformed value is a one-line ValueError (it is read once, at start-up).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

__all__ = ["Fault", "faults", "hang_now", "kill_now", "nan_now", "slow_factor"]

ENV = "AMSP_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first: int
    last: int
    factor: float = 1.0
    system: str | None = None  # hang only: the `amsp compare` system it applies to (None: all)


def faults(text: str | None = None) -> list[Fault]:
    text = os.environ.get(ENV, "") if text is None else text
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        try:
            kind, *kv = item.split(":")
            d = dict(x.split("=", 1) for x in kv)
            first, _, last = d["step"].partition("-")
            factor = float(d.pop("x")) if kind == "slow" else 1.0
            system = d.pop("system", None) if kind == "hang" else None
            out.append(Fault(kind, int(d["rank"]), int(first), int(last or first), factor, system))
        except (ValueError, KeyError):
            raise ValueError(f"{ENV}: {item!r} is not KIND:rank=R:step=S[-E] "
                             f"(slow: slow:rank=R:step=S[-E]:x=F)") from None
        if kind not in ("nan", "kill", "slow", "hang"):
            raise ValueError(f"{ENV}: fault kind must be nan, kill, slow or hang, got {kind!r}")
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


def hang_now(fs: list[Fault], *, rank: int, step: int, system: str | None = None) -> None:
    """Spin forever (SIGTERM ignored: only SIGKILL ends it) if a hang fault names this step."""
    if any(f.kind == "hang" and f.rank == rank and f.first <= step <= f.last
           and f.system in (None, system) for f in fs):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # one line in the job's log, so a test can tell that the hang really began (and not
        # that the launcher's timeout came before the rank reached the step)
        print(f"[amsp fault] hang: rank {rank} spins at step {step}, SIGTERM ignored",
              file=sys.stderr, flush=True)
        x = 0
        while True:  # busy, not blocked in a syscall: as a stray worker spins (amsp_ext/reap.py)
            x += 1
