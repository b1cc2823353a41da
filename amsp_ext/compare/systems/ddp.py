"""DDP: ``DistributedDataParallel`` as its users run it.

bf16 is autocast over fp32 parameters (torch AMP, the standard DDP mixed precision): the
gradients are fp32, and reduced in fp32 unless ``RunSpec.reduce_dtype`` is bf16, which registers
torch's ``bf16_compress_hook`` (cast each bucket to bf16, all-reduce, cast back), the way DDP users
halve gradient traffic (config.py [Note: one wire dtype for every system]). Gradient accumulation uses ``no_sync()`` on every micro-batch but the last,
as Accelerate and the HF Trainer do, so one bucketed all-reduce per step overlaps the last
backward. Clipping is ``clip_grad_norm_`` on the (replicated) gradients.
"""

from __future__ import annotations

import contextlib

from amsp_ext.compare.systems.base import Context, SystemRun, phase
from amsp_ext.common.models import causal_lm_loss

__all__ = ["setup"]


# [Note: the bf16 hook on gloo]
# ``DistributedDataParallel.register_comm_hook`` refuses a hook *named* ``bf16_compress_hook``
# unless CUDA 11+ with NCCL 2.10+ (or XPU) is present: older NCCL had no bf16 all-reduce. gloo
# all-reduces bf16 (FIELD_NOTES, torch 2.13), so the CPU rows run torch's own hook unchanged
# through this wrapper, whose name the check does not match. Its bytes are measured like every
# row's (compare/wire.py): 2 B per parameter per step.
def _bf16_compress_on_gloo(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def setup(name: str, model, ctx: Context) -> SystemRun:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if ctx.spec.reduce_dtype == "bf16":
        ddp.register_comm_hook(None, _bf16_compress_on_gloo)
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

    return SystemRun(train_step=train_step, mixed_precision=(
        "autocast over fp32 parameters (torch.autocast(cpu, bf16)); fp32 gradients and optimizer"
        if ctx.spec.precision == "bf16" else "fp32"), settings={
        "wrapper": "torch.nn.parallel.DistributedDataParallel (defaults: 25 MiB buckets)",
        "reduce": "bf16_compress_hook (bf16 all-reduce)" if ctx.spec.reduce_dtype == "bf16"
        else "fp32 all-reduce (no comm hook)",
        "accumulation": "no_sync() on micro-batches 0..M-2",
    })
