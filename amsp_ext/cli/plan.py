"""``amsp plan``: choose the six sharding factors for a model on a cluster (torch-free).

    amsp plan --model llama-7b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB \\
              --profile paper-a800 --seq-len 4096 --micro-batch-size 1 \\
              --global-batch-tokens 4194304 [--recompute] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from dataclasses import dataclass

from amsp_ext import schema
from amsp_ext.choices import OBJECTIVES, OPTIMIZERS, PLANNER_OVERLAP_OF
from amsp_ext.cli.planner_flags import (ModelChoice, World, frozen_models_option, gpu_memory_option,
                                        max_global_batch_tokens_option,
                                        memory_reserve_option, missing_mesh_option, profile_option,
                                        tensor_parallel_option)
from amsp_ext.engine_config import EngineConfig, training_spec
from amsp_ext.planner.defaults import DEFAULT_OBJECTIVE, DEFAULT_OPTIMIZER, DEFAULT_PEAK_FLOPS
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.specs import StepShape
from amsp_ext.schema import check_options, option, section

HELP = "choose the sharding plan (p, g, os factors and meshes) for a model on a cluster"


# EngineConfig fields that training_spec reads: amsp plan's engine flags
PLANNED_ENGINE_FIELDS = ("nodes_per_leaf", "precision", "reduce_dtype", "grad_bucket_bytes",
                         "granularity", "recompute", "all_reduce")


@dataclass(frozen=True, kw_only=True)
class PlanCluster:
    gpu_memory: str | None = gpu_memory_option(required=True)
    memory_reserve: str = memory_reserve_option()
    peak_tflops: float | None = option(
        None, help="dense 16-bit peak per GPU, the MFU denominator (default: the profile's calibration "
                   f"peak when it has one, else {DEFAULT_PEAK_FLOPS / 1e12:g}, A100/A800)")
    profile: str = profile_option()
    missing_mesh: str = missing_mesh_option()

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and not 0 < self.peak_tflops < float("inf"):  # nan too
            raise ValueError(f"--peak-tflops must be a positive number, got {self.peak_tflops}")
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class PlanJob(StepShape):
    """The step's shape (StepShape: --seq-len, --micro-batch-size, --micro-batches) and what
    the planner prices besides it. A global batch, given, decides M for each world."""

    global_batch_tokens: int | None = option(None, one_of="batch", minimum=1,
                                             help="global batch in tokens (M follows from the world)")
    global_batch_size: int | None = option(None, one_of="batch", minimum=1,
                                           help="global batch in sequences (M follows from the world)")
    optimizer: str = option(DEFAULT_OPTIMIZER, choices=OPTIMIZERS)
    frozen_models: int = frozen_models_option()
    # not named tensor_parallel: that is the engine's T of a running job (EngineConfig, an int),
    # which `amsp plan` builds from the same flags; this is the planner's choice, 1..8 or auto
    tp_degree: str = tensor_parallel_option(
        flag="--tensor-parallel", what="TP degree inside the node (Megatron layout, no sequence parallel); "
                                       "AMSP plans the data-parallel world (R/T) x N; auto: searched with "
                                       "the six factors (docs/usage.md)")
    max_global_batch_tokens: int | None = max_global_batch_tokens_option(
        what="a TP degree whose batch exceeds it is out")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class PlanSearch:
    objective: str = option(DEFAULT_OBJECTIVE, choices=OBJECTIVES,
                            help="comm: the paper's Eq. 1; step: compute + unhidden communication")
    efficiency: float | None = option(None, help="fraction of peak the compute reaches (step model; "
                                                 "default 0.65)")
    tie_tolerance: float = option(0.01, help="relative objective difference treated as a tie")
    mics_size: int | None = option(None, minimum=1, help="MiCS shard group (default R)")
    hpz_size: int | None = option(None, minimum=1, help="ZeRO++ hpZ group (default R)")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class PlanOutput:
    pareto: bool = option(False, help="print the memory/time frontier")
    sensitivity: float | None = option(None, metavar="F",
                                       help="re-plan with intra- and cross-node bandwidths x (1 +- F)")
    top: int = option(10, minimum=1, help="candidates shown in the table")
    json: bool = option(False, help="print one JSON object")
    verify: int | None = option(None, minimum=1, metavar="K",
                                help="dry-run the top K fitting candidates (amsp dryrun, rank 0, 2 steps) "
                                     "and drop those whose engine peak exceeds the usable memory")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """``amsp plan``'s flags but the engine's (EngineConfig, only PLANNED_ENGINE_FIELDS) and
    ``--no-overlap`` (repeatable)."""

    model: ModelChoice = section(ModelChoice)
    world: World = section(World)
    cluster: PlanCluster = section(PlanCluster)
    job: PlanJob = section(PlanJob)
    search: PlanSearch = section(PlanSearch)
    output: PlanOutput = section(PlanOutput)


def add_planned_job(p: argparse.ArgumentParser, cluster: type, job: type) -> None:
    """The flags of a model, a cluster and a job planned for (amsp plan, amsp dryrun): the
    command's own ``cluster`` and ``job`` options beside the shared ones."""
    schema.add_arguments(p, ModelChoice)
    c = p.add_argument_group("cluster")
    schema.add_arguments(c, World)
    schema.add_arguments(c, cluster)
    t = p.add_argument_group("training")
    schema.add_arguments(t, job)
    # the engine settings the planner charges: the engine's own flags and defaults
    # (engine_config.py), so a plan is costed for the engine that will run it
    schema.add_arguments(t, EngineConfig, only=PLANNED_ENGINE_FIELDS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_planned_job(p, PlanCluster, PlanJob)
    s = p.add_argument_group("search")
    schema.add_arguments(s, PlanSearch)
    s.add_argument("--no-overlap", action="append", choices=tuple(PLANNER_OVERLAP_OF.values()), default=[],
                   help="step model without one of the paper's overlaps (Table V ablation)")
    schema.add_arguments(p.add_argument_group("output"), PlanOutput)


def _check_group_sizes(args: argparse.Namespace) -> None:
    """--mics-size and --hpz-size lay out as meshes of this world, named by their flags."""
    from amsp_ext.planner.plan import mesh_of_size

    R, N = args.gpus_per_node, args.nodes
    for flag, size in (("--mics-size", args.mics_size), ("--hpz-size", args.hpz_size)):
        if size is not None:  # hpZ's group is clamped to the world (planner/baselines.py)
            mesh_of_size(min(size, R * N) if flag == "--hpz-size" else size, R, N, flag)


def run(args: argparse.Namespace) -> int:
    from amsp_ext.common.models import model_spec
    from amsp_ext.planner.report import build_report, format_text
    from amsp_ext.planner.tensor_parallel import parse_tensor_parallel
    from amsp_ext.planner.specs import ClusterSpec, parse_size

    from amsp_ext.planner.profile import load_profile

    schema.from_namespace(PlanOptions, args)  # one-line error naming the flag
    _check_group_sizes(args)
    engine = schema.from_namespace(EngineConfig, args)
    spec = model_spec(args.model, args.model_config)
    spec.check_seq_len(args.seq_len)
    profile = load_profile(args.profile)
    if args.peak_tflops is not None:
        peak = args.peak_tflops * 1e12
    else:  # a calibrated profile's MFU peak is the device it was measured on
        peak = profile.calibration.peak_flops if profile.calibration else DEFAULT_PEAK_FLOPS
    cluster = ClusterSpec(
        num_nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
        peak_flops=peak, nodes_per_leaf=engine.nodes_per_leaf,
    )
    asked = parse_tensor_parallel(args.tp_degree)
    if args.verify and asked != 1:
        raise ValueError("--verify dry-runs the plan without tensor parallelism; "
                         f"use --tensor-parallel 1 with it, got {args.tp_degree}")
    result, choice, tp_choice = _search(args, engine, spec, cluster, profile, asked)
    problem, training = result.problem, result.problem.training
    report = build_report(result, with_pareto=args.pareto,
                          sensitivity_factor=args.sensitivity, mics_size=args.mics_size,
                          hpz_size=args.hpz_size)
    lines = [_profile_line(args.profile, profile, report)]
    if asked != 1 or args.max_global_batch_tokens is not None:
        report["tensor_parallel_choice"] = tp_choice.as_dict()
        lines.append(tp_choice.describe())
    if choice is not None:
        report["all_reduce"] = choice.as_dict()
        lines.append(f"{choice.describe()}: --all-reduce {choice.mode} runs this plan")
    if args.verify:
        usable = cluster.gpu_memory_bytes - problem.memory_reserve_bytes
        report["verify"] = _verify(result, args, engine, training, usable)
        kept = [v for v in report["verify"] if v["fits"]]
        lines = [f"verify: {v['plan']}: engine peak {v['engine_peak_bytes'] / 2**30:.2f} GiB "
                 f"(planner {v['planner_bytes'] / 2**30:.2f}) "
                 + ("fits" if v["fits"] else f"> usable {usable / 2**30:.2f} GiB: dropped")
                 for v in report["verify"]]
        if not kept:
            raise ValueError(f"--verify {args.verify}: none of the top {len(report['verify'])} candidates fits "
                             f"in {usable / 2**30:.2f} GiB by the engine's count (" +
                             "; ".join(ln.split(": ", 1)[1] for ln in lines) + ")")
        report["plan_text"] = kept[0]["plan"]
        lines.append(f"chosen after verification: {kept[0]['plan']}")
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join([format_text(report, top=args.top), *lines]))
    return 0


