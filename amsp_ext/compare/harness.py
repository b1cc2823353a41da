"""``amsp compare``: run each system of a mode with the same RunSpec, then write the report.

Modes:
- ``baselines``: every system (DDP, ZeRO-1/2/3, ZeRO++ with and without quantisation, MiCS,
  FSDP2, HSDP) and both AMSP rows - the paper's Figures 11-13 as far as one machine allows.
- ``dissociation``: DeepSpeed-MiCS, AMSP with MiCS's configuration, AMSP with the planner's plan
  - the paper's Figure 16 (engine vs sharding strategy).
- ``ablation``: AMSP with the planner's plan under each overlap setting of the paper's Table V
  (all on / no BC / no BC+AR / none).

``repeats`` > 1 runs every row of a mode that many times, in rounds of alternating order, and
reports medians and per-round ratios (see ``amsp_ext.compare.rounds``).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from amsp_ext.compare.config import COMPARE_MISSING_MESH, OVERLAP_LABELS, OVERLAPS, RunSpec, SpecError
from amsp_ext.compare.launch import LaunchConfig, find_cluster_profile, run_compute_only, run_system
from amsp_ext.compare.rounds import combine_rounds, overloaded_rounds, round_order, validate_repeats
from amsp_ext.compare.summary import peak_flops, summarize
from amsp_ext.compare.systems import SYSTEMS, default_systems
from amsp_ext.common.metrics import mfu
from amsp_ext.job import Job, resolve
from amsp_ext.planner.auto import AutoPlanConfig
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.specs import format_size
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_GPU_MEMORY_BYTES, DEFAULT_RESERVE_BYTES

__all__ = ["MODES", "PlannerInputs", "RunItem", "plan_runs", "resolve_world", "run_comparison"]

MODES = ("baselines", "dissociation", "ablation")
NOISE_NOTE = ("Measured on a shared 2-core CPU machine while other jobs ran: timings are noisy "
              "and say little about GPUs; the numbers show the harness works and how the systems "
              "compare here, not the paper's speed-ups.")


@dataclass(frozen=True, kw_only=True)
class RunItem:
    key: str  # row key, unique in a comparison
    system: str
    label: str
    spec: RunSpec


def plan_runs(mode: str, spec: RunSpec, systems: list[str] | None = None,
              ablation_micro_batches: list[int] | None = None) -> list[RunItem]:
    """The rows of a mode. Ablation: one row per (M, overlap setting), M from
    ``ablation_micro_batches`` (the paper's Table V uses 1, 2, 4, 8) or the spec's M, then the
    ``systems`` asked for beside them (none by default): a peer timed in the same rounds shows
    which overlap setting's step matches it."""
    if mode not in MODES:
        raise SpecError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "ablation":
        return _system_rows(systems or default_systems(mode), spec)
    peers = _system_rows(systems or [], spec)
    ms = ablation_micro_batches or [spec.num_micro_batches]
    if any(m < 1 for m in ms):
        raise SpecError(f"ablation micro-batch counts must be >= 1, got {ms}")
    return [RunItem(key=f"amsp-plan[M={m},{o}]", system="amsp-plan",
                    label=f"{_amsp_plan_label(spec)}, M={m}, overlap {OVERLAP_LABELS[o]}",
                    spec=spec.replace(amsp_overlap=o, num_micro_batches=m))
            for m in ms for o in OVERLAPS] + peers


def _system_rows(names: list[str], spec: RunSpec) -> list[RunItem]:
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise SpecError(f"systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    return [RunItem(key=n, system=n, label=_amsp_plan_label(spec) if n == "amsp-plan" else SYSTEMS[n].label,
                    spec=spec) for n in names]


def _amsp_plan_label(spec: RunSpec) -> str:
    if is_auto(spec.amsp_plan):
        return SYSTEMS["amsp-plan"].label
    return f"AMSP (plan {spec.amsp_plan})"


@dataclass(frozen=True, kw_only=True)
class PlannerInputs:
    """What ``amsp-plan`` with ``amsp_plan="auto"`` hands the planner (as ``amsp plan`` takes it)."""

    # "cluster": the launcher's cluster's (find_cluster_profile), a bundled name or a JSON path
    profile: str = CLUSTER_PROFILE
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_BYTES
    memory_reserve_bytes: int = DEFAULT_RESERVE_BYTES
    missing: str = COMPARE_MISSING_MESH

    def describe(self) -> str:
        return (f"profile {self.profile}, {format_size(self.gpu_memory_bytes)} per GPU less "
                f"{format_size(self.memory_reserve_bytes)} reserve, missing meshes: {self.missing}")


