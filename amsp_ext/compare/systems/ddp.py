"""DDP: ``DistributedDataParallel`` as its users run it.

bf16 is autocast over fp32 parameters (torch AMP, the standard DDP mixed precision): the
gradients are fp32, and reduced in fp32 unless ``RunSpec.reduce_dtype`` is bf16, which registers
torch's ``bf16_compress_hook`` (cast each bucket to bf16, all-reduce, cast back), the way DDP users
halve gradient traffic (config.py [Note: one wire dtype for every system]). Gradient accumulation uses ``no_sync()`` on every micro-batch but the last,
as Accelerate and the HF Trainer do, so one bucketed all-reduce per step overlaps the last
backward. Clipping is ``clip_grad_norm_`` on the (replicated) gradients.

``ddp-b1`` / ``ddp-b5`` / ``ddp-b25`` are ``ddp`` with ``bucket_cap_mb`` given (the sweep of
``amsp compare --ddp-buckets``, systems/__init__.py [Note: DDP at its best]); ``ddp`` leaves it to
torch's default (25). Every row's settings record the cap the module ran with.

``ddp-bf16`` is DDP's closer variant for bf16 rows (base.py [Note: mixed precision of the same
kind]): the model's parameters in bf16, DDP over them, and an fp32 master copy of every
parameter in the optimizer (Megatron-LM's Float16OptimizerWithFloat16Params, apex's O2): the
recipe AMSP, FSDP2 and DeepSpeed run. Gradients are bf16 and accumulate in the bf16 ``.grad``;
with ``--reduce-dtype fp32`` a hook all-reduces each bucket in fp32 (``_fp32_on_the_wire``).
After the last micro-batch the gradients go to the masters in fp32, are clipped there, the
masters step, and the parameters are copied back in bf16.
"""

from __future__ import annotations

import contextlib

from amsp_ext.compare.systems.base import Context, SystemRun, SystemUnavailable
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


def _fp32_on_the_wire(state, bucket):
    """A bf16 bucket all-reduced in fp32 (the mean), cast back into the bucket."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    wide = buf.to(torch.float32).div_(dist.get_world_size())
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def _bucket_kwargs(name: str) -> dict:
    """``bucket_cap_mb`` of a bucket-sweep row (systems/__init__.py [Note: DDP at its best]);
    nothing for ``ddp``, which runs torch's default as its users do."""
    from amsp_ext.compare.systems import SYSTEMS

    mb = SYSTEMS[name].bucket_cap_mb
    return {} if mb is None else {"bucket_cap_mb": mb}


def setup(name: str, model, ctx: Context) -> SystemRun:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name == "ddp-bf16":
        return _setup_bf16_params(model, ctx)
    ddp = DDP(model, **_bucket_kwargs(name))
    _hook(ddp, ctx, _bf16_compress_on_gloo if ctx.spec.reduce_dtype == "bf16" else None)
    return _ddp_run(ddp, ctx.optimizer_factory(ddp.parameters()), ctx, mixed_precision=(
        "autocast over fp32 parameters (torch.autocast(cpu, bf16)); fp32 gradients and optimizer"
        if ctx.spec.precision == "bf16" else "fp32"), reduce=(
        "bf16_compress_hook (bf16 all-reduce)" if ctx.spec.reduce_dtype == "bf16"
        else "fp32 all-reduce (no comm hook)"))


def _setup_bf16_params(model, ctx: Context) -> SystemRun:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ctx.spec.precision != "bf16":
        raise SystemUnavailable("ddp-bf16 is DDP over bf16 parameters: it needs --precision bf16")
    params = [p for p in model.parameters() if p.requires_grad]
    # the masters start from the fp32 initial weights, not their bf16 rounding (as AMSP's do)
    masters = [p.detach().clone().requires_grad_(True) for p in params]
    with torch.no_grad():  # parameters only: buffers (RoPE's inv_freq) keep fp32, as AMSP's do
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    ddp = DDP(model)
    _hook(ddp, ctx, _fp32_on_the_wire if ctx.spec.reduce_dtype == "fp32" else None)
    optimizer = ctx.optimizer_factory(masters)

    def to_masters() -> None:
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None

    def from_masters() -> None:
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    return _ddp_run(ddp, optimizer, ctx, mixed_precision=(
        "bf16 parameters and compute, fp32 masters in the optimizer (Megatron-LM's "
        "Float16OptimizerWithFloat16Params); bf16 gradients"), reduce=(
        "bf16 all-reduce (bf16 gradients, no hook)" if ctx.spec.reduce_dtype == "bf16"
        else "fp32 all-reduce of each bf16 bucket (hook)"), before_step=to_masters,
        clip_params=masters, after_step=from_masters, autocast=False)


def _local_bucket(state, bucket):
    """The bucket's own gradients, no collective: compute-only runs (compare/limit.py), where
    the fake group's all-reduce future carries no tensor and DDP's reducer asserts on it."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _hook(ddp, ctx: Context, hook=None) -> None:
    """Register ``hook`` (None: DDP's own all-reduce) on ``ddp``, or ``_local_bucket`` in a
    compute-only run: a DDP takes one hook, once."""
    if ctx.compute_only:
        ddp.register_comm_hook(None, _local_bucket)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)


def _ddp_run(ddp, optimizer, ctx: Context, *, mixed_precision: str, reduce: str,
             before_step=lambda: None, clip_params=None, after_step=lambda: None,
             autocast: bool = True) -> SystemRun:
    import torch

    M = ctx.spec.num_micro_batches
    clip_params = list(ddp.parameters()) if clip_params is None else clip_params

    def train_step(step: int) -> float:
        losses = []
        for m, batch in enumerate(ctx.batches(step)):
            sync = contextlib.nullcontext() if m == M - 1 else ddp.no_sync()
            with sync:
                with ctx.phase("forward"), (ctx.autocast() if autocast else contextlib.nullcontext()):
                    loss = causal_lm_loss(ddp, batch)
                with ctx.phase("backward"):
                    (loss / M).backward()
            losses.append(loss.item())
        with ctx.phase("optimizer"):
            before_step()
            torch.nn.utils.clip_grad_norm_(clip_params, ctx.spec.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after_step()
        return sum(losses) / len(losses)

    return SystemRun(train_step=train_step, mixed_precision=mixed_precision, settings={
        "wrapper": "torch.nn.parallel.DistributedDataParallel",
        # read back from the module, not the name: what DDP really bucketed by
        "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
        "reduce": reduce,
        "accumulation": "no_sync() on micro-batches 0..M-2",
    })
