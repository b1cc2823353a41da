"""The planner's search (paper Sec. IV-E): pre-filter, brute force, ranking and reasons.

Minimise the objective (Eq. 1: Tcomm; or the step time, see step.py) subject to the memory limit
(Eq. 2) over every plan the pre-filter admits (Eq. 3-7, sg in {sp, sos}).

[Note: ties]
A profile is a measurement with a few percent of noise, so plans whose objective is within
``tie_tolerance`` (default 1%) of the best are equally fast. Among them the planner prefers, in
order:
1. the plan whose communication grows least per extra micro-batch (Tp + Tg for one more
   micro-batch): it stays the better plan when M grows (a larger global batch, fewer GPUs), and
   at M = 1 it breaks the exact tie between sg = sp and sg = sos, which execute identically there;
2. the plan that needs less memory (more headroom against estimation error and fragmentation);
3. the smaller factor tuple (s0_p, s1_p, s0_g, s1_g, s0_os, s1_os), so the order is total.
The ranked list starts with the tied plans in that order, then the others by objective.

Pure Python + NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from amsp_ext.choices import OBJECTIVES
from amsp_ext.planner.cost import CommCost, comm_cost, param_gather_time
from amsp_ext.planner.memory import MemoryBreakdown, grad_bytes, memory_breakdown
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan, PlanError
from amsp_ext.planner.prefilter import Prefiltered, legal_plans, prefilter
from amsp_ext.planner.profile import BandwidthProfile, CommTimer, load_profile
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec, format_size
from amsp_ext.planner.step import DEFAULT_EFFICIENCY, OverlapRules, StepEstimate, step_estimate
from amsp_ext.planner.tensor_parallel import TPComm, check_tensor_parallel, tp_comm, tp_shard_spec
from amsp_ext.planner.defaults import (DEFAULT_MISSING_MESH, DEFAULT_OBJECTIVE, DEFAULT_PROFILE,
                                       DEFAULT_RESERVE_BYTES, GiB)

__all__ = [
    "Candidate",
    "NoFeasiblePlan",
    "Problem",
    "SearchResult",
    "make_problem",
    "pareto",
    "plan_for",
    "search",
    "sensitivity",
]

# [Note: memory reserve]
# Memory the model does not see: the CUDA context (about 0.5 GiB on A100-class GPUs), NCCL's
# communicator buffers (NCCL_BUFFSIZE = 4 MiB per channel and peer, for up to five process
# groups) and some caching-allocator slack. Plans must fit in the GPU's memory minus this.
# (the default, DEFAULT_RESERVE_BYTES, is defined in defaults.py)
# The slack, measured once (comparisons/results/design_history.md, "Memory reserve slack"): for three LLaMA-7B
# plans of one rank of 1,024, the CUDA caching allocator reserved 3.0-8.7 GiB above its
# allocated peak (5.3 GiB with expandable segments), while the allocated peak was within 0.5 %
# of the memory model for two plans and 8.5 % under it for the third. Cached blocks are freed
# before an out-of-memory, so how much of that slack a plan near the limit needs is not
# measured; the 2 GiB default is not sized from it.


class NoFeasiblePlan(PlanError):
    """No legal plan fits in memory. The one-line message says what would."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Everything one search needs; build it with ``make_problem``.

    With tensor parallelism (``tensor_parallel`` T > 1; tensor_parallel.py [Note: a TP job is an
    AMSP job of TP shards]) ``spec`` is one TP rank's shard and ``cluster`` the data-parallel
    world, R/T GPUs per node; ``model`` and ``node_gpus`` keep the whole model and the node."""

    spec: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    timer: CommTimer
    num_micro_batches: int
    objective: str = DEFAULT_OBJECTIVE
    efficiency: float = DEFAULT_EFFICIENCY
    overlap: OverlapRules = OverlapRules()
    tie_tolerance: float = 0.01
    memory_reserve_bytes: int = DEFAULT_RESERVE_BYTES
    tensor_parallel: int = 1
    whole_model: ModelSpec | None = None  # the model before TP sharding (None: ``spec``)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if not 0 <= self.tie_tolerance < 1:
            raise ValueError(f"tie_tolerance must be in [0, 1), got {self.tie_tolerance!r}")
        if not 0 <= self.memory_reserve_bytes < self.cluster.gpu_memory_bytes:
            raise ValueError(
                f"memory reserve must be >= 0 and below the GPU memory "
                f"({self.cluster.gpu_memory_bytes} bytes), got {self.memory_reserve_bytes}")

    @property
    def memory_limit(self) -> int:
        """What the plan may use: the GPU's memory minus the reserve (see the Note)."""
        return self.cluster.gpu_memory_bytes - self.memory_reserve_bytes

    @property
    def calibration(self):
        """The profile's measured step-model constants, or None (planner/calibration.py)."""
        return self.timer.profile.calibration

    def with_timer(self, timer: CommTimer) -> "Problem":
        return replace(self, timer=timer, _cache={})

    @property
    def model(self) -> ModelSpec:
        """The whole model (``spec`` is one TP rank's shard of it)."""
        return self.whole_model or self.spec

    @property
    def node_gpus(self) -> int:
        """GPUs per node (the data-parallel ``cluster`` has R/T of them)."""
        return self.cluster.gpus_per_node * self.tensor_parallel

    @property
    def global_batch_tokens(self) -> int:
        """Tokens of one step: data-parallel world x micro-batch x M x seq."""
        tr = self.training
        return self.cluster.world_size * tr.micro_batch_size * self.num_micro_batches * tr.seq_len

    @property
    def tp_comm(self) -> TPComm | None:
        """One micro-batch's TP all-reduces (None without TP), priced by this problem's timer."""
        if self.tensor_parallel == 1:
            return None
        if "tp" not in self._cache:
            self._cache["tp"] = tp_comm(self.model, self.training, self.timer, self.tensor_parallel)
        return self._cache["tp"]


