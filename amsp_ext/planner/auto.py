"""Plan "auto": the planner's plan for an engine run, from plain values (no torch).

Every route reaches it through ``amsp_ext.job.resolve`` (job.py [Note: one job, resolved once]),
which hands it typed inputs: the AutoPlanConfig (the step's shape and the planner's inputs),
the TrainingSpec of the engine's settings (engine_config.training_spec, so the plan is priced
for the bucket size, precision, reduce dtype, granularity and recompute the engine really uses)
and the ClusterSpec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from amsp_ext.choices import ALL_REDUCES, MISSING_MESH, OBJECTIVES, OPTIMIZERS, check_one_of
from amsp_ext.planner.issued import bucket_close_bytes
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan, is_auto
from amsp_ext.planner.search import Problem, SearchResult, evaluate, make_problem, search
from amsp_ext.planner.specs import ClusterSpec, StepShape, TrainingSpec
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_MISSING_MESH, DEFAULT_OBJECTIVE, DEFAULT_OPTIMIZER
from amsp_ext.planner.profile import BandwidthProfile, CommTimer, load_profile

__all__ = ["AllReduceChoice", "AutoPlanConfig", "Planned", "auto_problem", "choose_all_reduce", "close_for", "close_of",
           "plan_auto", "resolve_auto", "search_all_reduce", "two_level_applies", "unpriced_choice"]


@dataclass(frozen=True, kw_only=True)
class AutoPlanConfig(StepShape):
    """What ``plan="auto"`` needs besides the model, the world and the engine's own settings: the
    step's shape (StepShape: seq_len, micro_batch_size, num_micro_batches) and the planner's
    inputs (see amsp_ext.planner.search.plan_for)."""

    # "cluster" (defaults.py [Note: which profile auto plans with]; the job resolves it to the
    # profile it found or measured, a BandwidthProfile), a bundled name or an amsp-profile/1 path
    profile: str | BandwidthProfile = CLUSTER_PROFILE
    objective: str = DEFAULT_OBJECTIVE  # "comm" (Eq. 1) or "step"
    missing: str = DEFAULT_MISSING_MESH  # profile meshes the table lacks: "error" or "fit"
    optimizer: str = DEFAULT_OPTIMIZER
    # frozen models of this shape beside it (specs.py [Note: frozen models]); None: shard()
    # counts the forward-only engines already built in the process
    frozen_models: int | None = None
    gpu_memory_bytes: int | None = None  # None: the device's (CPU: RAM / gpus_per_node)
    memory_reserve_bytes: int | None = None  # None: the planner's default reserve

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:  # the shape's error, named as this config's field
            raise ValueError(f"auto.{e}") from None
        check_one_of(self.objective, OBJECTIVES, "auto.objective")
        check_one_of(self.missing, MISSING_MESH, "auto.missing")
        check_one_of(self.optimizer, OPTIMIZERS, "auto.optimizer")
        if self.frozen_models is not None and (isinstance(self.frozen_models, bool)
                                               or not isinstance(self.frozen_models, int) or self.frozen_models < 0):
            raise ValueError(f"auto.frozen_models must be an integer >= 0 or None, got {self.frozen_models!r}")
        if self.gpu_memory_bytes is not None and (
            not isinstance(self.gpu_memory_bytes, int) or self.gpu_memory_bytes < 1
        ):
            raise ValueError(f"auto.gpu_memory_bytes must be a positive integer or None, got {self.gpu_memory_bytes!r}")
        if self.memory_reserve_bytes is not None and (
            not isinstance(self.memory_reserve_bytes, int) or self.memory_reserve_bytes < 0
        ):
            raise ValueError(f"auto.memory_reserve_bytes must be an integer >= 0 or None, got {self.memory_reserve_bytes!r}")


def auto_problem(model: ModelSpec | Mapping[str, Any] | str, auto: AutoPlanConfig, training: TrainingSpec,
                 cluster: ClusterSpec, *, tensor_parallel: int = 1) -> Problem:
    """The planner's Problem for ``model`` trained as ``training`` says (the step's shape and
    the engine's settings, one TrainingSpec) on ``cluster``, with ``auto``'s planner inputs
    (profile, objective, missing meshes, reserve): what ``plan_auto`` searches and what
    adaptive AMSP (runtime/replan/adaptive.py) predicts steps with. ``tensor_parallel`` T > 1:
    the model runs TP T inside the node and the plan's factors are over the data-parallel
    world, gpus_per_node / T per node (tensor_parallel.py)."""
    reserve = {} if auto.memory_reserve_bytes is None else {"memory_reserve_bytes": auto.memory_reserve_bytes}
    return make_problem(model, cluster, training, auto.profile, objective=auto.objective,
                        missing=auto.missing, tensor_parallel=tensor_parallel, **reserve)


def plan_auto(model: ModelSpec | Mapping[str, Any] | str, auto: AutoPlanConfig, training: TrainingSpec,
              cluster: ClusterSpec, *, all_reduce: str | None = None, tensor_parallel: int = 1) -> Plan:
    """The planner's plan for ``model`` (a ModelSpec, a Hugging Face config dict or a preset):
    the best of ``auto_problem(...)`` (with ``all_reduce="auto"``, of the plan and mode
    ``resolve_auto`` picks). Raises NoFeasiblePlan or another one-line ValueError."""
    return resolve_auto(model, auto, training, cluster, all_reduce=all_reduce,
                        tensor_parallel=tensor_parallel).plan


# [Note: all_reduce "auto"]
# The engine runs a gradient all-reduce over a group with several ranks on each of several nodes
# as one collective (flat, DDP's) or as three (two_level: reduce-scatter in the node, all-reduce
# across, all-gather in the node; runtime/collectives.py). Which is faster depends on the link,
# so "auto" runs the one the planner's step model (objective "step") prices lower for the plan,
# whatever objective chose the factors: Eq. 1 (objective "comm") prices bytes only and can rank
# two-level cheaper where the engine, which pays for every issued collective, runs it slower;
# the step model's calibration charges each issued collective (profile.py [Note: a two-level
# all-reduce's time]). Two-level must win by more than the problem's tie tolerance: it issues
# three collectives where flat issues one, and the model's price of the extra ones is right in
# sign, not in size. With plan "auto" the factors are searched under each mode (the best plan
# can differ between them) and the step model picks between the two (plan, mode) pairs. A plan
# none of whose all-reduce groups has several ranks on each of several nodes runs flat,
# unpriced: both modes issue the same collective there. The measurements and the model's prices
# behind this: comparisons/results/design_history.md, "Flat or two-level all-reduce".


@dataclass(frozen=True, kw_only=True)
class AllReduceChoice:
    """The all-reduce mode a run uses and, when "auto" chose it, the step times it compared."""

    mode: str  # one of ALL_REDUCES
    step_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # mode -> modelled step
    plans: Mapping[str, str] = dataclasses.field(default_factory=dict)  # mode -> plan it priced
    why: str = ""  # set when "auto" chose without pricing

    def describe(self) -> str:
        if self.step_s:
            differ = len(set(self.plans.values())) > 1
            priced = ", ".join(f"{m}{f' ({self.plans[m]})' if differ else ''} {t:.3f} s"
                               for m, t in self.step_s.items())
            return f"all-reduce {self.mode} (auto; step model: {priced})"
        return f"all-reduce {self.mode}" + (f" (auto: {self.why})" if self.why else "")

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "step_s": dict(self.step_s), "plans": dict(self.plans), "why": self.why}


@dataclass(frozen=True, kw_only=True)
class Planned:
    """What a run executes: the plan's factors and its all-reduce mode."""

    plan: Plan
    all_reduce: AllReduceChoice
    # where the engine's gradient buckets close (planner/buckets.py [Note: where a bucket closes,
    # from the link]); None: the engine's default
    bucket_close_bytes: int | None = None


