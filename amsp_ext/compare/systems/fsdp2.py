"""FSDP2 (``torch.distributed.fsdp.fully_shard``): full shard, and HSDP on a 2-D mesh.

As torchtitan applies it: one ``fully_shard`` per decoder layer, then the root;
``reshard_after_forward=True``; bf16 is ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=...)`` over fp32 sharded parameters (bf16 parameters gathered for compute, fp32
masters), the reduce dtype ``RunSpec.reduce_dtype`` (config.py [Note: one wire dtype for every
system]; fp32 by default, as torchtitan does). Gradient accumulation keeps the default
reduce-scatter on every micro-batch (gradients stay sharded, the point of FSDP); HSDP skips the
cross-replica all-reduce on all but the last micro-batch (``set_requires_all_reduce``, the
documented HSDP accumulation idiom). Clipping is ``clip_grad_norm_`` on the DTensor gradients.

- ``fsdp2``: 1-D mesh over the world (ZeRO-3-like).
- ``hsdp``: mesh ``(replicate=num_nodes, shard=gpus_per_node)``: shard inside a node, replicate
  across nodes (MiCS-like).

[Note: gloo and sum-only reductions]
FIELD_NOTES records that ``set_gradient_divide_factor`` on gloo fails (``PREMUL_SUM``) unless
``set_force_sum_reduction_for_comms(True)``. We do not set a divide factor, and with FSDP2's
defaults both meshes train on gloo (checked with torch 2.13, 4 ranks, fsdp2 and hsdp 2x2), so
neither knob is touched: the rows run FSDP2 exactly as its users would.
"""

from __future__ import annotations

from amsp_ext.compare.systems.base import Context, SystemRun
from amsp_ext.common.models import causal_lm_loss

__all__ = ["setup"]


def setup(name: str, model, ctx: Context) -> SystemRun:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if name == "fsdp2":
        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("shard",))
    elif name == "hsdp":
        mesh = init_device_mesh("cpu", (ctx.num_nodes, ctx.gpus_per_node),
                                mesh_dim_names=("replicate", "shard"))
    else:
        raise ValueError(f"FSDP2 system must be one of fsdp2, hsdp, got {name!r}")
    bf16 = ctx.spec.precision == "bf16"
    reduce_dtype = torch.bfloat16 if ctx.spec.reduce_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    optimizer = ctx.optimizer_factory(model.parameters())
    M = ctx.spec.num_micro_batches

    def train_step(step: int) -> float:
        losses = []
        for m, batch in enumerate(ctx.batches(step)):
            if name == "hsdp":
                model.set_requires_all_reduce(m == M - 1)
            with ctx.phase("forward"):
                loss = causal_lm_loss(model, batch)
            with ctx.phase("backward"):
                (loss / M).backward()
            losses.append(loss.item())
        with ctx.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), ctx.spec.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    return SystemRun(train_step=train_step, mixed_precision=(
        "bf16 parameters gathered from fp32 sharded masters (MixedPrecisionPolicy param_dtype=bf16)"
        if bf16 else "fp32"), settings={
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
        "wrap": "fully_shard per decoder layer + root, reshard_after_forward=True",
        "mp_policy": f"param_dtype={'bf16' if bf16 else 'fp32'}, reduce_dtype={ctx.spec.reduce_dtype}",
        "accumulation": "reduce-scatter every micro-batch" + (
            "; replica all-reduce on the last only (set_requires_all_reduce)" if name == "hsdp" else ""),
    })