def _resolve_planned(spec: RunSpec, plan_text: str, *, num_nodes: int, gpus_per_node: int,
                     planner: PlannerInputs) -> tuple[RunSpec | None, str | None, str]:
    """``(spec, why not, where the plan came from)``: an AMSP row's spec with ``plan_text``
    "auto" made the planner's factors and ``amsp_all_reduce`` "auto" made the mode the planner
    prices lower for the row's plan (planner/auto.py [Note: all_reduce "auto"]), so every rank
    gets the same decided settings."""
    job = amsp_job(spec, plan_text, num_nodes=num_nodes, gpus_per_node=gpus_per_node, planner=planner)
    try:
        planned = resolve(job)  # reads no profile unless it has to price (amsp_ext/job.py)
    except ValueError as e:
        return None, f"planner: {e}", ""
    resolved = spec.replace(amsp_all_reduce=planned.all_reduce.mode)
    if job.plan_is_auto:
        resolved = resolved.replace(amsp_plan=str(planned.plan))
        source = f"planner ({planner.describe()}): {planned.plan}"
    else:
        source = f"given: {plan_text}"
    if is_auto(spec.amsp_all_reduce):
        source += f"; {planned.all_reduce.describe()}"
    return resolved, None, source


def amsp_job(spec: RunSpec, plan_text: str, *, num_nodes: int, gpus_per_node: int,
             planner: PlannerInputs) -> Job:
    """An AMSP row as a Job (amsp_ext/job.py): the engine configuration the row runs with
    (compare/systems/amsp.py), the comparison's step shape and the planner inputs."""
    from amsp_ext.compare.systems.amsp import engine_config
    from amsp_ext.common.models import llama_config_dict

    auto = AutoPlanConfig(seq_len=spec.seq_len, micro_batch_size=spec.micro_batch_size,
                          num_micro_batches=spec.num_micro_batches, profile=planner.profile,
                          missing=planner.missing, memory_reserve_bytes=planner.memory_reserve_bytes,
                          gpu_memory_bytes=planner.gpu_memory_bytes)
    engine = dataclasses.replace(engine_config(spec, gpus_per_node), auto=auto)
    return Job(model=llama_config_dict(spec.model), num_nodes=num_nodes, engine=engine, plan=plan_text)


def resolve_world(spec: RunSpec, launch: LaunchConfig) -> tuple[int, int]:
    """``(num_nodes, gpus_per_node)`` of the comparison, refused before any launch if it cannot
    tile. torchrun: the ranks of this machine; cluster: the lab's shape from its state file."""
    from amsp_ext.compare.config import resolve_topology

    if launch.launcher == "torchrun":
        world = local = launch.nproc_per_node
    else:
        from amsp_ext.cluster import netns

        state = netns.load_state(launch.cluster_name)
        if state is None or state.get("status") != "up":
            raise SpecError(f"cluster lab {launch.cluster_name!r} is not up; run `amsp cluster up "
                            f"--name {launch.cluster_name} --nodes 2 --gpus-per-node 2 ...` first")
        local = int(state["spec"]["gpus_per_node"])
        world = int(state["spec"]["num_nodes"]) * local
    return resolve_topology(spec, world_size=world, local_world_size=local)


def _hardware(launch: LaunchConfig, nodes: int, gpn: int) -> str:
    return f"cpu-{nodes}x{gpn}" + ("-lab" if launch.launcher == "cluster" else "")


def _precision_note(precision: str, reduce_dtype: str = "fp32") -> str:
    if precision == "bf16":
        return ("bf16 for every system, in each system's own mixed-precision form (DDP: autocast "
                "over fp32 params; FSDP2: MixedPrecisionPolicy param_dtype bf16; DeepSpeed: "
                "`bf16.enabled`; AMSP: bf16 parameters, fp32 masters; per row below), gradients "
                f"reduced in **{reduce_dtype}** by every system (`--reduce-dtype`; DDP: bf16 "
                "compression hook, FSDP2: reduce_dtype, DeepSpeed: communication_data_type, AMSP: "
                "reduce_dtype; what each sent is measured below): the paper trains in mixed "
                "precision and it is what these systems' users run. fp32 runs too "
                "(`--precision fp32`) - DeepSpeed 0.18.9 ZeRO-1/2 fail on gloo in *both* "
                "precisions with LlamaForCausalLM unless patches/deepspeed_zero12_flat_buffer.py "
                "is applied, and run in both with it.")
    return ("fp32 for every system: numerics are comparable to a single-process reference; "
            "DeepSpeed 0.18.9 ZeRO-1/2 need patches/deepspeed_zero12_flat_buffer.py on gloo.")


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    """One row before any round: its spec with the plan resolved, or why it cannot run."""

    index: int  # 1-based position in plan_runs' order (progress lines)
    item: RunItem
    spec: RunSpec
    base: dict[str, Any]  # fields every round's record of this row shares
    why: str | None


