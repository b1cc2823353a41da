"""The main job: train a Llama with AMSP on real text, top to bottom. One process per rank.

``amsp train`` launches this under torchrun; ``amsp cluster run -- python -m amsp_ext.train ...``
runs it across the virtual nodes. Rank 0 prints progress, and writes the JSON summary to
``--result-file`` when given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import amsp_ext
from amsp_ext import metrics
from amsp_ext.data import micro_batch
from amsp_ext.models import build_llama, causal_lm_loss, llama_config_dict
from amsp_ext.planner.memory import memory_breakdown
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.specs import TrainingSpec, parse_size
from amsp_ext.runtime import collectives
from amsp_ext.runtime.profiler import pick_device
from amsp_ext.cli.supervise import die_with_parent, report_error
from amsp_ext.cli.train import add_train_arguments, check_args
from amsp_ext.runtime.config import PRECISIONS, AutoPlanConfig, OverlapConfig, ShardConfig


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% over the run."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(args: argparse.Namespace) -> dict | None:
    check_args(args)
    # -- 1. processes ----------------------------------------------------------------------
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = pick_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
    log = print if (rank == 0 and not args.json) else (lambda *a, **k: None)

    # -- 2. model and plan -------------------------------------------------------------------
    model = build_llama(args.model, seed=args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    overlap_off = set(filter(None, args.no_overlap.split(",")))
    config = ShardConfig(
        gpus_per_node=args.gpus_per_node, nodes_per_leaf=args.nodes_per_leaf,
        precision=args.precision, grad_bucket_bytes=int(args.bucket_mb * 2**20),
        granularity=args.granularity, recompute=args.recompute, timeout=args.timeout,
        overlap=OverlapConfig(**{op: op not in overlap_off for op in ("allgather", "allreduce", "broadcast")}),
        auto=AutoPlanConfig(
            seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
            num_micro_batches=args.micro_batches, profile=args.profile, missing="fit",
            gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory") if args.gpu_memory else None,
            memory_reserve_bytes=(parse_size(args.memory_reserve, field="--memory-reserve", allow_zero=True)
                                  if args.memory_reserve else None)),
    )
    model, optimizer = amsp_ext.shard(
        model, args.plan,
        lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        config=config,
    )
    plan = model.amsp.plan
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, args))
    log(f"amsp train: {args.model} ({num_params / 1e6:.2f}M params) on {world_size} ranks "
        f"({model.amsp.world.num_nodes} node(s) x {model.amsp.world.gpus_per_node}), plan {plan}")

    # -- 3. the peak for MFU, measured with every rank busy ---------------------------------
    dtype = PRECISIONS[args.precision]
    collectives.barrier(dist.group.WORLD, name="world", timeout=args.timeout)
    peak_flops = metrics.matmul_peak_flops(device, dtype)
    flops_per_token = metrics.flops_per_token(llama_config_dict(args.model), args.seq_len)

    # -- 4. the loop -----------------------------------------------------------------------
    M = args.micro_batches
    tokens_per_rank_step = M * args.micro_batch_size * args.seq_len
    losses, step_times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for micro in range(M):
            batch = micro_batch(step, micro, rank, world_size=world_size, num_micro_batches=M,
                                micro_batch_size=args.micro_batch_size, seq_len=args.seq_len).to(device)
            with model.no_sync() if micro < M - 1 else contextlib.nullcontext():
                loss = causal_lm_loss(model, batch) / M
                optimizer.backward(loss)
            step_loss += loss.detach().float()
        grad_norm = optimizer.clip_grad_norm_(args.clip) if args.clip > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        # the logged loss is the global-batch mean: average over the data-parallel world
        collectives.all_reduce(step_loss, dist.group.WORLD, name="world", async_op=False,
                               timeout=args.timeout)
        losses.append(step_loss.item() / world_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        log(f"step {step:3d}  loss {losses[-1]:.4f}  "
            f"grad-norm {float(grad_norm) if grad_norm is not None else float('nan'):.3f}  "
            f"{tokens_per_rank_step / step_times[-1]:8.0f} tok/rank/s")

    # -- 5. summary ------------------------------------------------------------------------
    model.amsp.wait_params()  # the last step's broadcasts, before measuring memory
    tokens_per_gpu_per_s = tokens_per_rank_step / metrics.median_after_warmup(step_times)
    mine = {"peak_memory_bytes": metrics.peak_memory_bytes(device),
            "model_state_bytes": model.model_state_bytes()}
    per_rank = [json.loads(b) for b in collectives.all_gather_bytes(
        json.dumps(mine).encode(), dist.group.WORLD, name="world", width=1024, timeout=args.timeout)]
    result = None
    if rank == 0:
        predicted = memory_breakdown(
            ModelSpec.from_hf_config(llama_config_dict(args.model)), plan, TrainingSpec(seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                                     num_micro_batches=M, precision=args.precision,
                                     bucket_bytes=config.grad_bucket_bytes,
                                     granularity=args.granularity, recompute=args.recompute),
            gpus_per_node=model.amsp.world.gpus_per_node, num_nodes=model.amsp.world.num_nodes)
        result = {
            "model": args.model, "num_params": num_params, "plan": plan.as_dict(),
            "plan_str": str(plan), "world": {"num_nodes": model.amsp.world.num_nodes,
                                             "gpus_per_node": model.amsp.world.gpus_per_node},
            "steps": args.steps, "micro_batches": M, "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len, "precision": args.precision, "loss": losses,
            "step_time_s": step_times, "tokens_per_gpu_per_s": tokens_per_gpu_per_s,
            "mfu": metrics.mfu(flops_per_token=flops_per_token,
                               tokens_per_gpu_per_s=tokens_per_gpu_per_s, peak_flops=peak_flops),
            "peak_flops_per_gpu": peak_flops,
            "peak_flops_source": f"measured: {args.precision} 1024x1024 matmul on {device.type}, all ranks at once",
            "peak_memory_bytes": [r["peak_memory_bytes"] for r in per_rank],
            "peak_memory_source": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS of each rank (ru_maxrss)",
            "model_state_bytes": {"measured": [r["model_state_bytes"] for r in per_rank],
                                  "predicted": {"params": predicted.params, "grads": predicted.grads,
                                                "optim": predicted.optim,
                                                "total": predicted.model_states}},
        }
        log(f"done: {tokens_per_gpu_per_s:.0f} tokens/GPU/s, MFU {result['mfu']:.1%} "
            f"(peak {peak_flops / 1e9:.1f} GFLOP/s per rank, measured)")
    collectives.barrier(dist.group.WORLD, name="world", timeout=args.timeout)
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amsp_ext.train", description=__doc__)
    add_train_arguments(parser)
    parser.add_argument("--result-file", default=None, help="rank 0 writes the JSON summary here")
    args = parser.parse_args(argv)
    die_with_parent()  # never outlive the launcher's agent (amsp_ext/cli/supervise.py)
    try:
        result = train(args)
    except (ValueError, collectives.CollectiveTimeout) as e:  # known: one line, no traceback
        if report_error(e):
            return 1
        raise
    except Exception as e:
        report_error(e)
        raise
    if result is not None:
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result, f)
        elif args.json:
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
