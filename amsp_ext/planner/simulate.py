"""``amsp simulate``: the paper's Figure 11 predicted by the planner's cost and step models.

For each model and GPU count of the paper's scalability study (LLaMA-7B/13B/30B on 8 .. 1024
A800-80GB GPUs, 8 per node; seq 4096, micro-batch 1, a 4M-token global batch, so M = 128 at 8
GPUs down to 1 at 1024; recomputation for 30B only; bf16, AdamW) this module costs every system
with the same memory model, the same profile lookups (``paper-a800`` by default) and the same
step-time model (step.py), and reports MFU, tokens/GPU/s, step time and memory, or OOM.

Systems: DDP, ZeRO-1/2/3, ZeRO++ (hpZ = one node), MiCS (shard group = one node), AMSP with
MiCS's configuration, AMSP with the planner's plan re-run at every scale (Eq. 1 objective, the
planner's default, and the step-time objective), and AMSP with the paper's uniform Table IV plan.

[Note: engine assumptions]
The step model (step.py) times a plan on an engine that follows the paper's overlap rules
(Sec. V). The paper's baselines run on DeepSpeed's engine, which the paper's own traces (Fig. 14)
and DeepSpeed's code show behaves differently. Rather than fit constants, each baseline is
reported under three labelled engine assumptions:

* ``ideal`` (the step model as is): every system on the paper's overlap rules; what AMSP's engine
  is modelled as, and what DeepSpeed would reach if it overlapped as well.
* ``deepspeed`` (baselines only; AMSP and DDP rows are the same as ``ideal``):
  (a) ZeRO-3, ZeRO++ and MiCS: each unit's reduce-scatter is blocking, right after its backward
      (``OverlapRules(rs=False)``); all-gather prefetch and the all-reduce stream stay on. The
      paper's Fig. 14: "DeepSpeed-ZeRO3/MiCS/ZeRO++ fails to effectively overlap ReduceScatter
      with computation".
  (b) ZeRO-1 and ZeRO-2: updated parameters are redistributed by one blocking all-gather of
      e*Phi bytes over the data-parallel group after the optimizer step (DeepSpeed 0.18.9
      ``all_gather_dp_groups`` -> ``all_gather_into_tensor`` on NCCL), in place of T1_os's
      sos/sp per-owner broadcasts overlapped with the next forward (the paper's formula).
  Gradient reduction is unchanged: DeepSpeed's stage 1/2 all-reduce their buckets over the dp
  group (``use_multi_rank_bucket_allreduce``), which is T0_os/Tg.
* ``serial``: every collective blocking, for every system (``OverlapRules`` all off): the
  model's lower bound with the same collectives. A reported MFU below it cannot be explained by
  overlap at all, only by collectives slower than the profile or costs the model has no term for.

Nothing here is fitted to the paper's results. The compute efficiency (0.65 of peak) is the
planner's default (step.py); the profile is the bundled one, built from the paper's Fig. 3.

Pure Python + NumPy (the planner layer); the plot and files are written by the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

from amsp_ext.planner.baselines import baselines
from amsp_ext.planner.cost import CommCost
from amsp_ext.planner.memory import param_bytes
from amsp_ext.planner.plan import Plan, named_plan, parse_plan, validate_plan
from amsp_ext.planner.profile import BandwidthProfile, load_profile
from amsp_ext.planner.search import (
    GiB, NoFeasiblePlan, Problem, evaluate, make_problem, search,
)
from amsp_ext.planner.specs import ClusterSpec, StepShape, TrainingSpec, paper_job
from amsp_ext.planner.step import DEFAULT_EFFICIENCY, OverlapRules, StepEstimate, step_estimate
from amsp_ext.planner.defaults import DEFAULT_GPU_MEMORY_BYTES, DEFAULT_MISSING_MESH, DEFAULT_PROFILE

__all__ = [
    "ENGINES",
    "PAPER_GPU_COUNTS",
    "PAPER_MODELS",
    "PAPER_MFU",
    "SYSTEMS",
    "TABLE_IV",
    "SimCell",
    "SimSettings",
    "paper_training",
    "table_iv_plan",
    "side_by_side",
    "simulate",
]

PAPER_GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
PAPER_MODELS = ("llama-7b", "llama-13b", "llama-30b")
RECOMPUTE = {"llama-7b": False, "llama-13b": False, "llama-30b": True}  # paper Sec. VI
TABLE_IV = {  # the paper's uniform plans, used at every GPU count
    "llama-7b": "p=1x1,g=1x1,os=8x1",
    "llama-13b": "p=4x1,g=4x1,os=8x1",
    "llama-30b": "p=8x1,g=8x1,os=8x4",
}

# key -> label; the order of the table rows and of the plot's legend.
SYSTEMS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "zero++": "ZeRO++ (hpZ 8)",
    "mics": "MiCS (8)",
    "amsp-mics": "AMSP (MiCS config)",
    "amsp-planner": "AMSP (planner, Eq. 1)",
    "amsp-planner-step": "AMSP (planner, step objective)",
    "amsp-table-iv": "AMSP (Table IV plan)",
}
DEEPSPEED_SYSTEMS = ("zero1", "zero2", "zero3", "zero++", "mics")
ENGINES = ("ideal", "deepspeed", "serial")

# The paper's reported MFU (%), read from the text of Sec. VI / Fig. 11 and Fig. 16 as the
# review (section 5) gives them; "~" values are read off the figures. None = reported OOM.
PAPER_MFU: dict[tuple[str, str, int], tuple[float | None, str]] = {
    ("amsp-table-iv", "llama-7b", 1024): (51, "Fig. 11a"),
    ("amsp-table-iv", "llama-13b", 1024): (52, "Fig. 11b"),
    ("amsp-table-iv", "llama-30b", 1024): (42, "Fig. 11c"),
    ("mics", "llama-7b", 1024): (35, "Fig. 11a"),
    ("mics", "llama-13b", 1024): (33, "Fig. 11b"),
    ("mics", "llama-30b", 1024): (29, "Fig. 11c"),
    ("zero1", "llama-7b", 1024): (36, "Fig. 11a"),
    ("zero3", "llama-7b", 1024): (4, "~, Fig. 11a"),
    ("zero3", "llama-13b", 1024): (6, "~, Fig. 11b"),
    ("zero3", "llama-30b", 1024): (3, "~, Fig. 11c"),
    ("zero++", "llama-7b", 1024): (4, "~, Fig. 11a"),
    ("zero++", "llama-13b", 1024): (6, "~, Fig. 11b"),
    ("zero++", "llama-30b", 1024): (5, "~, Fig. 11c"),
    ("zero++", "llama-30b", 32): (None, "OOM, Fig. 11c"),
    ("amsp-mics", "llama-7b", 1024): (42, "~, Fig. 16a"),
    ("amsp-mics", "llama-13b", 1024): (36, "~, Fig. 16b"),
    ("amsp-mics", "llama-30b", 1024): (33, "~, Fig. 16c"),
    ("amsp-table-iv", "llama-7b", 8): (64, "~, Fig. 11a"),
    ("zero1", "llama-7b", 8): (63, "~, Fig. 11a"),
    ("mics", "llama-7b", 8): (50, "~, Fig. 11a"),
    ("zero3", "llama-7b", 8): (47, "~, Fig. 11a"),
    ("amsp-table-iv", "llama-7b", 32): (60, "~, Fig. 11a"),
    ("zero1", "llama-7b", 32): (57, "~, Fig. 11a"),
    ("mics", "llama-7b", 32): (52, "~, Fig. 11a"),
}


# the paper's sequences (Sec. VI): 4096 tokens, one per micro-batch; its global batch (4M tokens)
# decides M, so the shape's own M is not read
PAPER_SHAPE = StepShape(seq_len=4096, micro_batch_size=1)


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """The paper's experimental settings (Sec. VI); every field can be changed from the CLI."""

    models: tuple[str, ...] = PAPER_MODELS
    gpu_counts: tuple[int, ...] = PAPER_GPU_COUNTS
    gpus_per_node: int = 8
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_BYTES
    shape: StepShape = PAPER_SHAPE  # seq_len and micro_batch_size (M follows from the global batch)
    global_batch_tokens: int = 4 * 2**20
    precision: str = "bf16"
    profile: str = DEFAULT_PROFILE
    efficiency: float = DEFAULT_EFFICIENCY
    mics_size: int | None = None  # one node
    hpz_size: int | None = None  # one node
    missing_mesh: str = DEFAULT_MISSING_MESH
    # tensor parallelism (simulate_tp.py): any of these set makes the run the TP comparison
    tensor_parallel: int | None = 1  # the joint pick's degrees: T, or None for auto
    max_global_batch_tokens: int | None = None
    micro_batches: int | None = None  # M per data-parallel rank (replaces global_batch_tokens)

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON values, the step's shape flat (seq_len, micro_batch_size)."""
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items() if k != "shape"}
        return {**d, "seq_len": self.shape.seq_len, "micro_batch_size": self.shape.micro_batch_size}

    @property
    def tp_mode(self) -> bool:
        """The TP rows (simulate_tp.py) rather than the paper's Fig. 11 grid."""
        return (self.tensor_parallel != 1 or self.max_global_batch_tokens is not None
                or self.micro_batches is not None)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model")
        for g in self.gpu_counts:
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or (
                    g > self.gpus_per_node and g % self.gpus_per_node):
                raise ValueError(f"gpu_counts must be positive and, above one node, multiples of "
                                 f"gpus_per_node={self.gpus_per_node}; got {g!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")


