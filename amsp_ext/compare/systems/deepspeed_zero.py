"""DeepSpeed ZeRO-1/2/3, ZeRO++ and MiCS, through ``deepspeed.initialize`` as their users run them.

Every stage has ``overlap_comm`` on, and DeepSpeed's defaults otherwise (contiguous gradients,
round-robin off, prefetching on), except the three size knobs below. bf16 is DeepSpeed's own ``"bf16": {"enabled": true}`` (bf16
parameters and compute, fp32 master weights in the optimizer); gradients are reduced in
``communication_data_type`` = ``RunSpec.reduce_dtype`` (config.py [Note: one wire dtype for every
system]; absent, DeepSpeed would reduce in the compute dtype); clipping is DeepSpeed's
``gradient_clipping``; accumulation is ``gradient_accumulation_steps`` with
``engine.backward(loss); engine.step()`` per micro-batch, which scales the loss by 1/M itself.
The optimizer is the same client ``torch.optim.AdamW`` every system gets.

- ``zeropp``: stage 3 with hpZ, ``zero_hpz_partition_size`` = one node's GPUs; quantisation off,
  as in the paper.
- ``zeropp-q``: the same with qwZ and qgZ on. Their kernels are CUDA-only; on CPU the run reports
  the error DeepSpeed raises (detected, not assumed).
- ``mics``: stage 3 with ``mics_shard_size`` = one node's GPUs (the paper's MiCS setting).

[Note: bucket sizes and the persistence threshold]
DeepSpeed's absolute defaults are sized for billion-parameter models: a 5e8-element reduce
bucket, and ``stage3_param_persistence_threshold`` = 1e5 elements, below which ZeRO-3 does not
partition a parameter at all - every weight of ``tiny-llama`` is below it, so "ZeRO-3" would
shard nothing. We use what the transformers integration fills in for ``"auto"`` (its documented
ZeRO configs use "auto"), i.e. how most users run a ``LlamaForCausalLM`` under DeepSpeed:
``reduce_bucket_size = h^2``, ``stage3_prefetch_bucket_size = 0.9 h^2``,
``stage3_param_persistence_threshold = 10 h`` (transformers/integrations/deepspeed.py).

[Note: patches]
DeepSpeed 0.18.9 needs two fixes to run on gloo, both under ``patches/`` with the cause and the
versions they were checked against; the worker applies whichever a local probe says is needed
(``patches.apply_needed``) and the report lists them.

[Note: DeepSpeed's steps under the fake group]
A row's compute-only job (compare/limit.py [Note: a row's limit]) runs these same steps on torch's
fake process group, and the invariant it needs is that every rank does the row's work while no
collective carries anything. Two things differ from the row, and neither changes that work:

- ZeRO-3 (and so MiCS) checks every step that the ranks traced the same module order
  (``assert_ints_same_as_other_ranks``): rank 0 broadcasts its list and the others compare. A
  fake broadcast leaves the receivers zeroed, so every other rank raises ("Detected a
  disagreement on list length between rank0 and rank2" in the 4-rank ZeRO-3 and MiCS jobs with
  the check on); ``_without_rank_checks`` turns it off in that job only. It is communication,
  which that job leaves out anyway.
- The fake group can coalesce, so MiCS's shard-group all-gathers go through torch's coalescing
  manager, not the gloo patch's separate ``all_gather_into_tensor`` calls: the same tensors
  gathered, each output filled with copies of the input (finite).

DeepSpeed broadcasts the model from rank 0 in ``initialize``; the compute-only job's broadcasts
zero the receivers (worker.py ``_finite_fake_broadcasts``), so ranks other than 0 train zeros
(loss ln(vocab) every step): the same shapes and kernels, whose time does not depend on values.
"""

from __future__ import annotations

from typing import Any

from amsp_ext.compare.systems.base import Context, SystemRun, SystemUnavailable
from amsp_ext.common.models import causal_lm_loss, llama_config_dict

__all__ = ["ds_config", "setup"]

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3, "zeropp": 3, "zeropp-q": 3, "mics": 3}
_CPU_ONLY_MARKERS = ("not been implemented on CPU backend", "not implemented on CPU backend")


def ds_config(name: str, ctx: Context) -> dict[str, Any]:
    if name not in STAGES:
        raise ValueError(f"DeepSpeed system must be one of {', '.join(STAGES)}, got {name!r}")
    s = ctx.spec
    h = llama_config_dict(s.model)["hidden_size"]
    zero: dict[str, Any] = {"stage": STAGES[name], "overlap_comm": True,
                            "reduce_bucket_size": h * h}
    if STAGES[name] == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        zero["stage3_param_persistence_threshold"] = 10 * h
    one_node = ctx.gpus_per_node
    if name in ("zeropp", "zeropp-q"):
        zero["zero_hpz_partition_size"] = s.hpz_partition_size or one_node
    if name == "zeropp-q":
        zero["zero_quantized_weights"] = True
        zero["zero_quantized_gradients"] = True
    if name == "mics":
        zero["mics_shard_size"] = s.mics_shard_size or one_node
    return {
        "train_batch_size": s.micro_batch_size * s.num_micro_batches * ctx.world_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.num_micro_batches,
        "gradient_clipping": s.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": s.precision == "bf16"},
        "communication_data_type": s.reduce_dtype,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _cpu_only(exc: BaseException) -> str | None:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(m in msg for m in _CPU_ONLY_MARKERS):
        return f"CUDA only: {msg}"
    return None


def _without_rank_checks() -> None:
    """ZeRO-3's per-step rank-order check off, in a compute-only job only ([Note: DeepSpeed's
    steps under the fake group])."""
    from deepspeed.runtime.zero import (
        partition_parameters,
        partitioned_param_coordinator,
        stage3,
    )

    for module in (partition_parameters, partitioned_param_coordinator, stage3):
        module.assert_ints_same_as_other_ranks = lambda ints: None


def setup(name: str, model, ctx: Context) -> SystemRun:
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if ctx.compute_only:
        _without_rank_checks()
    config = ds_config(name, ctx)
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=ctx.optimizer_factory(model.parameters()), config=config)
    except Exception as e:  # qwZ/qgZ may already fail while partitioning
        reason = _cpu_only(e)
        if reason:
            raise SystemUnavailable(reason) from e
        raise

    def train_step(step: int) -> float:
        losses = []
        for batch in ctx.batches(step):
            with ctx.phase("forward"):
                loss = causal_lm_loss(engine, batch)
            with ctx.phase("backward"):
                engine.backward(loss)
            with ctx.phase("optimizer"):  # a no-op but at the accumulation boundary
                engine.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    def guarded_step(step: int) -> float:
        try:
            return train_step(step)
        except Exception as e:
            reason = _cpu_only(e)
            if reason:
                raise SystemUnavailable(reason) from e
            raise

    return SystemRun(train_step=guarded_step, mixed_precision=(
        "bf16 parameters and compute, fp32 masters in the optimizer (DeepSpeed bf16.enabled)"
        if ctx.spec.precision == "bf16" else "fp32"), settings={
        "deepspeed": deepspeed.__version__,
        "ds_config": config,
        "optimizer": "client torch.optim.AdamW",
    })
