"""``amsp tune``: measure the candidate plans on the real cluster, check the planner against them,
and optionally calibrate its step model. Runs on every rank, like ``amsp profile``:

    amsp cluster run -- -m amsp_ext.cli tune --model small-llama --profile lab.json \\
        --seq-len 128 --micro-batch-size 4 --micro-batches 1 --granularity layer \\
        --repeats 2 --out comparisons/results/tune-A --calibrate-out lab.calibrated.json
    torchrun --nproc-per-node 8 -m amsp_ext.cli tune --model-config config.json ...

The job-shape flags are ``amsp train``'s (one schema, amsp_ext/train/config.py); the rest are
TuneOptions (amsp_ext/tune/spec.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from amsp_ext import schema
from amsp_ext.tune.spec import TuneConfig

HELP = "measure the candidate plans on this cluster; planner vs measured, calibration"


def add_arguments(p: argparse.ArgumentParser) -> None:
    schema.add_arguments(p, TuneConfig)


def run(args: argparse.Namespace) -> int:
    from amsp_ext.planner.defaults import CLUSTER_PROFILE
    from amsp_ext.planner.profile import load_profile

    config = schema.from_namespace(TuneConfig, args)  # one-line error before any rank talks
    config.hf_config()  # an unreadable --model-config too
    if config.planner.profile != CLUSTER_PROFILE:  # "cluster": found or measured on the ranks
        load_profile(config.planner.profile)  # and a bad profile
    _check_outputs(config)
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR") if k not in os.environ]
    if missing:
        raise ValueError(
            "amsp tune runs on every rank; start it with torchrun or the lab, e.g. `amsp cluster "
            f"run -- -m amsp_ext.cli tune ...` (missing {', '.join(missing)})")
    _check_plans_fit_the_world(config, world=int(os.environ["WORLD_SIZE"]),
                               local_world=int(os.environ["LOCAL_WORLD_SIZE"]))
    from amsp_ext.cli.precision import warn_if_slow_bf16
    from amsp_ext.tune.run import run_tune

    if os.environ["RANK"] == "0":  # the engine's precision is decided (default fp32): bf16 only warns
        warn_if_slow_bf16(config.engine.precision)

    command = "amsp " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return run_tune(config, command=command)


def _check_outputs(config: TuneConfig) -> None:
    """--out is a folder (or can be made one) and --calibrate-out's folder exists."""
    out = Path(config.tune.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder for tune.json, tune.md and the plot")
    if config.tune.calibrate_out is not None:
        parent = Path(config.tune.calibrate_out).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--calibrate-out {config.tune.calibrate_out}: folder {parent} does not exist")
    if config.tune.plans is not None and not config.tune.plan_list:
        raise ValueError(f"--plans {config.tune.plans!r} names no plan; give plans separated by ';', "
                         f"e.g. 'ddp;zero3;p=2x1,g=2x1,os=2x2'")


def _check_plans_fit_the_world(config: TuneConfig, *, world: int, local_world: int) -> None:
    """Every --plans entry is a plan of this world (names and factors), before any collective."""
    from amsp_ext.planner.plan import PlanError, resolve_plan, validate_plan

    R = config.engine.gpus_per_node or local_world
    if world % R:
        raise ValueError(f"--gpus-per-node={R} must divide the world size {world}")
    for text in config.tune.plan_list:
        try:
            validate_plan(resolve_plan(text, gpus_per_node=R, num_nodes=world // R, field="--plans"),
                          gpus_per_node=R, num_nodes=world // R, structural_only=True)
        except PlanError as e:  # a mics:K names itself ("--plans mics:3: ..."); the rest do not
            msg = str(e)
            raise ValueError(msg if msg.startswith("--plans") else f"--plans: {text!r}: {msg}") from None