@dataclass(frozen=True, kw_only=True)
class SimCell:
    """One system on one model at one GPU count under one engine assumption."""

    model: str
    gpus: int
    system: str
    engine: str
    plan: str
    num_micro_batches: int
    feasible: bool
    memory_gib: float | None
    mfu: float | None  # None when it does not fit
    tokens_per_gpu_per_s: float | None
    step_s: float | None
    compute_s: float | None
    exposed_comm_s: float | None
    comm_s: float | None  # every collective's time added up (overlapped or not)
    comm_terms: dict | None = None  # t_p, t_g, t0_os, t1_os (and t_allgather, DeepSpeed ZeRO-1/2)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def paper_training(model: str, settings: SimSettings = SimSettings()) -> TrainingSpec:
    return paper_job(seq_len=settings.shape.seq_len, micro_batch_size=settings.shape.micro_batch_size,
                     global_batch_tokens=settings.global_batch_tokens,
                     recompute=RECOMPUTE.get(model, False), precision=settings.precision)


def _cluster(gpus: int, settings: SimSettings) -> ClusterSpec:
    R = min(settings.gpus_per_node, gpus)
    return ClusterSpec(num_nodes=gpus // R, gpus_per_node=R,
                       gpu_memory_bytes=settings.gpu_memory_bytes)


