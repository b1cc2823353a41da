"""Which plans ``amsp tune`` measures, and the planner problems it compares them with.

[Note: the candidates]
Every legal plan (the pre-filter's, Eq. 3-7) that fits in memory, when there are at most 16 of
them: then the measured winner is the true optimum among the plans the planner may choose, and
the regret of any pick is exact. Otherwise the planner's top ``--top`` (default 8) under each
objective, plus the baselines (DDP, ZeRO-1/2/3, MiCS over one node) that fit. The picks of both
objectives, with and without the profile's calibration, are always included, so every regret can
be measured. ``--plan`` lists replace all of this. A plan equal to a baseline carries its name.

Pure Python (the planner).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amsp_ext.planner.plan import Plan, named_plan, resolve_plan, validate_plan
from amsp_ext.planner.profile import BandwidthProfile, load_profile
from amsp_ext.choices import PLANNER_OVERLAP_OF
from amsp_ext.planner.defaults import DEFAULT_RESERVE_BYTES
from amsp_ext.planner.search import Problem, make_problem, search
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
from amsp_ext.engine_config import training_spec as engine_training_spec
from amsp_ext.planner.step import OverlapRules
from amsp_ext.tune.spec import TuneConfig

__all__ = ["ALL_LEGAL_LIMIT", "Candidate", "Problems", "choose_plans", "make_problems"]

ALL_LEGAL_LIMIT = 16
DEFAULT_TOP = 8
_BASELINES = (("DDP", "ddp"), ("ZeRO-1", "zero1"), ("ZeRO-2", "zero2"), ("ZeRO-3", "zero3"))


@dataclass(frozen=True, kw_only=True)
class Candidate:
    plan: Plan
    label: str  # the plan's text, with a baseline's name when it is one

    @property
    def key(self) -> str:
        return str(self.plan)


@dataclass(frozen=True, kw_only=True)
class Problems:
    """The planner on this job: per objective, uncalibrated and (when the profile has one)
    calibrated."""

    uncalibrated: dict[str, Problem]
    calibrated: dict[str, Problem] | None

    def variants(self) -> dict[str, dict[str, Problem]]:
        out = {"uncalibrated": self.uncalibrated}
        if self.calibrated is not None:
            out["calibrated"] = self.calibrated
        return out


def training_spec(config: TuneConfig) -> TrainingSpec:
    return engine_training_spec(config.engine, config.batch)


def overlap_rules(config: TuneConfig) -> OverlapRules:
    """The step model's overlap switches for the engine's ``--no-overlap``."""
    off = {PLANNER_OVERLAP_OF[op] for op in config.engine.overlap.off}
    return OverlapRules(ag_rs="ag_rs" not in off, ar="ar" not in off, bc="bc" not in off)


def make_problems(config: TuneConfig, *, num_nodes: int, gpus_per_node: int, gpu_memory_bytes: int,
                  peak_flops: float | None = None, profile: BandwidthProfile | None = None
                  ) -> Problems:
    """The planner on this job. ``peak_flops``: the device's MFU peak (metrics.device_peak), which the uncalibrated step
    model takes 0.65 of; None keeps the planner's default (an A100's)."""
    prof = profile if profile is not None else load_profile(config.planner.profile)
    cluster = ClusterSpec(num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                          gpu_memory_bytes=gpu_memory_bytes,
                          **({"peak_flops": peak_flops} if peak_flops else {}))
    reserve = config.planner.memory_reserve_bytes
    reserve = DEFAULT_RESERVE_BYTES if reserve is None else reserve
    if reserve >= gpu_memory_bytes:
        raise ValueError(f"--memory-reserve ({reserve} B) must be below --gpu-memory "
                         f"({gpu_memory_bytes} B)")

    def build(p: BandwidthProfile) -> dict[str, Problem]:
        return {obj: make_problem(config.hf_config(), cluster, training_spec(config), p,
                                  objective=obj, missing="fit", memory_reserve_bytes=reserve,
                                  overlap=overlap_rules(config))
                for obj in ("comm", "step")}

    raw = dataclasses.replace(prof, calibration=None)
    return Problems(uncalibrated=build(raw),
                    calibrated=build(prof) if prof.calibration is not None else None)


def _label(plan: Plan, R: int, N: int) -> str:
    for name, key in _BASELINES:
        if named_plan(key, gpus_per_node=R, num_nodes=N) == plan:
            return f"{name} ({plan})"
    if plan.sp == plan.sg == plan.sos and plan.sp == R and plan.s1_p == 1 and N > 1:
        return f"MiCS {R} ({plan})"
    return str(plan)


def choose_plans(config: TuneConfig, problems: Problems) -> list[Candidate]:
    """The plans to measure, in the base order of the rounds (see the Note)."""
    first = problems.uncalibrated["step"]
    R, N = first.cluster.gpus_per_node, first.cluster.num_nodes
    if config.tune.plan_list:
        plans = []
        for text in config.tune.plan_list:
            p = validate_plan(resolve_plan(text, gpus_per_node=R, num_nodes=N),
                              gpus_per_node=R, num_nodes=N, structural_only=True)
            if p not in plans:
                plans.append(p)
        return [Candidate(plan=p, label=_label(p, R, N)) for p in plans]
    results = {(v, obj): search(prob) for v, probs in problems.variants().items()
               for obj, prob in probs.items()}
    fitting = list(results[("uncalibrated", "comm")].ranked)  # every legal plan that fits
    top = config.tune.top
    if top is None and len(fitting) <= ALL_LEGAL_LIMIT:
        chosen = [c.plan for c in sorted(fitting, key=lambda c: c.plan.as_tuple())]
    else:
        k = top or DEFAULT_TOP
        chosen = []
        for res in results.values():
            for c in res.ranked[:k]:
                if c.plan not in chosen:
                    chosen.append(c.plan)
        fits = {c.plan for c in fitting}
        for _, key in _BASELINES + (("MiCS", f"mics:{R}"),):
            p = named_plan(key, gpus_per_node=R, num_nodes=N)
            if p in fits and p not in chosen:
                chosen.append(p)
    for res in results.values():  # every pick is measured
        if res.best.plan not in chosen:
            chosen.append(res.best.plan)
    return [Candidate(plan=p, label=_label(p, R, N)) for p in chosen]