def _search(args: argparse.Namespace, engine: EngineConfig, spec, cluster, profile, asked: int | None):
    """The search under --all-reduce (auto: each mode, planner/auto.py) at each TP degree asked
    for (auto: every degree the node and the model allow, planner/joint.py [Note: choosing T]):
    (result, all-reduce choice or None, TP choice)."""
    from amsp_ext.choices import ALL_REDUCES
    from amsp_ext.planner.auto import search_all_reduce
    from amsp_ext.planner.joint import search_tensor_parallel
    from amsp_ext.planner.search import make_problem, search
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.planner.step import DEFAULT_EFFICIENCY, OverlapRules
    from amsp_ext.planner.tensor_parallel import tp_degrees

    off = set(args.no_overlap)

    def problem_for(all_reduce: str, tensor_parallel: int):
        training = dataclasses.replace(
            training_spec(engine, schema.from_namespace(StepShape, args), all_reduce=all_reduce,
                          optimizer=args.optimizer, frozen_models=args.frozen_models),
            global_batch_tokens=args.global_batch_tokens, global_batch_size=args.global_batch_size)
        return make_problem(
            spec, cluster, training, profile, objective=args.objective,
            missing=args.missing_mesh,
            efficiency=DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency,
            tie_tolerance=args.tie_tolerance,
            overlap=OverlapRules(ag_rs="ag_rs" not in off, ar="ar" not in off, bc="bc" not in off),
            memory_reserve_bytes=parse_size(args.memory_reserve, field="--memory-reserve",
                                            allow_zero=True),
            tensor_parallel=tensor_parallel,
        )

    def search_for(tensor_parallel: int):
        if is_auto(engine.all_reduce):  # planner/auto.py [Note: all_reduce "auto"]
            return search_all_reduce({m: problem_for(m, tensor_parallel) for m in ALL_REDUCES})
        return search(problem_for(engine.all_reduce, tensor_parallel)), None

    # planner/joint.py [Note: choosing T]
    degrees = tp_degrees(spec, args.gpus_per_node) if asked is None else (asked,)
    any_mode = "flat" if is_auto(engine.all_reduce) else engine.all_reduce
    return search_tensor_parallel(
        degrees, lambda t: problem_for(any_mode, t), search_for,
        max_global_batch_tokens=args.max_global_batch_tokens, auto=asked is None)