_RULES = {
    "ideal": OverlapRules(),
    "deepspeed": OverlapRules(rs=False),
    "serial": OverlapRules(ag_rs=False, ar=False, bc=False),
}


def _with_blocking(est: StepEstimate, extra_s: float) -> StepEstimate:
    """``est`` followed by ``extra_s`` of blocking communication."""
    step = est.step_s + extra_s
    return replace(est, step_s=step, exposed_comm_s=est.exposed_comm_s + extra_s,
                   mfu=est.mfu * est.step_s / step,
                   tokens_per_gpu_per_s=est.tokens_per_gpu_per_s * est.step_s / step)


def _cell(problem: Problem, *, model: str, gpus: int, system: str, engine: str, plan: Plan,
          feasible: bool, memory: int, est: StepEstimate | None, comm: dict[str, float],
          note: str = "") -> SimCell:
    ok = feasible and est is not None
    return SimCell(
        model=model, gpus=gpus, system=system, engine=engine, plan=str(plan),
        num_micro_batches=problem.num_micro_batches, feasible=feasible,
        memory_gib=memory / GiB, mfu=est.mfu if ok else None,
        tokens_per_gpu_per_s=est.tokens_per_gpu_per_s if ok else None,
        step_s=est.step_s if ok else None, compute_s=est.compute_s if ok else None,
        exposed_comm_s=est.exposed_comm_s if ok else None, comm_s=sum(comm.values()),
        comm_terms=comm, note=note)


def _terms(comm: CommCost) -> dict[str, float]:
    return {k: v for k, v in comm.as_dict().items() if k != "total"}


