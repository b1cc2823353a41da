"""``amsp train``: the main job. Launches its own ranks (torchrun underneath) and runs
:mod:`amsp_ext.train.loop` on each; gloo on CPU, NCCL on GPU. Under an existing launcher (torchrun or
``amsp cluster run``, i.e. when ``LOCAL_RANK`` is set) it runs the worker in this process.

The flags are generated from TrainConfig (amsp_ext/train/config.py); every rank receives the
validated config as one JSON file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from amsp_ext import schema
from amsp_ext.train.config import TrainConfig

HELP = "train a Llama with AMSP on real text (default: tiny-llama, 4 ranks as 2 nodes x 2)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=4,
                   help="ranks to launch on this machine (default 4)")
    schema.add_arguments(p, TrainConfig)


def _plan_before_launch(config: TrainConfig, *, gpus_per_node: int, num_nodes: int) -> str:
    """The plan the ranks will run, checked against this world before any rank starts: a plan
    that cannot run, and every ``--plan auto`` error (a bad profile, nothing fits), is one line
    from here. ``auto`` is planned here (the ranks get the factors) unless the device memory
    has to be read from a GPU."""
    from amsp_ext.planner.plan import resolve_plan, validate_plan

    if config.plan.strip().lower() != "auto":
        validate_plan(resolve_plan(config.plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes),
                      gpus_per_node=gpus_per_node, num_nodes=num_nodes, structural_only=True)
        return config.plan
    from amsp_ext.train.models import llama_config_dict
    from amsp_ext.planner.auto import plan_auto
    from amsp_ext.train.config import auto_plan_config

    memory = config.planner.gpu_memory_bytes
    if memory is None:
        import torch

        if torch.cuda.is_available():
            return config.plan  # the ranks read their device's memory
        import psutil

        memory = psutil.virtual_memory().total // gpus_per_node  # what a CPU rank assumes
    e = config.engine
    plan = plan_auto(llama_config_dict(config.model), auto_plan_config(config), num_nodes=num_nodes,
                     gpus_per_node=gpus_per_node, gpu_memory_bytes=memory,
                     nodes_per_leaf=config.cluster.nodes_per_leaf, precision=e.precision,
                     grad_bucket_bytes=int(e.bucket_mb * 2**20), granularity=e.granularity,
                     recompute=e.recompute)
    return str(plan)


def _check_resume(config: TrainConfig) -> None:
    """A checkpoint to resume from is checked (every file against its checksum) here, once."""
    ck = config.checkpoint
    if not ck.resume:
        return
    from amsp_ext.train.state import resolve_resume, verify

    path = resolve_resume(ck.resume, ck.save_dir)
    if path is not None:
        verify(path)


def run(args: argparse.Namespace) -> int:
    config = schema.from_namespace(TrainConfig, args)  # one-line ValueError on a bad flag
    if "LOCAL_RANK" in os.environ:  # already one rank of a launched job
        from amsp_ext.train.loop import run_worker

        return run_worker(config)
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    gpus = config.cluster.gpus_per_node or min(args.nproc_per_node, 2)
    if args.nproc_per_node % gpus:
        raise ValueError(
            f"--gpus-per-node={gpus} must divide --nproc-per-node={args.nproc_per_node}"
        )
    from amsp_ext.cli.precision import cpu_precision

    cpu_precision(config.engine.precision, config.engine.precision)  # the default is fp32: warns only
    plan = _plan_before_launch(config, gpus_per_node=gpus, num_nodes=args.nproc_per_node // gpus)
    _check_resume(config)
    config = dataclasses.replace(
        config, plan=plan, cluster=dataclasses.replace(config.cluster, gpus_per_node=gpus))
    return launch(config, nproc_per_node=args.nproc_per_node)


def launch(config: TrainConfig, *, nproc_per_node: int) -> int:
    """Run the ranks under torchrun (amsp_ext/train/supervise.py: no orphans, one line on
    failure), each reading ``config`` from one JSON file; under ``--json``, print rank 0's
    summary."""
    from amsp_ext.train.supervise import Job

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           # a fresh TCP store per attempt: with torchrun's shared one, the ranks of an elastic
           # restart can read the dead ranks' gloo addresses (same keys) and fail to connect
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Job("amsp-train-") as job:
        config_file, result_file = job.dir / "config.json", job.dir / "result.json"
        config_file.write_text(schema.to_json(config))
        rc = job.run(["--standalone", f"--nproc-per-node={nproc_per_node}",
                      f"--max-restarts={config.checkpoint.max_restarts}", "-m", "amsp_ext.train",
                      "--config", str(config_file), "--result-file", str(result_file)],
                     env=env, stdout=subprocess.DEVNULL if config.output.json else None)
        if rc != 0:
            print(f"amsp train: error: {job.error_line(rc)}", file=sys.stderr)
            return rc
        if config.output.json:
            print(json.dumps(json.loads(result_file.read_text())))
    return 0
