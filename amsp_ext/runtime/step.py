"""``train_step``: one optimizer step of a sharded model over its micro-batches, the engine's
contract (docs/DESIGN.md) written once. `amsp train` (train/loop.py), the AMSP rows of
`amsp compare`, `amsp tune`'s measured steps and `amsp dryrun` all run it; each adds only what
it observes (timers, profiler ranges, the dry run's collective log) through ``phase``.

[Note: one step, in this order]
Micro-batches 0..M-2 run inside ``model.no_sync()`` (their gradients accumulate; the last one is
the accumulation boundary, where the gradient collectives launch), each ``backward`` of the
micro-batch loss divided by M (the global-batch mean), then the clip (exact, one all-reduce of
the squared norms, or none when the norm is local), ``step`` and ``zero_grad``. Every rank runs
the same sequence, so every rank issues the same collectives in the same order. ``between`` runs
after ``step`` and before ``zero_grad`` (an LR scheduler's step): ``zero_grad`` is where a plan
switch decided at the end of ``step`` happens (runtime/replan/adaptive.py [Note: where a switch
happens]), and a scheduler stepped before it has its learning rate carried to the new plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Sequence

import torch

__all__ = ["StepResult", "train_step"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    losses: list[torch.Tensor]  # each micro-batch's loss as ``loss_of`` returned it, detached
    grad_norm: torch.Tensor | None  # the clip's global norm; None without clipping
    applied: bool  # False: a non-finite loss or norm skipped the step on every rank


def _no_phase(_name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


def train_step(model, optimizer, micro_batches: Sequence[Any],
               loss_of: Callable[[Any, Any], torch.Tensor], *, clip: float | None = None,
               phase: Callable[[str], ContextManager[Any]] = _no_phase,
               between: Callable[[], None] | None = None) -> StepResult:
    """One step of ``model`` / ``optimizer`` (``amsp_ext.shard``'s) over ``micro_batches``
    ([Note: one step, in this order]). ``loss_of(model, batch)``: a micro-batch's loss (not yet
    divided by M). ``clip``: the max gradient norm (None or <= 0: no clipping). ``phase(name)``:
    a context around each ``forward``, ``backward`` and the ``optimizer`` part (clip, step,
    ``between``, zero_grad)."""
    M = len(micro_batches)
    losses = []
    for micro, batch in enumerate(micro_batches):
        with model.no_sync() if micro < M - 1 else contextlib.nullcontext():
            with phase("forward"):
                loss = loss_of(model, batch)
            with phase("backward"):
                optimizer.backward(loss / M)
        losses.append(loss.detach())
    with phase("optimizer"):
        grad_norm = optimizer.clip_grad_norm_(clip) if clip is not None and clip > 0 else None
        skipped = optimizer.skipped_steps
        # nothing here reads a parameter before the next forward: its pre-hooks wait for the
        # broadcasts (optimizer.py [Note: parameters current after step()])
        with optimizer.broadcast_under_next_forward():
            optimizer.step()  # skipped on every rank if the loss or the norm is not finite
        applied = optimizer.skipped_steps == skipped
        if between is not None:
            between()
        optimizer.zero_grad()
    return StepResult(losses=losses, grad_norm=grad_norm, applied=applied)
