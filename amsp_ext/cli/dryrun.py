"""``amsp dryrun``: run the real engine for sampled ranks of a huge world on fake tensors
(``--tensors real --device cuda``: allocated on this machine's GPU, its allocator measured).

    amsp dryrun --model llama-7b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB \\
                --seq-len 4096 --micro-batches 1 --precision bf16 --plan zero3 [--tensor-parallel T]
                [--ranks 0,1023] [--json] [--out DIR]

See tools/dryrun.py [Note: dry run]. Each sampled rank runs in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from dataclasses import dataclass

from amsp_ext import schema
from amsp_ext.cli.plan import add_planned_job
from amsp_ext.cli.planner_flags import (ModelChoice, World, frozen_models_option, gpu_memory_option,
                                        missing_mesh_option, profile_option)
from amsp_ext.choices import DRYRUN_DEVICES, DRYRUN_OPTIMIZERS, DRYRUN_TENSORS
from amsp_ext.engine_config import EngineConfig
from amsp_ext.planner.specs import StepShape
from amsp_ext.schema import check_options, option, section

HELP = ("dry-run the engine for sampled ranks of a large world (fake backend; fake tensors, "
        "or real ones on a GPU)")


@dataclass(frozen=True, kw_only=True)
class DryRunCluster:
    gpu_memory: str = gpu_memory_option()
    profile: str = profile_option(what="bandwidth profile for --plan auto")
    missing_mesh: str = missing_mesh_option()

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class DryRunJob(StepShape):
    """The step's shape (StepShape: --seq-len, --micro-batch-size, --micro-batches) and the
    frozen models run beside the trained one."""

    frozen_models: int = frozen_models_option()

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class DryRunRun:
    plan: str = option("auto", help="auto, a name (zero3, mics:8, ...) or p=..,g=..,os=..")
    ranks: str | None = option(None, help="comma-separated ranks (default: 0, a middle node's, the last)")
    # None: DryRunSpec's default (defined once, there; importing it here would load torch)
    steps: int | None = option(None, minimum=1, help="steps to run; the last is measured")
    tensors: str | None = option(None, choices=DRYRUN_TENSORS,
                                 help="fake: no storage (any model on any machine); real: allocated, on "
                                      "--device (tools/dryrun.py [Note: real tensors on a GPU])")
    optimizer: str | None = option(None, choices=DRYRUN_OPTIMIZERS,
                                   help="adamw (default), muon or adafactor: the last two read whole "
                                        "tensors (their all-to-alls are counted)")
    device: str | None = option(None, choices=DRYRUN_DEVICES,
                                help="cuda: this machine's GPU (its streams, events and allocator; one "
                                     "rank at a time)")
    json: bool = option(False, help="print one JSON object")
    out: str | None = option(None, metavar="DIR", help="write report.md, dryrun.json, memory.png")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class DryRunOptions:
    """``amsp dryrun``'s flags but the engine's (EngineConfig, only PLANNED_ENGINE_FIELDS)."""

    model: ModelChoice = section(ModelChoice)
    world: World = section(World)
    cluster: DryRunCluster = section(DryRunCluster)
    job: DryRunJob = section(DryRunJob)
    run: DryRunRun = section(DryRunRun)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_planned_job(p, DryRunCluster, DryRunJob)  # the engine's flags as `amsp plan` has them
    run = p.add_argument_group("dry run")
    # the engine's T of the simulated job (EngineConfig's flag; `amsp plan`'s --tensor-parallel
    # is the planner's choice instead): the model is made tensor-parallel on meta and the plan is
    # of the data-parallel world; the report separates TP traffic from AMSP's
    schema.add_arguments(run, EngineConfig, only=("tensor_parallel",))
    schema.add_arguments(run, DryRunRun)


def _ranks(text: str | None):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file, not a folder")  # before the run, not after
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.tools.dryrun import DryRunSpec, dry_run
    from amsp_ext.tools.dryrun_report import format_text, write_out

    schema.from_namespace(DryRunOptions, args)  # one-line error naming the flag
    spec = DryRunSpec(model=args.model, model_config=args.model_config, num_nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node,
                      gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
                      plan=args.plan, **vars(schema.from_namespace(StepShape, args)),
                      frozen_models=args.frozen_models,
                      engine=dataclasses.replace(schema.from_namespace(EngineConfig, args), gpus_per_node=None),
                      ranks=_ranks(args.ranks), profile=args.profile, missing_mesh=args.missing_mesh,
                      **{k: getattr(args, k) for k in ("steps", "tensors", "device", "optimizer")
                         if getattr(args, k) is not None})
    result = dry_run(spec)
    if args.out:
        write_out(result, args.out)
    print(json.dumps(result) if args.json else format_text(result))
    return 0