def two_level_applies(plan: Plan, *, gpus_per_node: int, num_nodes: int) -> bool:
    """Whether an all-reduce group of ``plan`` (T0_os's replica mesh, Tg's) has several ranks on
    each of several nodes: the only groups the engine runs two-level (topology/mesh.py)."""
    meshes = (plan.replica_mesh(gpus_per_node, num_nodes), plan.grad_mesh())
    return any(p0 > 1 and p1 > 1 for p0, p1 in meshes)


def unpriced_choice(plan: Plan, all_reduce: str, *, gpus_per_node: int,
                    num_nodes: int) -> AllReduceChoice | None:
    """The mode ``plan`` runs without the planner: the one asked for, or under "auto" flat where
    no group has a two-level form; None when "auto" has to price it. Routes that need planner
    inputs only for pricing (shard()'s config.auto) ask this first."""
    if not is_auto(all_reduce):
        check_one_of(all_reduce, ALL_REDUCES, "all_reduce")
        return AllReduceChoice(mode=all_reduce)
    if not two_level_applies(plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes):
        return AllReduceChoice(mode="flat", why="no all-reduce group of the plan has several ranks "
                                                "on each of several nodes")
    return None


def choose_all_reduce(problems: Mapping[str, Problem], plans: Mapping[str, Plan]) -> AllReduceChoice:
    """[Note: all_reduce "auto"]: ``problems`` prices the job under each of ALL_REDUCES, ``plans``
    is the plan each would run; the mode whose pair the step model prices lower."""
    cluster = problems["two_level"].cluster
    unpriced = unpriced_choice(plans["two_level"], "auto", gpus_per_node=cluster.gpus_per_node,
                               num_nodes=cluster.num_nodes)
    if unpriced is not None:
        return unpriced
    step_s = {m: evaluate(problems[m], plans[m], with_step=True).step.step_s for m in ALL_REDUCES}
    flat, two = step_s["flat"], step_s["two_level"]
    mode = "two_level" if two < flat * (1 - problems["two_level"].tie_tolerance) else "flat"
    return AllReduceChoice(mode=mode, step_s=step_s, plans={m: str(plans[m]) for m in ALL_REDUCES})