def make_problem(
    model: ModelSpec | Mapping[str, Any] | str,
    cluster: ClusterSpec,
    training: TrainingSpec,
    profile: BandwidthProfile | str | Path = DEFAULT_PROFILE,
    *,
    objective: str = DEFAULT_OBJECTIVE,
    missing: str = DEFAULT_MISSING_MESH,
    efficiency: float = DEFAULT_EFFICIENCY,
    tie_tolerance: float = 0.01,
    overlap: OverlapRules = OverlapRules(),
    memory_reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    tensor_parallel: int = 1,
) -> Problem:
    """Resolve the inputs: a ModelSpec, an HF config dict or a preset name; a profile or its
    name/path; ``tensor_parallel`` T, the TP degree inside the node (the six factors are then
    searched over the data-parallel world, tensor_parallel.py). Raises a one-line ValueError
    for bad input."""
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str):
        spec = ModelSpec.preset(model)
    else:
        spec = ModelSpec.from_hf_config(model)
    check_tensor_parallel(tensor_parallel, spec, cluster.gpus_per_node)
    prof = profile if isinstance(profile, BandwidthProfile) else load_profile(profile)
    # the node's GPUs: every group of a shape is active at once on all R of them, TP or not
    timer = CommTimer(prof, cluster.gpus_per_node, missing, all_reduce=training.all_reduce)
    tp = {}
    if tensor_parallel > 1:
        tp = {"tensor_parallel": tensor_parallel, "whole_model": spec}
        spec = tp_shard_spec(spec, tensor_parallel)
        cluster = replace(cluster, gpus_per_node=cluster.gpus_per_node // tensor_parallel)
    M = training.micro_batches(cluster.world_size)
    return Problem(spec=spec, cluster=cluster, training=training, timer=timer,
                   num_micro_batches=M, objective=objective, efficiency=efficiency,
                   tie_tolerance=tie_tolerance, overlap=overlap,
                   memory_reserve_bytes=memory_reserve_bytes, **tp)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    plan: Plan
    comm: CommCost
    memory: MemoryBreakdown
    feasible: bool
    growth_s: float  # communication added by one more micro-batch (Tp + Tg per micro-batch)
    step: StepEstimate | None = None

    def objective(self, kind: str) -> float:
        if kind == "step":
            assert self.step is not None
            return self.step.step_s
        return self.comm.total


def _gather(problem: Problem, mesh: tuple[int, int]) -> float:
    key = ("gather", mesh)
    if key not in problem._cache:
        problem._cache[key] = param_gather_time(problem.spec, problem.training, problem.timer, mesh)
    return problem._cache[key]


def evaluate(problem: Problem, plan: Plan, *, with_step: bool | None = None) -> Candidate:
    """Memory, communication terms (and step time) of one plan."""
    R, N, M = problem.cluster.gpus_per_node, problem.cluster.num_nodes, problem.num_micro_batches
    spec, training, timer = problem.spec, problem.training, problem.timer
    mem = memory_breakdown(spec, plan, training, gpus_per_node=R, num_nodes=N)
    per_mb_gather = _gather(problem, plan.mesh("p"))
    comm = comm_cost(plan, spec, training, timer, gpus_per_node=R, num_nodes=N,
                     num_micro_batches=M, t_p_per_micro_batch=per_mb_gather)
    U = training.bucket_bytes
    buckets = grad_bytes(training) * spec.num_params / (U * plan.sp)
    growth = per_mb_gather + buckets * timer.time("allreduce", U, *plan.grad_mesh())
    tp = problem.tp_comm
    if tp is not None:
        comm = replace(comm, t_tp=M * tp.per_micro_batch_s)
        growth += tp.per_micro_batch_s
    feasible = mem.total <= problem.memory_limit
    if with_step is None:
        with_step = problem.objective == "step" and feasible
    step = None
    if with_step:
        step = step_estimate(plan, spec, training, problem.cluster, timer, comm,
                             num_micro_batches=M, efficiency=problem.efficiency,
                             overlap=problem.overlap, calibration=problem.calibration,
                             tensor_parallel=tp)
    return Candidate(plan=plan, comm=comm, memory=mem, feasible=feasible, growth_s=growth,
                     step=step)


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    problem: Problem
    prefiltered: Prefiltered
    ranked: tuple[Candidate, ...]  # feasible, best first
    infeasible: tuple[Candidate, ...]
    num_tied: int  # ranked[:num_tied] are within the tie tolerance of the best

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @cached_property
    def _tied_plans(self) -> frozenset[Plan]:
        return frozenset(c.plan for c in self.ranked[: self.num_tied])

    def objective(self, c: Candidate) -> float:
        return c.objective(self.problem.objective)

    def reason(self, c: Candidate) -> str:
        """Why ``c`` is not the chosen plan (empty for the chosen one)."""
        limit = self.problem.memory_limit
        if not c.feasible:
            over = c.memory.total - limit
            return (f"out of memory by {over} bytes ({c.memory.total / GiB:.1f} GiB needed, "
                    f"{limit / GiB:.1f} GiB usable)")
        best = self.best
        if c.plan == best.plan:
            return ""
        delta = self.objective(c) - self.objective(best)
        if c.plan in self._tied_plans:
            if c.growth_s != best.growth_s:
                why = f"grows faster with M (+{c.growth_s - best.growth_s:.4f} s per micro-batch)"
            elif c.memory.total != best.memory.total:
                why = f"needs {(c.memory.total - best.memory.total) / GiB:.1f} GiB more memory"
            else:
                why = "larger factors"
            return (f"tied within {self.problem.tie_tolerance:.0%} ({delta:+.4f} s); "
                    f"tie-break: {why}")
        pct = delta / self.objective(best) * 100 if self.objective(best) > 0 else math.inf
        return f"slower by {delta:.4f} s (+{pct:.1f}%)"

    @property
    def extrapolated(self) -> list[str]:
        return [f"{op} {p0}x{p1}" for op, p0, p1 in sorted(self.problem.timer.extrapolated)]


def search(problem: Problem) -> SearchResult:
    """Brute force over the pre-filtered plans; raises NoFeasiblePlan when none fits."""
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    pf = prefilter(R, N)
    cands = [evaluate(problem, p) for p in pf.accepted]
    feasible = [c for c in cands if c.feasible]
    if not feasible:
        raise NoFeasiblePlan(_nothing_fits(problem, cands))
    kind = problem.objective
    best = min(c.objective(kind) for c in feasible)
    cutoff = best * (1 + problem.tie_tolerance)
    tied = sorted((c for c in feasible if c.objective(kind) <= cutoff),
                  key=lambda c: (c.growth_s, c.memory.total, c.plan.as_tuple()))
    rest = sorted((c for c in feasible if c.objective(kind) > cutoff),
                  key=lambda c: (c.objective(kind), c.growth_s, c.memory.total, c.plan.as_tuple()))
    infeasible = sorted((c for c in cands if not c.feasible),
                        key=lambda c: (c.memory.total, c.plan.as_tuple()))
    return SearchResult(problem=problem, prefiltered=pf, ranked=tuple(tied + rest),
                        infeasible=tuple(infeasible), num_tied=len(tied))


def _nothing_fits(problem: Problem, cands: list[Candidate]) -> str:
    limit = problem.memory_limit
    least = min(cands, key=lambda c: (c.memory.total, c.plan.as_tuple()))
    reserve = problem.memory_reserve_bytes
    msg = (f"no plan fits in {format_size(limit)} per GPU ({format_size(problem.cluster.gpu_memory_bytes)}"
           f" less a {format_size(reserve)} reserve) on {problem.cluster.num_nodes} x "
           f"{problem.cluster.gpus_per_node} GPUs{_tp_world(problem)}: the least memory any legal plan "
           f"needs is "
           f"{format_size(least.memory.total)} ({least.plan}), i.e. GPUs of at least "
           f"{format_size(least.memory.total + reserve)}")
    nodes = _nodes_that_fit(problem)
    if nodes is not None:
        msg += f", or use at least {nodes} nodes"
    elif problem.training.num_micro_batches is None:
        msg += "; no larger cluster that the global batch allows fits either"
    if not problem.training.recompute:
        msg += f" (activations alone need {format_size(least.memory.kept_activations)}; try --recompute)"
    return msg


def _tp_world(problem: Problem) -> str:
    t = problem.tensor_parallel
    return "" if t == 1 else f" (the data-parallel world of TP {t} on {problem.node_gpus} GPUs per node)"


def _nodes_that_fit(problem: Problem, max_factor: int = 64) -> int | None:
    """The smallest multiple of N nodes (up to ``max_factor`` x N, and as far as the global batch
    can feed) on which some legal plan fits."""
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    spec, training = problem.spec, problem.training
    for n in range(2 * N, max_factor * N + 1, N):
        if training.num_micro_batches is None:
            seqs = training.global_batch_size or training.global_batch_tokens // training.seq_len
            if seqs < n * R * training.micro_batch_size:
                return None  # the batch cannot feed this many GPUs
            try:
                training.micro_batches(n * R)
            except ValueError:
                continue
        least = min(memory_breakdown(spec, p, training, gpus_per_node=R, num_nodes=n).total
                    for p in legal_plans(R, n))
        if least <= problem.memory_limit:
            return n
    return None


# -- beyond the paper: frontier and sensitivity ----------------------------------------------

def pareto(result: SearchResult) -> list[Candidate]:
    """Feasible plans that no other plan beats on both memory and objective (memory ascending)."""
    by_mem = sorted(result.ranked, key=lambda c: (c.memory.total, result.objective(c),
                                                  c.plan.as_tuple()))
    front: list[Candidate] = []
    for c in by_mem:
        if not front or result.objective(c) < result.objective(front[-1]):
            front.append(c)
    return front


@dataclass(frozen=True, kw_only=True)
class SensitivityCase:
    intra: float
    inter: float
    plan: Plan
    changed: bool
    regret_s: float  # how much slower the nominal plan is than this case's best, in this case


def sensitivity(result: SearchResult, factor: float) -> list[SensitivityCase]:
    """Re-plan with intra-node and cross-node bandwidths scaled independently by 1 +- factor."""
    if not 0 < factor < 1:
        raise ValueError(f"sensitivity factor must be in (0, 1), got {factor!r}")
    nominal = result.best.plan
    cases = []
    for fi in (1 - factor, 1.0, 1 + factor):
        for fo in (1 - factor, 1.0, 1 + factor):
            if fi == 1.0 and fo == 1.0:
                continue
            prob = result.problem.with_timer(result.problem.timer.scaled(intra=fi, inter=fo))
            res = search(prob)
            kept = next((c for c in res.ranked if c.plan == nominal), None)
            regret = (res.objective(kept) - res.objective(res.best)) if kept else math.inf
            cases.append(SensitivityCase(intra=fi, inter=fo, plan=res.best.plan,
                                         changed=res.best.plan != nominal, regret_s=regret))
    return cases


def plan_for(
    model: ModelSpec | Mapping[str, Any] | str,
    cluster: ClusterSpec,
    training: TrainingSpec,
    profile: BandwidthProfile | str | Path = DEFAULT_PROFILE,
    **options: Any,
) -> Plan:
    """The plan ``amsp_ext.shard(model, "auto", ...)`` uses: the search's best plan.

    ``model`` is a ModelSpec, a Hugging Face config dict (``model.config.to_dict()``) or a
    preset name; ``options`` are ``make_problem``'s (objective, missing, efficiency,
    tie_tolerance, overlap). Raises NoFeasiblePlan or another one-line ValueError.
    """
    return search(make_problem(model, cluster, training, profile, **options)).best.plan
