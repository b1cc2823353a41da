"""``amsp train``: the main job. Launches its own ranks (torchrun underneath) and runs
:mod:`amsp_ext.train` on each; gloo on CPU, NCCL on GPU. Under an existing launcher (torchrun or
``amsp cluster run``, i.e. when ``LOCAL_RANK`` is set) it runs the worker in this process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from amsp_ext.models import MODEL_CONFIGS  # torch-free

DEFAULT_PLAN = "p=1x1,g=1x1,os=2x1"
HELP = "train a Llama with AMSP on real text (default: tiny-llama, 4 ranks as 2 nodes x 2)"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--plan", default=DEFAULT_PLAN,
                   help="'auto' (the planner), ddp, zero1, zero2, zero3, mics:K, or factors "
                        f"'p=S0xS1,g=S0xS1,os=S0xS1' (default {DEFAULT_PLAN}: the paper's "
                        "LLaMA-7B shape, optimizer states sharded inside a node)")
    p.add_argument("--profile", default="paper-a800",
                   help="bandwidth profile for --plan auto: a bundled name or an amsp-profile JSON "
                        "(e.g. one written by `amsp profile`)")
    p.add_argument("--gpu-memory", default=None,
                   help="memory per rank for --plan auto, with a unit (e.g. 4MiB); default: the device's")
    p.add_argument("--memory-reserve", default=None,
                   help="memory the planner keeps free per rank for --plan auto (e.g. 0B); "
                        "default: the planner's")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per (virtual) node; default: the launcher's local world size")
    p.add_argument("--nodes-per-leaf", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=2, help="M micro-batches per step")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 = off)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size U in MiB")
    p.add_argument("--granularity", default="module", choices=("module", "layer"))
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--no-overlap", default="", metavar="OPS",
                   help="comma list of overlaps to turn off: allgather,allreduce,broadcast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective times out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a log")


def check_args(args: argparse.Namespace) -> None:
    for field in ("steps", "micro_batches", "micro_batch_size", "seq_len"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    bad = set(filter(None, args.no_overlap.split(","))) - {"allgather", "allreduce", "broadcast"}
    if bad:
        raise ValueError(f"--no-overlap takes allgather, allreduce, broadcast; got {','.join(sorted(bad))}")
    max_pos = MODEL_CONFIGS[args.model]["max_position_embeddings"]
    if args.seq_len > max_pos:
        raise ValueError(f"--seq-len must be <= {max_pos} for {args.model}, got {args.seq_len}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=4,
                   help="ranks to launch on this machine (default 4)")
    add_train_arguments(p)
    p.set_defaults(gpus_per_node=None)


def _worker_argv(args: argparse.Namespace, gpus_per_node: int) -> list[str]:
    argv = ["--model", args.model, "--plan", args.plan, "--gpus-per-node", str(gpus_per_node),
            "--steps", str(args.steps), "--micro-batches", str(args.micro_batches),
            "--micro-batch-size", str(args.micro_batch_size), "--seq-len", str(args.seq_len),
            "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--clip", str(args.clip),
            "--precision", args.precision, "--bucket-mb", str(args.bucket_mb),
            "--granularity", args.granularity, "--seed", str(args.seed),
            "--timeout", str(args.timeout), "--profile", args.profile]
    if args.gpu_memory:
        argv += ["--gpu-memory", args.gpu_memory]
    if args.memory_reserve:
        argv += ["--memory-reserve", args.memory_reserve]
    if args.nodes_per_leaf:
        argv += ["--nodes-per-leaf", str(args.nodes_per_leaf)]
    if args.recompute:
        argv.append("--recompute")
    if args.no_overlap:
        argv += ["--no-overlap", args.no_overlap]
    if args.json:
        argv.append("--json")
    return argv


def _check_plan_fits(plan: str, *, gpus_per_node: int, num_nodes: int) -> None:
    """Refuse a plan that cannot run on this world before any rank starts (one line)."""
    from amsp_ext.planner.plan import resolve_plan, validate_plan

    if plan.strip().lower() == "auto":
        return
    validate_plan(resolve_plan(plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes),
                  gpus_per_node=gpus_per_node, num_nodes=num_nodes, structural_only=True)


def run(args: argparse.Namespace) -> int:
    if "LOCAL_RANK" in os.environ:  # already one rank of a launched job
        from amsp_ext.train import main as worker_main

        gpus = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return worker_main(_worker_argv(args, gpus))
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    gpus = args.gpus_per_node or min(args.nproc_per_node, 2)
    if args.nproc_per_node % gpus:
        raise ValueError(
            f"--gpus-per-node={gpus} must divide --nproc-per-node={args.nproc_per_node}"
        )
    check_args(args)
    _check_plan_fits(args.plan, gpus_per_node=gpus, num_nodes=args.nproc_per_node // gpus)
    return launch(["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m", "amsp_ext.train",
                   *_worker_argv(args, gpus)], as_json=args.json)


def launch(torchrun_args: list[str], *, as_json: bool) -> int:
    """Run the ranks under torchrun (see amsp_ext/cli/supervise.py: no orphans, one line on
    failure); with ``as_json``, print rank 0's summary."""
    from amsp_ext.cli.supervise import Job

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    with Job("amsp-train-") as job:
        result_file = job.dir / "result.json"
        rc = job.run([*torchrun_args, "--result-file", str(result_file)], env=env,
                     stdout=subprocess.DEVNULL if as_json else None)
        if rc != 0:
            print(f"amsp train: error: {job.error_line(rc)}", file=sys.stderr)
            return rc
        if as_json:
            print(json.dumps(json.loads(result_file.read_text())))
    return 0