def search_all_reduce(problems: Mapping[str, Problem]) -> tuple[SearchResult, AllReduceChoice]:
    """The search under each all-reduce mode and the mode ``choose_all_reduce`` picks between
    their best plans; returns the picked mode's search."""
    results = {m: search(problems[m]) for m in ALL_REDUCES}
    choice = choose_all_reduce(problems, {m: r.best.plan for m, r in results.items()})
    return results[choice.mode], choice


def close_of(problem: Problem, plan: Plan) -> int | None:
    """Where ``plan``'s gradient buckets close when ``problem`` prices it (issued.py
    bucket_close_bytes; planner/buckets.py [Note: where a bucket closes, from the link])."""
    return bucket_close_bytes(problem.timer, plan, gpus_per_node=problem.cluster.gpus_per_node,
                              num_nodes=problem.cluster.num_nodes, bucket_bytes=problem.training.bucket_bytes,
                              given=problem.training.bucket_close_bytes)


def close_for(plan: Plan, auto: AutoPlanConfig, training: TrainingSpec, *, gpus_per_node: int, num_nodes: int,
              tensor_parallel: int = 1) -> int | None:
    """``close_of`` without a Problem (no memory per rank needed): ``auto.profile``'s timer on
    ``gpus_per_node`` physical ranks per node, ``plan`` over the data-parallel ones."""
    prof = auto.profile if isinstance(auto.profile, BandwidthProfile) else load_profile(auto.profile)
    timer = CommTimer(prof, gpus_per_node, auto.missing, all_reduce=training.all_reduce)
    return bucket_close_bytes(timer, plan, gpus_per_node=gpus_per_node // tensor_parallel, num_nodes=num_nodes,
                              bucket_bytes=training.bucket_bytes, given=training.bucket_close_bytes)


def resolve_auto(model: ModelSpec | Mapping[str, Any] | str, auto: AutoPlanConfig, training: TrainingSpec,
                 cluster: ClusterSpec, *, all_reduce: str | None = None, plan: Plan | None = None,
                 tensor_parallel: int = 1) -> Planned:
    """The plan (``plan``, or the planner's when None) and the all-reduce mode a run executes:
    ``all_reduce`` itself (None: ``training.all_reduce``), or with "auto" the mode [Note:
    all_reduce "auto"] picks. Raises NoFeasiblePlan or another one-line ValueError."""
    requested = training.all_reduce if all_reduce is None else all_reduce

    def problem(mode: str) -> Problem:
        return auto_problem(model, auto, dataclasses.replace(training, all_reduce=mode), cluster,
                            tensor_parallel=tensor_parallel)

    def planned(plan: Plan, choice: AllReduceChoice, prob: Problem | None = None) -> Planned:
        return Planned(plan=plan, all_reduce=choice, bucket_close_bytes=close_of(prob or problem(choice.mode), plan))

    if plan is not None:
        dp_gpus = cluster.gpus_per_node // tensor_parallel  # the plan's world
        unpriced = unpriced_choice(plan, requested, gpus_per_node=dp_gpus, num_nodes=cluster.num_nodes)
        if unpriced is not None:
            return planned(plan, unpriced)
    elif not is_auto(requested):
        check_one_of(requested, ALL_REDUCES, "all_reduce")
        prob = problem(requested)
        return planned(search(prob).best.plan, AllReduceChoice(mode=requested), prob)
    problems = {m: problem(m) for m in ALL_REDUCES}
    if plan is not None:
        choice = choose_all_reduce(problems, dict.fromkeys(ALL_REDUCES, plan))
        return planned(plan, choice, problems[choice.mode])
    result, choice = search_all_reduce(problems)
    return planned(result.best.plan, choice, problems[choice.mode])