def _prepare(index: int, item: RunItem, spec: RunSpec, *, nodes: int, gpn: int,
             planner: PlannerInputs) -> _Prepared:
    base = {"key": item.key, "system": item.system, "label": item.label,
            "spec": dataclasses.asdict(item.spec)}
    item_spec = item.spec
    why = None
    if item.system in ("amsp-plan", "amsp-mics"):
        from amsp_ext.compare.systems.amsp import mics_plan

        plan_text = item_spec.amsp_plan if item.system == "amsp-plan" else mics_plan(item_spec, gpn)
        resolved, why, source = _resolve_planned(item_spec, plan_text, num_nodes=nodes,
                                                 gpus_per_node=gpn, planner=planner)
        item_spec = resolved or item_spec
        if item.system == "amsp-plan" or is_auto(spec.amsp_all_reduce):
            base["plan_source"] = source
        if resolved is not None and item.system == "amsp-plan" and is_auto(spec.amsp_plan):
            base["label"] = item.label.replace("planner's plan", f"planner's plan {resolved.amsp_plan}")
    return _Prepared(index=index, item=item, spec=item_spec, base=base, why=why)


def _planner_profile(planner: PlannerInputs, items: list[RunItem], spec: RunSpec, launch: LaunchConfig,
                     gpn: int, out_dir: Path, progress: Callable[[str], None]) -> PlannerInputs:
    """``planner`` with the profile "cluster" made the path of the launcher's cluster's profile
    (found in the cache or measured by its ranks, launch.find_cluster_profile), when a row plans."""
    plans = any(i.system in ("amsp-plan", "amsp-mics") for i in items) and (
        is_auto(spec.amsp_plan) or is_auto(spec.amsp_all_reduce))
    if planner.profile != CLUSTER_PROFILE or not plans:
        return planner
    found = find_cluster_profile(launch, gpus_per_node=gpn, out=out_dir / "cluster-profile")
    progress(f"amsp compare: profile {found['source']} {found['path']} (cluster {found['fingerprint_key']})")
    return dataclasses.replace(planner, profile=found["path"])


def run_comparison(*, mode: str, spec: RunSpec, launch: LaunchConfig, out_dir: Path,
                   command: str, systems: list[str] | None = None,
                   ablation_micro_batches: list[int] | None = None,
                   planner: PlannerInputs | None = None, repeats: int = 1,
                   progress: Callable[[str], None] = print,
                   show_bar: bool = False) -> tuple[Path, list[dict[str, Any]]]:
    """Run every row ``repeats`` times, in rounds whose order alternates (amsp_ext.compare.rounds),
    and write the report - after every system, and at the end with plots. Rows come back in
    plan_runs' order. ``show_bar``: a tqdm bar with ETA (lines go through ``tqdm.write``)."""
    repeats = validate_repeats(repeats)
    items = plan_runs(mode, spec, systems, ablation_micro_batches)
    nodes, gpn = resolve_world(spec, launch)
    planner = _planner_profile(planner or PlannerInputs(), items, spec, launch, gpn, out_dir, progress)
    c = _Comparison(mode=mode, spec=spec, launch=launch, out_dir=out_dir, command=command,
                    planner=planner, repeats=repeats,
                    hardware=_hardware(launch, nodes, gpn), num_items=len(items))
    c.prepared = [_prepare(i, item, spec, nodes=nodes, gpn=gpn, planner=c.planner)
                  for i, item in enumerate(items, 1)]
    runnable = c.refuse_unrunnable(progress)
    c.total = len(runnable) * repeats + len(c.prepared) - len(runnable)
    bar = _bar(total=len(runnable) * repeats, enabled=show_bar)
    say = bar.write if bar is not None else progress
    try:
        for r in range(repeats):
            c.run_round(r, runnable, bar=bar, say=say)
    except BaseException as e:  # SIGINT/SIGTERM (the CLI turns SIGTERM into KeyboardInterrupt)
        if c.raw_by_key:
            path = c.report(final=False, stopped=type(e).__name__)
            say(f"stopped: the {c.num_reported()} finished run(s) are in {path}")
        raise
    finally:
        if bar is not None:
            bar.close()
    path = c.report(final=True)
    return path, c.rows


