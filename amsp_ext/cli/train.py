"""``amsp train``: the main job. Launches its own ranks (torchrun underneath) and runs
:mod:`amsp_ext.train` on each; gloo on CPU, NCCL on GPU. Under an existing launcher (torchrun or
``amsp cluster run``, i.e. when ``LOCAL_RANK`` is set) it runs the worker in this process.

The flags are generated from TrainConfig (amsp_ext/train_config.py); every rank receives the
validated config as one JSON file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from amsp_ext import schema
from amsp_ext.train_config import TrainConfig

HELP = "train a Llama with AMSP on real text (default: tiny-llama, 4 ranks as 2 nodes x 2)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=4,
                   help="ranks to launch on this machine (default 4)")
    schema.add_arguments(p, TrainConfig)


def _check_plan_fits(plan: str, *, gpus_per_node: int, num_nodes: int) -> None:
    """Refuse a plan that cannot run on this world before any rank starts (one line)."""
    from amsp_ext.planner.plan import resolve_plan, validate_plan

    if plan.strip().lower() == "auto":
        return
    validate_plan(resolve_plan(plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes),
                  gpus_per_node=gpus_per_node, num_nodes=num_nodes, structural_only=True)


def run(args: argparse.Namespace) -> int:
    config = schema.from_namespace(TrainConfig, args)  # one-line ValueError on a bad flag
    if "LOCAL_RANK" in os.environ:  # already one rank of a launched job
        from amsp_ext.train import run_worker

        return run_worker(config)
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    gpus = config.cluster.gpus_per_node or min(args.nproc_per_node, 2)
    if args.nproc_per_node % gpus:
        raise ValueError(
            f"--gpus-per-node={gpus} must divide --nproc-per-node={args.nproc_per_node}"
        )
    _check_plan_fits(config.plan, gpus_per_node=gpus, num_nodes=args.nproc_per_node // gpus)
    config = dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, gpus_per_node=gpus))
    with tempfile.TemporaryDirectory(prefix="amsp-train-") as tmp:
        config_file = os.path.join(tmp, "config.json")
        result_file = os.path.join(tmp, "result.json")
        with open(config_file, "w") as f:
            f.write(schema.to_json(config))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", "-m", "amsp_ext.train",
               "--config", config_file, "--result-file", result_file]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if config.output.json else None)
        if proc.returncode != 0:
            print(f"amsp train: error: ranks exited with status {proc.returncode}", file=sys.stderr)
            return proc.returncode
        if config.output.json:
            with open(result_file) as f:
                print(json.dumps(json.load(f)))
    return 0
