"""AMSP rows: the engine (``amsp_ext.shard``) with MiCS's configuration and with the planner's plan.

Both run the engine contract of docs/DESIGN.md unchanged: ``no_sync()`` on micro-batches 0..M-2,
``optimizer.backward(loss / M)``, exact ``clip_grad_norm_``, ``step``, ``zero_grad``.

- ``amsp-mics``: plan ``mics:K`` with K = DeepSpeed-MiCS's ``mics_shard_size`` (one node), so
  the row differs from DeepSpeed-MiCS only in the execution engine (paper Fig. 16).
- ``amsp-plan``: ``RunSpec.amsp_plan``: explicit factors, a named baseline, or the planner's
  plan (the launcher resolves ``auto`` once and hands every rank the same factors).

``RunSpec.amsp_overlap`` maps to the engine's Table V switches (``OverlapConfig``); the
ablation mode runs ``amsp-plan`` once per setting.

Gradients are reduced in ``RunSpec.reduce_dtype`` (fp32 by default, the engine's default), as
every other row is (config.py [Note: one wire dtype for every system]), so a bf16 ratio measures
the engine and the plan, not the dtype; comparisons/results/reduce_dtype.md measures what fp32
reduction costs.
"""

from __future__ import annotations

from amsp_ext.compare.config import OVERLAP_SWITCHES
from amsp_ext.compare.systems.base import Context, SystemRun, SystemUnavailable
from amsp_ext.engine_config import EngineConfig, OverlapConfig
from amsp_ext.planner.plan import is_auto
from amsp_ext.common.models import causal_lm_loss

__all__ = ["engine_config", "mics_plan", "plan_text", "setup"]


def engine_config(spec, gpus_per_node: int | None = None) -> EngineConfig:
    """The engine configuration of the AMSP rows: the engine's defaults (engine_config.py) but
    what the comparison holds fixed across systems (precision, the reduce dtype every row uses,
    the sharding unit) and the ablation's overlap switches. Torch-free: the launcher
    plans "auto" with ``engine_config.training_spec`` of it."""
    return EngineConfig(gpus_per_node=gpus_per_node, precision=spec.precision,
                        reduce_dtype=spec.reduce_dtype, granularity=spec.amsp_granularity,
                        all_reduce=spec.amsp_all_reduce,
                        overlap=OverlapConfig(**OVERLAP_SWITCHES[spec.amsp_overlap]))


def mics_plan(spec, gpus_per_node: int) -> str:
    """The ``amsp-mics`` row's plan: DeepSpeed-MiCS's shard group (default: one node)."""
    return f"mics:{spec.mics_shard_size or gpus_per_node}"


def plan_text(name: str, ctx: Context) -> str:
    if name == "amsp-mics":
        return mics_plan(ctx.spec, ctx.gpus_per_node)
    if is_auto(ctx.spec.amsp_plan):
        raise SystemUnavailable("the launcher must resolve amsp_plan='auto' to factors before "
                                "starting ranks", status="failed")
    return ctx.spec.amsp_plan


def setup(name: str, model, ctx: Context) -> SystemRun:
    from amsp_ext import shard
    from amsp_ext.runtime.step import train_step as engine_step

    plan = plan_text(name, ctx)
    config = engine_config(ctx.spec, ctx.gpus_per_node)
    model, optimizer = shard(model, plan, ctx.optimizer_factory, config=config)

    def train_step(step: int) -> float:
        done = engine_step(model, optimizer, ctx.batches(step), causal_lm_loss,
                           clip=ctx.spec.grad_clip, phase=ctx.phase)
        losses = [loss.item() for loss in done.losses]
        return sum(losses) / len(losses)

    return SystemRun(train_step=train_step, drain=model.amsp.wait_params, mixed_precision=(
        "bf16 parameters and compute, fp32 masters of the owned shards (EngineConfig precision)"
        if ctx.spec.precision == "bf16" else "fp32"), settings={
        "plan": str(model.amsp.plan),
        "overlap": OVERLAP_SWITCHES[ctx.spec.amsp_overlap],
        "shard_config": repr(config),
    })