@dataclass(kw_only=True)
class _Comparison:
    """One ``run_comparison``: its settings, the runs reported so far, and their report."""

    mode: str
    spec: RunSpec
    launch: LaunchConfig
    out_dir: Path
    command: str
    planner: PlannerInputs
    repeats: int
    hardware: str
    num_items: int
    date: str = dataclasses.field(default_factory=lambda: datetime.date.today().isoformat())
    load_start: Any = dataclasses.field(default_factory=lambda: _load())
    prepared: list = dataclasses.field(default_factory=list)
    raw_by_key: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    orders: list[list[str]] = dataclasses.field(default_factory=list)
    round_loads: list[list[float] | None] = dataclasses.field(default_factory=list)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    total: int = 0  # runs the report will have when complete

    @property
    def stem(self) -> str:
        return (f"{self.spec.model}_{self.hardware}_{self.date}"
                + ("" if self.mode == "baselines" else f"_{self.mode}")
                + ("" if self.repeats == 1 else f"_repeats{self.repeats}"))

    def num_reported(self) -> int:
        return sum(len(v) for v in self.raw_by_key.values())

    def refuse_unrunnable(self, progress: Callable[[str], None]) -> list:
        """Rows that cannot run are reported failed, with why, at once; the others."""
        for p in self.prepared:
            if p.why:
                self.raw_by_key[p.item.key] = [{**p.base, "status": "failed", "reason": p.why}]
                progress(f"[{p.index}/{self.num_items}] {p.item.label}: failed: {p.why}")
        return [p for p in self.prepared if not p.why]

    def report(self, *, final: bool, stopped: str | None = None) -> Path:
        """[Note: a report after every system]
        Written (JSON + markdown, no plots) each time a system finishes, so a later failure,
        a timeout or a stopped harness loses nothing; the final write adds the plots."""
        from amsp_ext.compare.report import write_report

        done = [p for p in self.prepared if p.item.key in self.raw_by_key]
        raw = [res for p in done for res in self.raw_by_key[p.item.key]]
        peak = peak_flops(raw)
        rows = [_row(self.raw_by_key[p.item.key], peak, self.repeats) for p in done]
        meta = _meta(raw, self.spec, self.launch, mode=self.mode, command=self.command,
                     date=self.date, peak=peak, hardware=self.hardware)
        meta["planner"] = self.planner.describe()
        meta["load"] = {"start": self.load_start, "end": _load()}
        meta["repeats"] = self.repeats
        meta["round_orders"] = self.orders
        if not final or stopped:
            meta["incomplete"] = (f"stopped ({stopped})" if stopped else "in progress") + \
                f": {self.num_reported()} of {self.total} runs reported"
        meta["round_loads"] = self.round_loads
        meta.update(overloaded_rounds(self.round_loads))
        if self.repeats > 1:
            meta["order_scheme"] = ORDER_SCHEME
        self.rows = rows
        return write_report(rows=rows, meta=meta, out_dir=self.out_dir, stem=self.stem, plots=final)

    def run_round(self, r: int, runnable: list, *, bar, say: Callable[[str], None]) -> None:
        """Round ``r``: every runnable row once, in the round's order, reported after each."""
        order = round_order(runnable, r)
        self.orders.append([p.item.key for p in order])
        self.round_loads.append(_load())
        runs_dir = self.out_dir / self.stem / "runs"
        folder = runs_dir if self.repeats == 1 else runs_dir / f"round{r + 1}"
        for position, p in enumerate(order, 1):
            head = (f"[{p.index}/{self.num_items}]" if self.repeats == 1
                    else f"[round {r + 1}/{self.repeats}, {position}/{len(order)}]")
            if bar is not None:
                bar.set_description(f"{head} {p.item.key}", refresh=True)
            # The profiled step runs in every round: it comes after the timed steps, so it does
            # not change them, and one round's trace is one sample of a noisy machine (its
            # breakdown can disagree with its own timed steps), so the report gives the
            # communication figures as medians over rounds (rounds.combine_rounds).
            run_spec = p.spec
            started_at = time.time()
            row_dir = folder / p.item.key.replace("[", "_").replace("]", "")
            res = run_system(p.item.system, run_spec, row_dir, self.launch, row_key=p.item.key)
            if res.get("status") == "ok" and r < run_spec.limit_rounds:
                # compare/limit.py [Note: a row's limit]: right after the row, at its size
                res["compute_only"] = run_compute_only(
                    p.item.system, run_spec, row_dir.with_name(row_dir.name + "-compute"), self.launch,
                    world_size=res["world_size"], gpus_per_node=res["gpus_per_node"])
            res.update(p.base)
            res.update(round=r + 1, position=position, started_at=started_at)
            if r > 0:
                res["spec"] = dataclasses.asdict(run_spec)
            self.raw_by_key.setdefault(p.item.key, []).append(res)
            self.report(final=False)  # on disk before anyone hears of it
            say(f"{head} {p.item.label}: {res['status']}"
                + (f" - {res['reason']}" if res.get("reason") else "")
                + f" ({res.get('wall_s', 0):.0f} s)")
            if bar is not None:
                bar.update(1)


