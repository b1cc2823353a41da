"""Worker of tests/test_compile.py: tiny-llama with each decoder block compiled by
``torch.compile`` (CPU inductor, fp32), sharded by ``shard`` under a plan, trained ``STEPS`` steps
of M micro-batches. Rank 0 writes the per-step losses and dynamo's graph-break and graph counters
to OUTDIR/<case>.pt; pytest compares the losses with a single-process eager run.

Usage: python -m tests.compile_worker OUTDIR STEPS PLAN:WHEN[:recompute][;...]
  WHEN: ``before`` (blocks compiled, then shard) or ``after`` (shard, then blocks compiled)
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.sync.units import decoder_layers
from tests.dist_utils import end_worker
from tests.engine_worker import release
from tests.parity_check import M, MBS, SEQ, adamw


def run_case(outdir, steps, plan, when, recompute):
    from torch._dynamo.utils import counters

    counters.clear()
    t0 = time.perf_counter()
    model = build_llama("tiny-llama", seed=0)
    compile_blocks = lambda: [layer.compile(backend="inductor") for layer in decoder_layers(model)]  # noqa: E731
    if when == "before":
        compile_blocks()
    model, opt = shard(model, plan, adamw, config=ShardConfig(recompute=recompute))
    if when == "after":
        compile_blocks()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        total = torch.zeros(1)
        for m in range(M):
            b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=MBS,
                            seq_len=SEQ)
            with contextlib.nullcontext() if m == M - 1 else model.no_sync():
                loss = causal_lm_loss(model, b) / M
                opt.backward(loss)
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        opt.step()
        opt.zero_grad()
    if rank == 0:
        breaks = dict(counters["graph_break"])
        name = f"{plan}.{when}{'.recompute' if recompute else ''}"
        torch.save({"losses": losses, "graph_breaks": breaks, "graph_break_count": sum(breaks.values()),
                    "graphs": int(counters["stats"]["unique_graphs"]), "seconds": time.perf_counter() - t0},
                   os.path.join(outdir, re.sub(r"[^A-Za-z0-9_.=-]", "_", name) + ".pt"))
    release(model)


def main():
    outdir, steps, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    for case in cases.split(";"):
        plan, when, *rest = case.split(":")
        run_case(outdir, steps, plan, when, recompute="recompute" in rest)
    end_worker(t0)


if __name__ == "__main__":
    main()
