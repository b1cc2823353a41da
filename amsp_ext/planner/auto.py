"""Plan "auto": the planner's plan for an engine run, from plain values (no torch).

``amsp_ext.shard(model, "auto", config=ShardConfig(auto=AutoPlanConfig(...)))`` calls
``plan_auto`` on every rank with its ShardConfig's settings; ``amsp compare`` calls it once in
the launcher with the settings its AMSP rows run with. Both therefore plan for the bucket size,
precision, reduce dtype, granularity and recompute the engine really uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from amsp_ext.choices import MISSING_MESH, OBJECTIVES, OPTIMIZERS, check_one_of
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.search import Problem, make_problem, search
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
from amsp_ext.planner.defaults import (DEFAULT_ALL_REDUCE, DEFAULT_MISSING_MESH, DEFAULT_OBJECTIVE,
                                      DEFAULT_PROFILE, DEFAULT_REDUCE_DTYPE)

__all__ = ["AutoPlanConfig", "auto_problem", "plan_auto"]


@dataclass(frozen=True, kw_only=True)
class AutoPlanConfig:
    """What ``plan="auto"`` needs besides the model, the world and the engine's own settings: the
    step's batch shape and the planner's inputs (see amsp_ext.planner.search.plan_for)."""

    seq_len: int
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    profile: str = DEFAULT_PROFILE  # bundled profile name or a path to an amsp-profile/1 JSON
    objective: str = DEFAULT_OBJECTIVE  # "comm" (Eq. 1) or "step"
    missing: str = DEFAULT_MISSING_MESH  # profile meshes the table lacks: "error" or "fit"
    optimizer: str = "adamw"
    gpu_memory_bytes: int | None = None  # None: the device's (CPU: RAM / gpus_per_node)
    memory_reserve_bytes: int | None = None  # None: the planner's default reserve

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "num_micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"auto.{name} must be an integer >= 1, got {v!r}")
        check_one_of(self.objective, OBJECTIVES, "auto.objective")
        check_one_of(self.missing, MISSING_MESH, "auto.missing")
        check_one_of(self.optimizer, OPTIMIZERS, "auto.optimizer")
        if self.gpu_memory_bytes is not None and (
            not isinstance(self.gpu_memory_bytes, int) or self.gpu_memory_bytes < 1
        ):
            raise ValueError(f"auto.gpu_memory_bytes must be a positive integer or None, got {self.gpu_memory_bytes!r}")
        if self.memory_reserve_bytes is not None and (
            not isinstance(self.memory_reserve_bytes, int) or self.memory_reserve_bytes < 0
        ):
            raise ValueError(f"auto.memory_reserve_bytes must be an integer >= 0 or None, got {self.memory_reserve_bytes!r}")


def auto_problem(model: ModelSpec | Mapping[str, Any] | str, auto: AutoPlanConfig, *,
                 num_nodes: int, gpus_per_node: int, gpu_memory_bytes: int,
                 nodes_per_leaf: int | None = None, precision: str, grad_bucket_bytes: int,
                 granularity: str, recompute: bool, reduce_dtype: str | None = DEFAULT_REDUCE_DTYPE,
                 all_reduce: str = DEFAULT_ALL_REDUCE) -> Problem:
    """The planner's Problem for ``model`` trained as ``auto`` says on ``num_nodes`` x
    ``gpus_per_node``, by an engine with these settings (ShardConfig's names): what
    ``plan_auto`` searches and what adaptive AMSP (runtime/replan/adaptive.py) predicts steps with."""
    cluster = ClusterSpec(num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                          gpu_memory_bytes=gpu_memory_bytes, nodes_per_leaf=nodes_per_leaf)
    training = TrainingSpec(seq_len=auto.seq_len, micro_batch_size=auto.micro_batch_size,
                            num_micro_batches=auto.num_micro_batches, recompute=recompute,
                            precision=precision, optimizer=auto.optimizer,
                            bucket_bytes=grad_bucket_bytes, granularity=granularity,
                            reduce_dtype=reduce_dtype, all_reduce=all_reduce)
    reserve = {} if auto.memory_reserve_bytes is None else {"memory_reserve_bytes": auto.memory_reserve_bytes}
    return make_problem(model, cluster, training, auto.profile, objective=auto.objective,
                        missing=auto.missing, **reserve)


def plan_auto(model: ModelSpec | Mapping[str, Any] | str, auto: AutoPlanConfig, **settings: Any) -> Plan:
    """The planner's plan for ``model`` (a ModelSpec, a Hugging Face config dict or a preset):
    the best of ``auto_problem(model, auto, **settings)``. Raises NoFeasiblePlan or another
    one-line ValueError."""
    return search(auto_problem(model, auto, **settings)).best.plan