def _bar(*, total: int, enabled: bool):
    """A tqdm bar over every (round, system) run, with ETA; None when disabled."""
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="run", dynamic_ncols=True,
                bar_format="{desc} | {n_fmt}/{total_fmt} runs |{bar}| {elapsed}<{remaining}")


ORDER_SCHEME = ("round r (1-based) runs the systems in the base order rotated left by "
                "(r-1)//2 positions, reversed when r is even: each pair of rounds is one order "
                "and its reverse; over 2 x (number of systems) rounds every system takes every "
                "position twice")


def _row(records: list[dict[str, Any]], peak: float | None, repeats: int) -> dict[str, Any]:
    """One report row. N = 1: exactly the single run's summary; N > 1: its rounds combined."""
    if repeats == 1 or "round" not in records[0]:
        return summarize(records[0], RunSpec(**records[0]["spec"]), peak)
    rounds = []
    for res in records:
        row = summarize(res, RunSpec(**res["spec"]), peak)
        row.update(round=res["round"], position=res["position"], started_at=res["started_at"])
        rounds.append(row)

    def mfu_of(row: dict[str, Any], tgs: float) -> float | None:
        return mfu(flops_per_token=row["flops_per_token"], tokens_per_gpu_per_s=tgs,
                   peak_flops=peak) if peak else None

    return combine_rounds(rounds, mfu_of=mfu_of)


def _load() -> list[float] | None:
    """1/5/15-minute load averages: on a shared machine they say how noisy the timings are."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine() -> str:
    import os

    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPU cores, no GPU"


def _meta(raw, spec: RunSpec, launch: LaunchConfig, *, mode, command, date, peak, hardware) -> dict:
    from amsp_ext.common.metrics import flops_per_token
    from amsp_ext.common.models import llama_config_dict
    from amsp_ext.planner.model_spec import ModelSpec

    ok = [r for r in raw if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    world = first.get("world_size") or launch.nproc_per_node
    nodes, gpn = first.get("num_nodes"), first.get("gpus_per_node")
    if launch.launcher == "torchrun":
        topology = (f"1 machine, `torchrun --standalone`, {world} ranks"
                    + (f" posing as {nodes} nodes x {gpn} (logical nodes: no slower link between them)"
                       if nodes and nodes > 1 else ""))
    else:
        topology = f"`amsp cluster run` (lab `{launch.cluster_name}`): {nodes} nodes x {gpn} ranks"
    link = first.get("cluster_link") or "none (one machine, loopback)"
    ds = next((r for r in ok if r.get("patches")), None)
    patches = ds["patches"] if ds else {}
    versions = first.get("versions") or {"python": platform.python_version()}
    num_params = ModelSpec.from_hf_config(llama_config_dict(spec.model)).num_params
    return {
        "mode": mode, "command": command, "date": date, "hardware": hardware,
        "cpu": _machine(),
        "noise_note": NOISE_NOTE, "spec": dataclasses.asdict(spec),
        "launch": dataclasses.asdict(launch), "topology": topology, "cluster_link": link,
        "versions": versions, "patches": patches,
        "peak_flops": peak, "compute_dtype": spec.precision,
        "precision_note": _precision_note(spec.precision, spec.reduce_dtype),
        "num_params": num_params,
        "flops_per_token": flops_per_token(llama_config_dict(spec.model), spec.seq_len),
        "global_batch_sequences": spec.micro_batch_size * spec.num_micro_batches * world,
        "global_batch_tokens": spec.tokens_per_rank_per_step * world,
    }
