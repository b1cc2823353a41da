"""AMSP rows: the engine (``amsp_ext.shard``) with MiCS's configuration and with the planner's plan.

Both run the engine contract of docs/DESIGN.md unchanged: ``no_sync()`` on micro-batches 0..M-2,
``optimizer.backward(loss / M)``, exact ``clip_grad_norm_``, ``step``, ``zero_grad``.

- ``amsp-mics``: plan ``mics:K`` with K = DeepSpeed-MiCS's ``mics_shard_size`` (one node), so
  the row differs from DeepSpeed-MiCS only in the execution engine (paper Fig. 16).
- ``amsp-plan``: ``RunSpec.amsp_plan``: explicit factors, a named baseline, or the planner's
  plan (the launcher resolves ``auto`` once and hands every rank the same factors).

``RunSpec.amsp_overlap`` maps to the engine's Table V switches (``OverlapConfig``); the
ablation mode runs ``amsp-plan`` once per setting.

Gradients are reduced in the compute dtype (``reduce_dtype=spec.precision``), not the engine's
fp32 default: the DeepSpeed rows reduce in their compute dtype (DeepSpeed's default
``communication_data_type``), and the paper's comparison is of the same bytes moved by two
engines. comparisons/results/reduce_dtype.md measures what fp32 reduction costs on top.
"""

from __future__ import annotations

from amsp_ext.compare.config import OVERLAP_SWITCHES
from amsp_ext.compare.systems.base import Context, SystemRun, SystemUnavailable
from amsp_ext.train.models import causal_lm_loss

__all__ = ["GRAD_BUCKET_BYTES", "engine_settings", "plan_text", "setup", "shard_config"]

# U of the AMSP rows (the engine's default), stated here so that the launcher plans "auto" for
# the bucket the rows run with without importing the engine
GRAD_BUCKET_BYTES = 25 * 2**20


def engine_settings(spec) -> dict:
    """The ShardConfig settings of the AMSP rows that the planner charges (torch-free: the
    launcher passes them to amsp_ext.planner.auto.plan_auto)."""
    return dict(precision=spec.precision, reduce_dtype=spec.precision,
                granularity=spec.amsp_granularity, recompute=False, grad_bucket_bytes=GRAD_BUCKET_BYTES)


def shard_config(spec, gpus_per_node: int, *, auto=None):
    """The engine configuration of the AMSP rows."""
    from amsp_ext.runtime.config import OverlapConfig, ShardConfig

    return ShardConfig(gpus_per_node=gpus_per_node, **engine_settings(spec),
                       overlap=OverlapConfig(**OVERLAP_SWITCHES[spec.amsp_overlap]), auto=auto)


def plan_text(name: str, ctx: Context) -> str:
    if name == "amsp-mics":
        return f"mics:{ctx.spec.mics_shard_size or ctx.gpus_per_node}"
    if ctx.spec.amsp_plan.strip().lower() == "auto":
        raise SystemUnavailable("the launcher must resolve amsp_plan='auto' to factors before "
                                "starting ranks", status="failed")
    return ctx.spec.amsp_plan


def setup(name: str, model, ctx: Context) -> SystemRun:
    import contextlib

    from amsp_ext.runtime.shard import shard  # the function: `amsp_ext.shard` can resolve to the module

    plan = plan_text(name, ctx)
    config = shard_config(ctx.spec, ctx.gpus_per_node)
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
        "plan": str(model.amsp.plan),
        "overlap": OVERLAP_SWITCHES[ctx.spec.amsp_overlap],
        "shard_config": repr(config),
    })
