"""DDP: ``DistributedDataParallel`` as its users run it.

bf16 is autocast over fp32 parameters (torch AMP, the standard DDP mixed precision); gradients
are reduced in fp32. Gradient accumulation uses ``no_sync()`` on every micro-batch but the last,
as Accelerate and the HF Trainer do, so one bucketed all-reduce per step overlaps the last
backward. Clipping is ``clip_grad_norm_`` on the (replicated) gradients.
"""

from __future__ import annotations

import contextlib

from amsp_ext.compare.systems.base import Context, SystemRun, phase
from amsp_ext.common.models import causal_lm_loss

__all__ = ["setup"]


def setup(name: str, model, ctx: Context) -> SystemRun:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    optimizer = ctx.optimizer_factory(ddp.parameters())
    M = ctx.spec.num_micro_batches

    def train_step(step: int) -> float:
        losses = []
        for m, batch in enumerate(ctx.batches(step)):
            sync = contextlib.nullcontext() if m == M - 1 else ddp.no_sync()
            with sync:
                with phase("forward"), ctx.autocast():
                    loss = causal_lm_loss(ddp, batch)
                with phase("backward"):
                    (loss / M).backward()
            losses.append(loss.item())
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), ctx.spec.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    return SystemRun(train_step=train_step, settings={
        "wrapper": "torch.nn.parallel.DistributedDataParallel (defaults: 25 MiB buckets)",
        "mixed_precision": "torch.autocast(cpu, bf16), fp32 params and grads"
        if ctx.spec.precision == "bf16" else "fp32",
        "accumulation": "no_sync() on micro-batches 0..M-2",
    })