def _profile_line(name: str, profile, report: dict) -> str:
    """Off the cluster, which cluster the profile describes (it may be no cluster of yours);
    recorded in ``report["profile"]`` too."""
    from amsp_ext.topology.profile_cache import named_source

    source = named_source(name, profile.metadata)
    stored = profile.metadata.get("cluster_fingerprint")  # a profile plan "auto" measured and cached
    report["profile"] = {**source.as_dict(), "fingerprint": stored}
    describes = (f"measured on the cluster {stored}" if stored
                 else f"describes {source.describes or 'a cluster its metadata does not name'}")
    return f"profile: {source.source} {source.path}; {describes}"


def _verify(result, args, engine, training, usable: int) -> list[dict]:
    """[Note: plan --verify] The planner's memory model is an estimate; the dry run counts what
    the engine allocates (tools/dryrun.py). The top K candidates that fit by the
    model are dry-run (rank 0, two steps, all in one pool of two processes) at the usable
    memory (--gpu-memory less --memory-reserve), in rank order; the first that also fits by the
    engine's count becomes the plan. Rank 0 only: other ranks own other tensors."""
    from amsp_ext.tools.dryrun import DryRunSpec, dry_run_many

    world = args.nodes * args.gpus_per_node
    feasible = [c for c in result.ranked if c.feasible][:args.verify]
    specs = [DryRunSpec(model=args.model, model_config=args.model_config, num_nodes=args.nodes,
                        gpus_per_node=args.gpus_per_node, gpu_memory_bytes=usable, plan=str(c.plan),
                        seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                        num_micro_batches=training.micro_batches(world),
                        engine=dataclasses.replace(engine, gpus_per_node=None), steps=2,
                        ranks=(0,), profile=args.profile) for c in feasible]
    return [{"plan": str(c.plan), "planner_bytes": int(c.memory.total),
             "engine_peak_bytes": r["ranks"][0]["peak_bytes"], "fits": r["fits"]}
            for c, r in zip(feasible, dry_run_many(specs))]
