"""Worker of tests/test_tensor_parallel.py: tiny-llama made tensor-parallel (T = 2, the standard
Llama layout) on a ``(dp, tp)`` mesh, sharded by ``shard`` under each plan of the data-parallel
world, trained ``STEPS`` steps with clipping. Rank 0 writes, per plan, the per-step losses and clip
norms and the full weights after the last step (``consolidated_state_dict``) to
OUTDIR/<plan>.pt; pytest compares them with a single-process run (tests/parity_check.reference).

Usage: python -m tests.tp_worker T OUTDIR STEPS CLIP PLAN[;PLAN...]  (PLAN ``guards``: the bad-input cases;
PLAN+compile: each decoder block compiled after TP, before shard; PLAN+recompute:
activation checkpointing; PLAN+nan: rank 1's loss NaN at step 0; PLAN+meta: built on meta, made TP there,
shard() allocates and fills each rank's block from seed 0 (PLAN+init: from the safetensors folder
$TP_WORKER_INIT_FROM); their <plan>.pt holds the gathered weights right after shard() too; PLAN+t1+meta: the
same without TP, over all ranks, the reference of the TP ones)
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
from amsp_ext.runtime.state.export import consolidated_state_dict
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.sync.units import decoder_layers
from amsp_ext.runtime.tensor_parallel import parallelize_llama, tensor_parallel_mesh
from tests.dist_utils import end_worker
from tests.engine_worker import release
from tests.parity_check import M, MBS, SEQ, adamw


GPUS_PER_NODE = int(os.environ.get("TP_WORKER_GPUS_PER_NODE", "0"))  # 0: one node


def run_plan(plan, tp_mesh, T, steps, clip, outdir, compiled=False, recompute=False, nan=False, meta=False,
             init=False):
    from torch._dynamo.utils import counters

    counters.clear()
    meta = meta or init
    model = build_llama("tiny-llama", seed=0, on_meta=meta)
    if T > 1:
        parallelize_llama(model, tp_mesh)
    if compiled:  # torchtitan's order: TP, then compile each block, then the data-parallel wrapper
        for layer in decoder_layers(model):
            layer.compile(backend="inductor")
    init_from = os.environ["TP_WORKER_INIT_FROM"] if init else None
    model, opt = shard(model, plan, adamw, init_from=init_from,
                       config=ShardConfig(tensor_parallel=T, gpus_per_node=GPUS_PER_NODE or dist.get_world_size(),
                                          recompute=recompute, init_seed=0))
    initial = consolidated_state_dict(model) if meta else None  # what shard() filled, before a step
    dp_rank, dp_world = dist.get_rank() // T, dist.get_world_size() // T
    losses, norms = [], []
    for step in range(steps):
        total = torch.zeros(1)
        for m in range(M):
            b = micro_batch(step, m, dp_rank, world_size=dp_world, num_micro_batches=M,
                            micro_batch_size=MBS, seq_len=SEQ)
            with contextlib.nullcontext() if m == M - 1 else model.no_sync():
                loss = causal_lm_loss(model, b) / M
                if nan and step == 0 and dist.get_rank() == 1:  # one TP rank's loss, once
                    loss = loss * float("nan")
                opt.backward(loss)
            total += loss.detach()
        dist.all_reduce(total)  # every TP rank of a data-parallel slot has the same loss
        losses.append(float(total) / dist.get_world_size())
        norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    model.amsp.wait_params()
    skipped = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(skipped, torch.tensor([opt.skipped_steps]))
    skipped = [int(x) for x in skipped]
    weights = consolidated_state_dict(model)  # rank 0: full tensors (TP and data-parallel gathers)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "norms": norms, "weights": weights,
                    "graph_breaks": sum(counters["graph_break"].values()), "skipped": skipped,
                    "initial": initial},
                   os.path.join(outdir, re.sub(r"[^A-Za-z0-9_.=-]", "_", plan + ("+compile" if compiled else "")
                                               + ("+recompute" if recompute else "") + ("+nan" if nan else "")
                                               + ("+t1" if T == 1 else "")
                                               + ("+init" if init else "+meta" if meta else ""))
                                + ".pt"))
    release(model)


def guards(tp_mesh, T, outdir):
    """Bad input under TP: each must be one ValueError line on every rank, before any collective
    (the barrier after each proves no rank was left inside one)."""
    cases = {
        "T does not divide the node": (lambda: parallelize_llama(build_llama("tiny-llama"), tp_mesh),
                                       dict(tensor_parallel=3)),
        "T without a TP model": (lambda: build_llama("tiny-llama"), dict(tensor_parallel=T)),
        "TP model without T": (lambda: parallelize_llama(build_llama("tiny-llama"), tp_mesh), {}),
    }
    got = {}
    for name, (make, cfg) in cases.items():
        model = make()
        try:
            shard(model, "ddp", adamw, config=ShardConfig(gpus_per_node=dist.get_world_size(), **cfg))
            got[name] = "no error"
        except ValueError as e:
            got[name] = str(e)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(got, os.path.join(outdir, "guards.pt"))


def main():
    T, outdir, steps, clip, plans = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    tp_mesh = tensor_parallel_mesh(T, "cpu")["tp"]
    for plan in plans.split(";"):
        if plan == "guards":
            guards(tp_mesh, T, outdir)
        else:
            base, *extras = plan.split("+")
            run_plan(base, tp_mesh, 1 if "t1" in extras else T, steps, clip, outdir, "compile" in extras,
                     "recompute" in extras, "nan" in extras, "meta" in extras, "init" in extras)
    end_worker(t0)


if __name__ == "__main__":
    main()
