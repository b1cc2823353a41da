"""AMSP rows: the engine (``amsp_ext.shard``) with MiCS's configuration and with the planner's plan.

Both run the engine contract of docs/DESIGN.md unchanged: ``no_sync()`` on micro-batches 0..M-2,
``optimizer.backward(loss / M)``, exact ``clip_grad_norm_``, ``step``, ``zero_grad``.

- ``amsp-mics``: plan ``mics:K`` with K = DeepSpeed-MiCS's ``mics_shard_size`` (one node), so
  the row differs from DeepSpeed-MiCS only in the execution engine (paper Fig. 16).
- ``amsp-plan``: ``RunSpec.amsp_plan``: explicit factors, a named baseline, or the planner's
  plan (the launcher resolves ``auto`` once and hands every rank the same factors).

``RunSpec.amsp_overlap`` maps to the engine's Table V switches (``OverlapConfig``); the
ablation mode runs ``amsp-plan`` once per setting.
"""

from __future__ import annotations

from amsp_ext.compare.systems.base import Context, SystemRun, SystemUnavailable
from amsp_ext.models import causal_lm_loss

__all__ = ["OVERLAP_SWITCHES", "pending_reason", "plan_text", "setup"]

# Table V rows, cumulative: (allgather/reducescatter, allreduce, broadcast) overlap.
OVERLAP_SWITCHES = {
    "all": dict(allgather=True, allreduce=True, broadcast=True),
    "no_bc": dict(allgather=True, allreduce=True, broadcast=False),
    "no_bc_ar": dict(allgather=True, allreduce=False, broadcast=False),
    "none": dict(allgather=False, allreduce=False, broadcast=False),
}
ENGINE_PENDING = "engine not landed (amsp_ext.shard is not on main)"


def pending_reason() -> str | None:
    """Why the AMSP rows cannot run yet, checked without launching ranks."""
    try:
        from amsp_ext import shard  # noqa: F401
        from amsp_ext.runtime.config import OverlapConfig, ShardConfig  # noqa: F401
    except ImportError:
        return ENGINE_PENDING
    return None


def plan_text(name: str, ctx: Context) -> str:
    if name == "amsp-mics":
        return f"mics:{ctx.spec.mics_shard_size or ctx.gpus_per_node}"
    if ctx.spec.amsp_plan.strip().lower() == "auto":
        raise SystemUnavailable("the launcher must resolve amsp_plan='auto' to factors before "
                                "starting ranks", status="failed")
    return ctx.spec.amsp_plan


def setup(name: str, model, ctx: Context) -> SystemRun:
    why = pending_reason()
    if why:
        raise SystemUnavailable(why, status="pending")
    import contextlib

    from amsp_ext import shard
    from amsp_ext.runtime.config import OverlapConfig, ShardConfig

    plan = plan_text(name, ctx)
    switches = OVERLAP_SWITCHES[ctx.spec.amsp_overlap]
    config = ShardConfig(gpus_per_node=ctx.gpus_per_node, precision=ctx.spec.precision,
                         granularity=ctx.spec.amsp_granularity, overlap=OverlapConfig(**switches))
    model, optimizer = shard(model, plan, ctx.optimizer_factory, config=config)
    M = ctx.spec.num_micro_batches

    def train_step(step: int) -> float:
        losses = []
        for m, batch in enumerate(ctx.batches(step)):
            with model.no_sync() if m < M - 1 else contextlib.nullcontext():
                loss = causal_lm_loss(model, batch)
                optimizer.backward(loss / M)
            losses.append(loss.item())
        optimizer.clip_grad_norm_(ctx.spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses) / len(losses)

    return SystemRun(train_step=train_step, settings={
        "plan": str(getattr(getattr(model, "amsp", None), "plan", plan)),
        "overlap": switches,
        "shard_config": repr(config),
    })
