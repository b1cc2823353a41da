"""The non-finite guard: a step whose loss or gradient norm is not finite is skipped on every
rank, and too many in a row stop the job with one line.

[Note: one decision, on the norm all-reduce]
Every rank folds its own verdict into the one all-reduce the gradient norm needs anyway: a
rank whose loss was non-finite (noted, without a device sync, by ``backward``) adds NaN to its
partial sum of squares, and a non-finite gradient makes that sum non-finite by itself. The
all-reduce runs over the whole world (each ``optim`` group holds every gradient once, so the
world sum is ``world / sos`` times the squared norm, and is divided back), so every rank gets
the same non-finite value and takes the same decision: no extra collective on the hot path.
Where every rank owns every gradient (sos = 1: the replicate plan, DDP's), the norm needs no
all-reduce at all: each rank holds the same reduced gradients, so each computes the same norm,
as DDP's users clip. The engine skips that all-reduce there (NormGroup(reduce=False)), and the
verdict rides on the gradients' own all-reduce instead: a rank whose loss was non-finite adds
NaN to the first element of the boundary's first bucket (GradSync.fold_verdict; the others
leave it as it is), so every rank's reduced gradient, and so its norm, is NaN. The all-reduce was a
4-byte sync point between the backward and the step that DDP does not have. Its time did
not show on CPU: as separate jobs on loopback (comparisons/separate_jobs.py, 4 ranks on 2
cores, six alternated rounds) the replicate plan's median step was 1578 ms with it and 1582
ms without, DDP's 1498 ms. tests/test_nonfinite.py checks the verdict with a NaN that leaves
the gradients finite.
With clipping on, that all-reduce is the clip's. With clipping off, ``step()`` computes the
norm for the guard: one norm per owned gradient tensor (a read of ``2 Phi / sos`` bytes in the
compute dtype) and a 4-byte all-reduce per step; ``max_bad_steps=0`` turns the guard off (fp32
and bf16 then apply whatever they get, as before; fp16 still skips overflows).

[Note: what counts]
``max_bad_steps`` (default 3) consecutive bad steps raise :class:`NonFiniteError` on every
rank. Under fp16 an overflow is the loss scaler's normal probe while the scale is above its
minimum (skipped, not counted); at the minimum scale it is a bad step like any other (so a
run that overflows forever at the minimum scale stops). A good step resets the count. On a bad
step (rare) one more small all-gather finds which ranks' losses were non-finite, for the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

__all__ = ["NonFiniteError", "NonFiniteGuard"]

logger = logging.getLogger("amsp_ext")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm (one line)."""


@dataclass
class NonFiniteGuard:
    """Pure bookkeeping (the caller does the collectives): ``note_loss`` per backward,
    ``fold`` into the local sum of squares, then ``after_step`` with the decision."""

    max_bad_steps: int  # 0: guard off (EngineConfig.max_bad_steps)
    consecutive: int = 0
    total_bad: int = 0
    bad_steps: list[int] = field(default_factory=list)  # the current run of bad steps
    _loss_bad: torch.Tensor | None = None  # lazy: no device sync in backward

    @property
    def enabled(self) -> bool:
        return self.max_bad_steps > 0

    def note_loss(self, loss: torch.Tensor) -> None:
        if not self.enabled:
            return
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    def loss_was_bad(self) -> bool:
        return bool(self._loss_bad) if self._loss_bad is not None else False

    def fold(self, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """This rank's sum of squares, NaN if its loss was non-finite (see the Note)."""
        if self._loss_bad is None:
            return sum_of_squares
        return torch.where(self._loss_bad, torch.full_like(sum_of_squares, float("nan")), sum_of_squares)

    def reset_loss(self) -> None:
        self._loss_bad = None

    def after_step(self, *, step: int, bad: bool, counts: bool, ranks: list[int] | None,
                   norm: float | None, rank: int) -> None:
        """Record the step's verdict (the same on every rank); raise after too many bad ones."""
        self._loss_bad = None
        if not bad:
            self.consecutive, self.bad_steps = 0, []
            return
        self.total_bad += 1
        if not counts:
            return
        self.consecutive += 1
        self.bad_steps.append(step)
        where = (f"non-finite loss on rank(s) {', '.join(map(str, ranks))}" if ranks
                 else "non-finite gradient norm (no rank's loss was non-finite)")
        if self.consecutive >= self.max_bad_steps:
            first, last = self.bad_steps[0], self.bad_steps[-1]
            raise NonFiniteError(
                f"amsp: {self.consecutive} consecutive steps had a non-finite loss or gradient norm "
                f"(steps {first}-{last}; last: {where}); stopping (max_bad_steps={self.max_bad_steps}): "
                f"lower the learning rate, check the data of these steps, or resume from an earlier checkpoint")
        if rank == 0:
            logger.warning(f"amsp: step {step} skipped on every rank: {where} (grad norm {norm}); "
                           f"{self.consecutive} consecutive bad step(s), the job stops at {self.max_bad_steps}")