def _zero12_allgather(problem: Problem, plan: Plan) -> tuple[StepEstimate, dict[str, float]]:
    """ZeRO-1/2 as DeepSpeed runs them (engine ``deepspeed`` (b)): no per-owner broadcasts, one
    blocking all-gather of the updated parameters over the dp group. Returns (estimate, terms)."""
    cand = evaluate(problem, plan, with_step=False)
    comm = replace(cand.comm, t1_os=0.0)
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    nbytes = param_bytes(problem.training.precision) * problem.spec.num_params
    t_ag = problem.timer.time("allgather", nbytes, R, N)
    est = step_estimate(plan, problem.spec, problem.training, problem.cluster, problem.timer, comm,
                        num_micro_batches=problem.num_micro_batches,
                        efficiency=problem.efficiency, overlap=problem.overlap,
                        calibration=problem.calibration, tensor_parallel=problem.tp_comm)
    return _with_blocking(est, t_ag), {**_terms(comm), "t_allgather": t_ag}


def _amsp_plan_cell(problem: Problem, plan: Plan, *, note: str = "", **kw: Any) -> SimCell:
    c = evaluate(problem, plan, with_step=True)
    return _cell(problem, plan=plan, feasible=c.feasible, memory=c.memory.total, est=c.step,
                 comm=_terms(c.comm), note=note, **kw)


def _planned_cell(planning: Problem, timing: Problem, *, objective: str, **kw: Any) -> SimCell:
    """The planner's best plan on ``planning`` (AMSP's engine), timed on ``timing``."""
    try:
        best = search(replace(planning, objective=objective, _cache={})).best
    except NoFeasiblePlan as e:
        return SimCell(plan="-", num_micro_batches=planning.num_micro_batches, feasible=False,
                       memory_gib=None, mfu=None, tokens_per_gpu_per_s=None, step_s=None,
                       compute_s=None, exposed_comm_s=None, comm_s=None,
                       note=f"planner: {e}", **kw)
    return _amsp_plan_cell(timing, best.plan, **kw)


def table_iv_plan(model: str, gpus_per_node: int, num_nodes: int) -> tuple[Plan, str]:
    """The paper's Table IV plan for ``model`` on N x R GPUs, and a note when it had to be capped.

    Table IV is "uniform from 8 to 1024 GPUs", but 30B's os=8x4 needs 4 nodes; below that the
    optimizer states can span at most the N nodes there are, so s1 is capped at N (and s0 at R).
    """
    plan = parse_plan(TABLE_IV[model])
    capped = Plan(**{k: min(v, gpus_per_node if k.startswith("s0") else num_nodes)
                     for k, v in plan.as_dict().items()})
    note = "" if capped == plan else f"Table IV's {plan} capped to {capped} on {num_nodes} node(s)"
    return capped, note


def _scale(model: str, gpus: int, engine: str, settings: SimSettings,
           profile: BandwidthProfile) -> list[SimCell]:
    cluster = _cluster(gpus, settings)
    problem = make_problem(model, cluster, paper_training(model, settings), profile,
                           objective="comm", efficiency=settings.efficiency,
                           overlap=_RULES[engine], missing=settings.missing_mesh)
    R, N = cluster.gpus_per_node, cluster.num_nodes
    where = dict(model=model, gpus=gpus, engine=engine)
    cells: dict[str, SimCell] = {}

    # The DeepSpeed systems, costed on this engine assumption (ideal: the paper's overlap rules).
    for b in baselines(problem, mics_size=settings.mics_size, hpz_size=settings.hpz_size):
        c, note = b.candidate, b.note
        est, comm = c.step, _terms(c.comm)
        if engine == "deepspeed" and b.key in ("zero1", "zero2"):
            est, comm = _zero12_allgather(problem, b.plan)
            note = "updated parameters: one blocking all-gather over dp (DeepSpeed)"
        cells[b.key] = _cell(problem, system=b.key, plan=b.plan, feasible=c.feasible,
                             memory=c.memory.total, est=est, comm=comm, note=note, **where)

    # AMSP's own engine: the paper's overlap rules unless every collective is serialised. (DDP and
    # ZeRO-1/2 have sp = 1, so rule (a) of the deepspeed assumption never touches them.) The
    # planner always plans for AMSP's engine; the plan it picks is then timed on this assumption.
    ideal = replace(problem, overlap=_RULES["ideal"], _cache={})
    amsp = problem if engine == "serial" else ideal
    mics_plan = named_plan(f"mics:{settings.mics_size or R}", gpus_per_node=R, num_nodes=N)
    cells["amsp-mics"] = _amsp_plan_cell(amsp, mics_plan, system="amsp-mics", **where)
    for key, objective in (("amsp-planner", "comm"), ("amsp-planner-step", "step")):
        cells[key] = _planned_cell(ideal, amsp, objective=objective, system=key, **where)
    if model in TABLE_IV:
        plan, note = table_iv_plan(model, R, N)
        validate_plan(plan, gpus_per_node=R, num_nodes=N)
        cells["amsp-table-iv"] = _amsp_plan_cell(amsp, plan, system="amsp-table-iv", note=note,
                                                 **where)
    return [cells[k] for k in SYSTEMS if k in cells]


