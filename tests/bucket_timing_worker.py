"""4 ranks as 2 nodes x 2: small-llama under the replicate plan with the two-level all-reduce;
rank 0 prints ``TIMING {json}``: when each cross-node all-reduce of the backward was issued
on rank 0 and when the slowest rank's backward reached the embedding, its last gradient (issue 51:
a slow link must not wait for the end of the backward to start its reductions); then, under
the MiCS config, the order of each unit's reduce-scatter and each bucket's replica all-reduce."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.planner.auto import AutoPlanConfig
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.shard import shard
from tests.parity_check import adamw

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
comm = C.CollectiveContext(timeout=120)
# the lab's 100 Mbit profile: the buckets close where its all-reduce says (planner/buckets.py
# [Note: where a bucket closes, from the link])
LAB_100MBIT = (Path(__file__).resolve().parents[1]
               / "comparisons/results/tune_small-llama_cpu-2x2-lab_2026-12-01/profile-100mbit.json")
model, opt = shard(build_llama("small-llama"), "ddp", adamw, comm=comm,
                   config=ShardConfig(gpus_per_node=2, precision="fp32", all_reduce="two_level",
                                      auto=AutoPlanConfig(seq_len=128, micro_batch_size=8,
                                                          profile=str(LAB_100MBIT), missing="fit")))
issued: list[tuple[float, str]] = []
backward_end: list[float] = []


def observe(event, op, name, info) -> None:
    if event == "issued" and op == "all_reduce":
        issued.append((time.perf_counter(), name))


def last_gradient(module, args, out) -> None:
    if out.requires_grad:  # the embedding's output: its gradient is the backward's last input
        out.register_hook(lambda g: backward_end.append(time.perf_counter()))


model.get_input_embeddings().register_forward_hook(last_gradient)
batch = micro_batch(0, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=8, seq_len=128)
with C.observing(comm, observe):
    issued.clear()
    opt.backward(causal_lm_loss(model, batch))
opt.step()
model.amsp.wait_params()
node = [t for t, name in issued if name.startswith("param_replica_node")]
# perf_counter is CLOCK_MONOTONIC, one clock for the machine's processes: the step's backward is
# over when its slowest rank's is (4 ranks on 2 cores run by turns)
ends = torch.zeros(world, dtype=torch.float64)
dist.all_gather_into_tensor(ends, torch.tensor([backward_end[-1]], dtype=torch.float64))

# The MiCS config (p = g = os inside the node, replicas across): the order in which rank 0
# issued each unit's reduce-scatter and each bucket's cross-node all-reduce in the backward
# (deferred_rs.py [Note: a reduce-scatter decoupled on CPU]: a unit's bucket goes out once its
# reduce-scatter has completed, seen at a poll point inside the next unit's backward)
comm_mics = C.CollectiveContext(timeout=120)
mics, mics_opt = shard(build_llama("small-llama"), "p=2x1,g=2x1,os=2x1", adamw, comm=comm_mics,
                       config=ShardConfig(gpus_per_node=2, precision="fp32"))
order: list[str] = []


def observe_mics(event, op, name, info) -> None:
    if event == "issued" and op in ("reduce_scatter", "all_reduce") and name.split("[")[0] in (
            "param_shard", "param_replica"):
        order.append(name.split("[")[0])


for step in range(2):  # the second: after the first step's lazy init
    with C.observing(comm_mics, observe_mics):
        order.clear()
        mics_opt.backward(causal_lm_loss(mics, batch))
    mics_opt.step()
    mics.amsp.wait_params()
if rank == 0:
    print("TIMING " + json.dumps({"node_issued": node, "backward_end": ends.max().item(),
                                  "close_bytes": model.amsp.config.grad_bucket_close_bytes,
                                  "num_buckets": len(model.amsp.grad_sync.buckets),
                                  "groups": sorted({name.split("[")[0] for _, name in issued}),
                                  "mics_order": order}), flush=True)
dist.barrier()
dist.destroy_process_group()
