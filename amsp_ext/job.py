"""A training job described once, and ``resolve``: the one place its "auto" requests are decided.

[Note: one job, resolved once]
Every entry point that runs or plans a job - ``amsp train``'s launcher and its ranks, the AMSP
rows of ``amsp compare``, ``amsp dryrun``, ``amsp migrate``, ``shard()`` on every route (your
own loop, a ds_config, Accelerate, the HF Trainer) and ``switch_plan`` - builds a ``Job`` from
its own surface (flags, a ds_config, a ShardConfig) and calls ``resolve``. Nothing else turns a
plan or all-reduce request of "auto" into a choice (tests/test_design_tree.py finds a second
reader). A Job is:

- ``model``: what the planner prices (a Hugging Face config dict, a ModelSpec or a preset
  name; None where the model has no readable shape: only explicit plans then);
- ``num_nodes`` and ``engine``: the engine's settings (EngineConfig: ranks per node, tensor
  parallelism, dtypes, buckets, units, recompute, the all-reduce request) with, in
  ``engine.auto`` (AutoPlanConfig), the step's shape (planner/specs.py StepShape, declared
  once) and the planner's inputs (profile, objective, missing meshes, the optimizer the
  planner prices, the frozen models beside the trained one, memory); the engine's own
  ``optimizer_kind`` says whether the optimizer reads whole tensors;
- ``plan``: the request ("auto", a name, factors or a Plan).

``needs(job)`` says what resolving still lacks: the profile of *this* cluster ("cluster": only
its ranks can measure it) and the memory of a rank's device (only a rank can read its GPU).
The planner takes typed inputs, one conversion away: ``engine_config.training_spec`` (the
step under the engine's settings, a TrainingSpec) and a ClusterSpec of the world.
A launcher that has both (a cached profile; a CPU's RAM or ``--gpu-memory``) resolves and hands
the ranks the result, ``ResolvedJob.to_dict`` (``amsp train``, ``amsp compare`` and ``amsp
dryrun`` do); otherwise the ranks fill what is missing and call the same function with the
same inputs, every rank the same deterministic search (runtime/preflight.py). A ResolvedJob keeps
its request beside the choice: adaptive AMSP may replace a plan that was asked as "auto" only.

``amsp plan`` and ``amsp simulate`` are reports of the planner (every plan, every TP degree),
not jobs: they search and rank with the planner directly and run nothing.

Pure Python, torch-free: the launchers validate and plan with it before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from amsp_ext.choices import ALL_REDUCES
from amsp_ext.engine_config import EngineConfig, training_spec
from amsp_ext.planner import auto as planner_auto
from amsp_ext.planner.auto import AllReduceChoice, AutoPlanConfig
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_PROFILE
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan, PlanError, is_auto, resolve_plan, validate_plan
from amsp_ext.planner.profile import BandwidthProfile
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

__all__ = ["Job", "ResolvedJob", "check_fits", "needs", "problem", "resolve"]


@dataclass(frozen=True, kw_only=True)
class Job:
    """What a training job is ([Note: one job, resolved once]). ``engine.gpus_per_node`` is the
    physical ranks per node R; under tensor parallelism T the plan's factors are over the
    data-parallel world, R / T per node (``dp_gpus_per_node``)."""

    model: ModelSpec | Mapping[str, Any] | str | None
    num_nodes: int
    engine: EngineConfig
    plan: Plan | str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise ValueError(f"job.num_nodes must be an integer >= 1, got {self.num_nodes!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"job.engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.engine.gpus_per_node is None:
            raise ValueError("job.engine.gpus_per_node must be set (the ranks per node)")
        if not isinstance(self.plan, (str, Plan)):
            raise PlanError(f"plan must be a Plan or a string ('auto', 'zero3', 'p=2x1,g=2x1,os=2x2', "
                            f"...), got {type(self.plan).__name__}")

    @property
    def gpus_per_node(self) -> int:
        return int(self.engine.gpus_per_node)  # type: ignore[arg-type]  (checked in __post_init__)

    @property
    def tensor_parallel(self) -> int:
        return self.engine.tensor_parallel

    @property
    def dp_gpus_per_node(self) -> int:
        return self.gpus_per_node // self.tensor_parallel

    @property
    def plan_is_auto(self) -> bool:
        return is_auto(self.plan)

    def explicit_plan(self, *, field: str = "plan") -> Plan | None:
        """The requested plan fitted to the data-parallel world (None for "auto"); a plan the
        world cannot run is one line naming ``field``."""
        if self.plan_is_auto:
            return None
        plan = resolve_plan(self.plan, gpus_per_node=self.dp_gpus_per_node, num_nodes=self.num_nodes,
                            field=field)
        return validate_plan(plan, gpus_per_node=self.dp_gpus_per_node, num_nodes=self.num_nodes,
                             structural_only=True)

    def priced(self) -> bool:
        """Whether resolving reads the planner: plan "auto", an all-reduce "auto" that the plan's
        groups leave a choice to, or an adaptive run (its monitor predicts every step)."""
        if self.engine.adaptive is not None or self.plan_is_auto:
            return True
        return planner_auto.unpriced_choice(self.explicit_plan(), self.engine.all_reduce,
                                            gpus_per_node=self.dp_gpus_per_node,
                                            num_nodes=self.num_nodes) is None


def needs(job: Job) -> frozenset[str]:
    """What ``resolve(job)`` still lacks: ``"profile"`` (the planner's profile is this cluster's,
    not yet measured or found) and ``"memory"`` (no memory per rank given). Empty when the job
    resolves without the planner. A job that must be priced but gives the planner nothing to
    price with is refused here, in one line, before any collective."""
    if not job.priced():
        return frozenset()
    a = _auto(job)
    _model(job)
    out = set()
    if isinstance(a.profile, str) and a.profile == CLUSTER_PROFILE:
        out.add("profile")
    if a.gpu_memory_bytes is None:
        out.add("memory")
    return frozenset(out)


def _what(job: Job) -> str:
    return "plan 'auto'" if job.plan_is_auto else (
        "config.adaptive" if job.engine.adaptive is not None else "config.all_reduce='auto'")


def _auto(job: Job) -> AutoPlanConfig:
    if job.engine.auto is None:
        raise PlanError(f"{_what(job)} needs config.auto=AutoPlanConfig(seq_len=..., micro_batch_size=..., "
                        "num_micro_batches=...) to size the step for the planner")
    return job.engine.auto


def _model(job: Job):
    if job.model is None:
        raise PlanError(f"{_what(job)} needs a Hugging Face model (model.config) to read its shape")
    return job.model


@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """A Job with its requests decided: the plan, the all-reduce mode and the profile the planner
    read. ``engine`` is the job's EngineConfig as the engine runs it (the mode decided, the
    profile concrete); ``job.plan`` keeps the request."""

    job: Job
    plan: Plan
    all_reduce: AllReduceChoice
    profile: str | BandwidthProfile | None = None  # what the planner read (None: not priced)
    gpu_memory_bytes: int | None = None  # the memory per rank it planned for
    # where the profile came from (topology/profile_cache.ProfileSource.as_dict()); None: no
    # profile, or a named one the planner loaded itself
    profile_source: Mapping[str, Any] | None = None
    # where the engine's gradient buckets close (planner/buckets.py [Note: where a bucket closes,
    # from the link]); None: not priced, the engine's default
    bucket_close_bytes: int | None = None

    @property
    def engine(self) -> EngineConfig:
        auto = self.job.engine.auto
        if auto is not None and self.profile is not None:
            auto = dataclasses.replace(auto, profile=self.profile)
        return dataclasses.replace(self.job.engine, all_reduce=self.all_reduce.mode, auto=auto,
                                   grad_bucket_close_bytes=self.bucket_close_bytes
                                   or self.job.engine.grad_bucket_close_bytes)

    def describe(self) -> str:
        asked = "planner" if self.job.plan_is_auto else f"given: {self.job.plan}"
        return f"plan {self.plan} ({asked}); {self.all_reduce.describe()}"

    def to_dict(self) -> dict[str, Any]:
        """What a launcher hands its ranks (JSON): the decisions and the request they answer;
        the ranks rebuild the Job from their own surface (``from_dict`` checks they agree)."""
        profile = self.profile
        if isinstance(profile, BandwidthProfile):
            profile = profile.source
        return {"plan_request": str(self.job.plan), "plan": str(self.plan),
                "all_reduce": self.all_reduce.as_dict(), "profile": profile,
                "gpu_memory_bytes": self.gpu_memory_bytes, "bucket_close_bytes": self.bucket_close_bytes,
                "profile_source": dict(self.profile_source) if self.profile_source else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], job: Job) -> "ResolvedJob":
        """The launcher's decisions for ``job``, as the ranks rebuilt it; refused in one line
        when they answer another request."""
        if str(d.get("plan_request")) != str(job.plan):
            raise PlanError(f"resolved job: the launcher resolved plan {d.get('plan_request')!r}, "
                            f"this rank's job asks for {job.plan!r}")
        ar = d["all_reduce"]
        if ar["mode"] not in ALL_REDUCES:
            raise PlanError(f"resolved job: all_reduce mode must be one of {', '.join(ALL_REDUCES)}, "
                            f"got {ar['mode']!r}")
        plan = resolve_plan(d["plan"], gpus_per_node=job.dp_gpus_per_node, num_nodes=job.num_nodes)
        validate_plan(plan, gpus_per_node=job.dp_gpus_per_node, num_nodes=job.num_nodes,
                      structural_only=True)
        close = d.get("bucket_close_bytes")
        if close is not None and (not isinstance(close, int) or isinstance(close, bool) or close < 1):
            raise PlanError(f"resolved job: bucket_close_bytes must be an integer >= 1 or null, got {close!r}")
        return cls(job=job, plan=plan, all_reduce=AllReduceChoice(**ar), profile=d.get("profile"),
                   gpu_memory_bytes=d.get("gpu_memory_bytes"), profile_source=d.get("profile_source"),
                   bucket_close_bytes=close)


def resolve(job: Job, *, profile: str | BandwidthProfile | None = None, gpu_memory_bytes: int | None = None,
            profile_source: Mapping[str, Any] | None = None) -> ResolvedJob:
    """``job`` with its plan and all-reduce requests decided ([Note: one job, resolved once]).
    ``profile`` / ``gpu_memory_bytes``: what ``needs(job)`` asked for (a measured or cached
    profile in place of "cluster"; a rank's memory), else the job's own. Raises NoFeasiblePlan
    or another one-line ValueError."""
    plan = job.explicit_plan()
    if not job.priced():
        choice = planner_auto.unpriced_choice(plan, job.engine.all_reduce, gpus_per_node=job.dp_gpus_per_node,
                                              num_nodes=job.num_nodes)
        return ResolvedJob(job=job, plan=plan, all_reduce=choice,  # type: ignore[arg-type]
                           bucket_close_bytes=_close_unpriced(job, plan, choice.mode))
    auto = _planning_inputs(job, profile, gpu_memory_bytes)
    # through the module: tests observe the one call every route makes
    training, cluster = _planner_inputs(job, auto, job.engine.all_reduce)
    planned = planner_auto.resolve_auto(_model(job), auto, training, cluster, all_reduce=job.engine.all_reduce,
                                        plan=plan, tensor_parallel=job.tensor_parallel)
    return ResolvedJob(job=job, plan=planned.plan, all_reduce=planned.all_reduce, profile=auto.profile,
                       gpu_memory_bytes=auto.gpu_memory_bytes, profile_source=profile_source,
                       bucket_close_bytes=planned.bucket_close_bytes)


def _close_unpriced(job: Job, plan: Plan, mode: str) -> int | None:
    """An unpriced job whose engine names a profile still closes its buckets by that link
    (planner/buckets.py [Note: where a bucket closes, from the link]); the measured "cluster"
    profile is only read where the job is priced."""
    auto = job.engine.auto
    if auto is None or (isinstance(auto.profile, str) and auto.profile == CLUSTER_PROFILE):
        return job.engine.grad_bucket_close_bytes
    training = training_spec(job.engine, auto, all_reduce=mode)
    return planner_auto.close_for(plan, auto, training, gpus_per_node=job.gpus_per_node, num_nodes=job.num_nodes,
                                  tensor_parallel=job.tensor_parallel)


def problem(job: "Job | ResolvedJob", *, all_reduce: str | None = None):
    """The planner's Problem of a job: what its plan is searched in, what the adaptive monitor
    predicts each step with (a ResolvedJob: with the profile, memory and all-reduce mode it was
    resolved with), under ``all_reduce`` (default: the mode it runs, or asks for)."""
    resolved = job if isinstance(job, ResolvedJob) else None
    job = resolved.job if resolved is not None else job
    auto = _planning_inputs(job, resolved.profile if resolved else None,
                            resolved.gpu_memory_bytes if resolved else None)
    mode = all_reduce or (resolved.all_reduce.mode if resolved else job.engine.all_reduce)
    training, cluster = _planner_inputs(job, auto, mode)
    return planner_auto.auto_problem(_model(job), auto, training, cluster, tensor_parallel=job.tensor_parallel)


def check_fits(job: Job, plan: Plan, gpu_memory_bytes: int, *, all_reduce: str | None = None,
               profile: str | BandwidthProfile | None = None, reserve_bytes: int = 0) -> None:
    """Refuse ``plan`` in one line where the planner's memory model says it cannot fit in
    ``gpu_memory_bytes`` less ``reserve_bytes`` (a launcher's check before any rank starts). The
    memory model reads no bandwidth: without a resolved ``profile`` the bundled default serves,
    and an undecided all-reduce is priced flat (both modes hold the same bytes)."""
    from amsp_ext.planner.search import evaluate
    from amsp_ext.planner.specs import format_size

    auto = dataclasses.replace(_auto(job), memory_reserve_bytes=reserve_bytes, gpu_memory_bytes=gpu_memory_bytes)
    if profile is not None:
        auto = dataclasses.replace(auto, profile=profile)
    elif isinstance(auto.profile, str) and auto.profile == CLUSTER_PROFILE:
        auto = dataclasses.replace(auto, profile=DEFAULT_PROFILE)
    training, cluster = _planner_inputs(job, auto, all_reduce or job.engine.all_reduce)
    prob = planner_auto.auto_problem(_model(job), auto, training, cluster, tensor_parallel=job.tensor_parallel)
    mem = evaluate(prob, plan).memory
    if mem.total > prob.memory_limit:
        raise ValueError(
            f"plan {plan} does not fit: the planner's memory model needs {format_size(mem.total)} per "
            f"rank (activations {format_size(mem.kept_activations)}) of {format_size(gpu_memory_bytes)}; "
            f"lower --micro-batch-size or --seq-len, use --recompute or a more sharded --plan, or give "
            f"--gpu-memory")


def _planning_inputs(job: Job, profile, gpu_memory_bytes) -> AutoPlanConfig:
    auto = _auto(job)
    if profile is not None:
        auto = dataclasses.replace(auto, profile=profile)
    if gpu_memory_bytes is not None and auto.gpu_memory_bytes is None:
        auto = dataclasses.replace(auto, gpu_memory_bytes=gpu_memory_bytes)
    missing = [what for what, ok in (("the cluster's profile", not (isinstance(auto.profile, str)
                                                                   and auto.profile == CLUSTER_PROFILE)),
                                     ("the memory per rank", auto.gpu_memory_bytes is not None)) if not ok]
    if missing:
        raise PlanError(f"{_what(job)}: resolving needs {' and '.join(missing)} (needs(job) says what "
                        f"to measure first)")
    return auto


def _planner_inputs(job: Job, auto: AutoPlanConfig, all_reduce: str) -> tuple[TrainingSpec, ClusterSpec]:
    """The planner's typed inputs of ``job``: its step run by its engine's settings, priced
    under ``all_reduce`` ("auto": priced flat here, resolve_auto prices each mode), and its
    world (R physical ranks per node; T is passed beside it) with the memory per rank."""
    mode = "flat" if is_auto(all_reduce) else all_reduce
    cluster = ClusterSpec(num_nodes=job.num_nodes, gpus_per_node=job.gpus_per_node,
                          gpu_memory_bytes=auto.gpu_memory_bytes, nodes_per_leaf=job.engine.nodes_per_leaf)
    return training_spec(job.engine, auto, all_reduce=mode), cluster