def simulate(settings: SimSettings = SimSettings(),
             engines: Iterable[str] = ENGINES) -> list[SimCell]:
    """Every (model, GPU count, engine, system) cell, in that nesting order."""
    engines = tuple(engines)
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {e!r}")
    profile = load_profile(settings.profile)
    out: list[SimCell] = []
    for model in settings.models:
        for gpus in settings.gpu_counts:
            for engine in engines:
                out.extend(_scale(model, gpus, engine, settings, profile))
    return out


# -- side by side with the paper ---------------------------------------------------------------

AGREE_POINTS = 3.0  # |paper - model| within this many MFU points reads as agreement


def implied_step_s(mfu: float, cell: SimCell) -> float:
    """The step time a reported MFU implies for the same job: the model's useful FLOPs are
    ``cell.mfu * cell.step_s * peak``, so step = cell.mfu * cell.step_s / mfu."""
    assert cell.mfu is not None and cell.step_s is not None
    return cell.mfu * cell.step_s / mfu


def _verdict(paper: float | None, ideal: SimCell, ds: SimCell | None, serial: SimCell) -> str:
    if paper is None:
        return "agrees (OOM)" if not ideal.feasible else f"model fits ({ideal.memory_gib:.0f} GiB)"
    if ideal.mfu is None:
        return "model OOM"
    models = {"ideal": ideal.mfu * 100}
    if ds is not None and ds.mfu is not None and ds.system in DEEPSPEED_SYSTEMS:
        models["deepspeed"] = ds.mfu * 100
    close = [k for k, v in models.items() if abs(v - paper) <= AGREE_POINTS]
    if close:
        return "agrees (" + ", ".join(close) + ")"
    low = serial.mfu * 100 if serial.mfu is not None else 0.0
    if serial.mfu is not None and abs(low - paper) <= AGREE_POINTS:
        return "agrees (serial)"
    if paper > max(models.values()):
        return "paper above model"
    if paper < low - AGREE_POINTS:
        return "paper below serial bound"
    return "between serial and overlapped"


def side_by_side(cells: Iterable[SimCell]) -> list[dict[str, Any]]:
    """One row per number the paper reports, with the model's figures under each assumption."""
    by = {(c.model, c.gpus, c.system, c.engine): c for c in cells}
    rows = []
    for (system, model, gpus), (paper, source) in PAPER_MFU.items():
        ideal = by.get((model, gpus, system, "ideal"))
        if ideal is None:
            continue
        ds = by.get((model, gpus, system, "deepspeed"))
        serial = by.get((model, gpus, system, "serial"))
        pct = lambda c: None if c is None or c.mfu is None else round(c.mfu * 100, 1)  # noqa: E731
        row = {
            "model": model, "gpus": gpus, "system": system, "label": SYSTEMS[system],
            "paper_mfu_pct": paper, "source": source, "plan": ideal.plan,
            "ideal_mfu_pct": pct(ideal),
            "deepspeed_mfu_pct": pct(ds) if system in DEEPSPEED_SYSTEMS else None,
            "serial_mfu_pct": pct(serial), "memory_gib": ideal.memory_gib,
            "compute_s": ideal.compute_s, "comm_s": ideal.comm_s, "model_step_s": ideal.step_s,
            "comm_terms": ideal.comm_terms,
            "deepspeed_comm_terms": ds.comm_terms if ds and system in DEEPSPEED_SYSTEMS else None,
            "implied_step_s": (implied_step_s(paper / 100, ideal)
                               if paper and ideal.mfu is not None else None),
            "verdict": _verdict(paper, ideal, ds, serial) if serial is not None else "",
        }
        rows.append(row)
    order = {m: i for i, m in enumerate(PAPER_MODELS)}
    sys_order = {s: i for i, s in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (-r["gpus"], order.get(r["model"], 99), sys_order[r["system"]]))
    return rows
