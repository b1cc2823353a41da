"""``amsp simulate --tensor-parallel``: tensor-parallel layouts side by side at one scale.

[Note: the TP rows]
For each model and GPU count the rows are, all on AMSP's engine as the step model has it
(simulate.py [Note: engine assumptions], ``ideal``) and all under the same batch rule:
* ``joint``: the planner's pick of T with the six factors (joint.py [Note: choosing T]) among
  the degrees asked for (``auto``: every degree the node and the model allow);
* ``tp{T}``, one per degree the node and the model allow: the planner's best plan of that T's
  data-parallel world; ``tp1`` is today's AMSP (pure data parallelism);
* ``tp8-zero3``: torchtitan's recipe, TP 8 inside the node and ZeRO-3 (FSDP's full shard)
  over the data-parallel world.
A row that cannot run says why in one line (its global batch exceeds the cap, the batch does
not divide over its world, no plan fits, the model or the node does not take T) and keeps
its place: nothing vanishes from the table.

The batch rule is the planner's: ``micro_batches`` fixes M per data-parallel rank (the global
batch then shrinks as T grows), otherwise ``global_batch_tokens`` fixes the batch (M grows
with T). Recomputation is used as the planner needs it: a row is planned without it, and
only when no plan fits is it planned again with it (the row names which). The objective is
the step time (these rows compare MFU). Every number is the planner's prediction.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from amsp_ext.planner.joint import search_tensor_parallel
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import named_plan
from amsp_ext.planner.profile import BandwidthProfile, load_profile
from amsp_ext.planner.search import (
    GiB, Candidate, NoFeasiblePlan, Problem, SearchResult, evaluate, make_problem, search,
)
from amsp_ext.planner.specs import ClusterSpec, paper_job
from amsp_ext.planner.tensor_parallel import check_tensor_parallel, tp_degrees

__all__ = ["TPRow", "simulate_tp", "tp_row_labels"]

TORCHTITAN_TP = 8  # torchtitan's LLaMA presets: TP over the 8 GPUs of a node, FSDP across


def tp_row_labels(degrees: tuple[int, ...]) -> dict[str, str]:
    """Row key -> label, in table order."""
    out = {"joint": "joint pick (planner)"}
    for t in degrees:
        out[f"tp{t}"] = "TP 1: today's AMSP (planner)" if t == 1 else f"TP {t} + AMSP (planner)"
    out["tp8-zero3"] = "TP 8 + ZeRO-3 (torchtitan)"
    return out


@dataclass(frozen=True, kw_only=True)
class TPRow:
    """One configuration of one model at one GPU count; ``reason`` says why it cannot run."""

    model: str
    gpus: int
    system: str
    label: str
    tensor_parallel: int | None
    plan: str | None = None
    recompute: bool | None = None
    global_batch_tokens: int | None = None
    num_micro_batches: int | None = None
    data_parallel_world: str | None = None  # "N x R/T"
    memory_gib: float | None = None
    mfu: float | None = None
    tokens_per_gpu_per_s: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    tp_comm_s: float | None = None
    exposed_comm_s: float | None = None  # AMSP's, beside the TP all-reduces
    tp_allreduce_bytes: int | None = None  # one activation all-reduce, b*s*h*e
    tp_layer_bytes: int | None = None  # one layer's TP bytes per micro-batch (incl. recompute)
    extrapolated: tuple[str, ...] = ()  # meshes the profile lacks that the row's search fitted
    reason: str = ""

    @property
    def tp_share(self) -> float | None:
        return None if self.step_s is None else self.tp_comm_s / self.step_s

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "extrapolated": list(self.extrapolated), "tp_share": self.tp_share}


class _Scale:
    """One model at one GPU count: builds and searches each degree's problem once."""

    def __init__(self, spec: ModelSpec, gpus: int, settings, profile: BandwidthProfile) -> None:
        R = min(settings.gpus_per_node, gpus)
        self.spec, self.gpus, self.settings, self.profile = spec, gpus, settings, profile
        self.cluster = ClusterSpec(num_nodes=gpus // R, gpus_per_node=R,
                                   gpu_memory_bytes=settings.gpu_memory_bytes)
        self.cap = settings.max_global_batch_tokens
        self._found: dict[int, SearchResult] = {}

    def problem(self, t: int, recompute: bool = False) -> Problem:
        s = self.settings
        batch = ({"num_micro_batches": s.micro_batches} if s.micro_batches is not None
                 else {"global_batch_tokens": s.global_batch_tokens})
        training = paper_job(seq_len=s.shape.seq_len, micro_batch_size=s.shape.micro_batch_size,
                             recompute=recompute, precision=s.precision, **batch)
        return make_problem(self.spec, self.cluster, training, self.profile, objective="step",
                            efficiency=s.efficiency, missing=s.missing_mesh, tensor_parallel=t)

    def search(self, t: int) -> SearchResult:
        """The best plan of T's world, with recomputation only where nothing fits without."""
        if t not in self._found:
            try:
                self._found[t] = search(self.problem(t))
            except NoFeasiblePlan:
                self._found[t] = search(self.problem(t, recompute=True))
        return self._found[t]

    def over_cap(self, problem: Problem) -> str:
        tokens = problem.global_batch_tokens
        if self.cap is None or tokens <= self.cap:
            return ""
        return f"global batch of {tokens} tokens exceeds --max-global-batch-tokens {self.cap}"

    def row(self, system: str, label: str, t: int | None, problem: Problem, cand: Candidate) -> TPRow:
        st, tp, cl = cand.step, problem.tp_comm, problem.cluster
        return TPRow(
            model=self.spec.name, gpus=self.gpus, system=system, label=label, tensor_parallel=t,
            plan=str(cand.plan), recompute=problem.training.recompute,
            global_batch_tokens=problem.global_batch_tokens,
            num_micro_batches=problem.num_micro_batches,
            data_parallel_world=f"{cl.num_nodes} x {cl.gpus_per_node}",
            memory_gib=cand.memory.total / GiB, mfu=st.mfu,
            tokens_per_gpu_per_s=st.tokens_per_gpu_per_s, step_s=st.step_s, compute_s=st.compute_s,
            tp_comm_s=st.tp_comm_s, exposed_comm_s=st.exposed_comm_s,
            tp_allreduce_bytes=tp.activation_bytes if tp else 0,
            tp_layer_bytes=tp.layer_bytes if tp else 0,
            extrapolated=tuple(f"{op} {p0}x{p1}" for op, p0, p1 in sorted(problem.timer.extrapolated)))

    def out(self, system: str, label: str, t: int | None, reason: str, tokens: int | None = None) -> TPRow:
        return TPRow(model=self.spec.name, gpus=self.gpus, system=system, label=label,
                     tensor_parallel=t, global_batch_tokens=tokens, reason=reason)

    def admit(self, system: str, label: str, t: int) -> Problem | TPRow:
        """T's problem without recomputation, or the row saying why T cannot run at all."""
        try:
            check_tensor_parallel(t, self.spec, self.cluster.gpus_per_node)
            problem = self.problem(t)
        except ValueError as e:
            return self.out(system, label, t, str(e))
        over = self.over_cap(problem)
        return self.out(system, label, t, over, problem.global_batch_tokens) if over else problem

    def searched(self, system: str, label: str, t: int) -> TPRow:
        """The planner's best plan at T, or the one line why there is none."""
        problem = self.admit(system, label, t)
        if isinstance(problem, TPRow):
            return problem
        try:
            res = self.search(t)
        except ValueError as e:
            return self.out(system, label, t, str(e), problem.global_batch_tokens)
        return self.row(system, label, t, res.problem, evaluate(res.problem, res.best.plan, with_step=True))

    def zero3(self, system: str, label: str, t: int) -> TPRow:
        """ZeRO-3 over T's data-parallel world (recomputation only if it does not fit without)."""
        problem = self.admit(system, label, t)
        if isinstance(problem, TPRow):
            return problem
        dp = problem.cluster
        plan = named_plan("zero3", gpus_per_node=dp.gpus_per_node, num_nodes=dp.num_nodes)
        cand = evaluate(problem, plan, with_step=True)
        if not cand.feasible:
            problem = self.problem(t, recompute=True)
            cand = evaluate(problem, plan, with_step=True)
        if not cand.feasible:
            return self.out(system, label, t, f"{plan} needs {cand.memory.total / GiB:.1f} GiB per GPU even "
                            f"with recomputation (usable {problem.memory_limit / GiB:.1f} GiB)",
                            problem.global_batch_tokens)
        return self.row(system, label, t, problem, cand)

    def joint(self, system: str, label: str, asked: int | None) -> TPRow:
        degrees = tp_degrees(self.spec, self.cluster.gpus_per_node) if asked is None else (asked,)
        try:
            res, _, choice = search_tensor_parallel(
                degrees, self.problem, lambda t: (self.search(t), None),
                max_global_batch_tokens=self.cap, auto=asked is None)
        except ValueError as e:
            return self.out(system, label, asked, str(e))
        cand = evaluate(res.problem, res.best.plan, with_step=True)
        return self.row(system, f"{label}: T = {choice.degree}", choice.degree, res.problem, cand)


def _spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec.preset(model)


def simulate_tp(settings, *, profile: BandwidthProfile | None = None) -> list[TPRow]:
    """[Note: the TP rows] for every model and GPU count of ``settings`` (a SimSettings; its
    ``models`` may be ModelSpecs). ``profile`` replaces ``settings.profile`` (tests)."""
    prof = profile or load_profile(settings.profile)
    rows: list[TPRow] = []
    for model in settings.models:
        spec = _spec(model)
        for gpus in settings.gpu_counts:
            scale = _Scale(spec, gpus, settings, prof)
            if settings.tensor_parallel is not None:  # what was asked for is bad input, not a row
                check_tensor_parallel(settings.tensor_parallel, spec, scale.cluster.gpus_per_node)
            labels = tp_row_labels(tp_degrees(spec, scale.cluster.gpus_per_node))
            for key, label in labels.items():
                if key == "joint":
                    rows.append(scale.joint(key, label, settings.tensor_parallel))
                elif key == "tp8-zero3":
                    rows.append(scale.zero3(key, label, TORCHTITAN_TP))
                else:
                    rows.append(scale.searched(key, label, int(key[2:])))
    return rows

