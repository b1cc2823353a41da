"""Paired steps on the lab: DDP and AMSP's replicate plan (p=1x1,g=1x1,os=1x1) alternate step
by step inside ONE job, so each pair of steps ran under the same load (issue 23; `amsp compare`
runs each system as its own job, minutes apart, and its per-round ratios move with the shared
machine's load). Each step is timed by its slowest rank, after a barrier. small-llama, fp32,
seq 256, micro-batch 2, M = 4, AdamW, clipping 1.0: `amsp compare`'s job.

    amsp cluster up --name amsplb --nodes 2 --gpus-per-node 2 --inter-node-bandwidth 100mbit
    STEPS=6 amsp cluster run --name amsplb -- comparisons/paired_replicate.py
    amsp cluster down --name amsplb

``VARIANTS`` (default ``units,ddp``) picks the AMSP gradient-bucket layouts run beside DDP:
``units`` is the engine's (runtime/sync/grad_sync.py [Note: buckets close at unit boundaries]),
``ddp`` an experiment with DDP's layout (the first bucket closes at the first unit boundary past
1 MiB, the rest fill to U), patched in here for the measurement only.
"""

import contextlib
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import amsp_ext.runtime.sync.grad_sync as gs
from amsp_ext import shard
from amsp_ext.engine_config import EngineConfig
from amsp_ext.train.data import micro_batch
from amsp_ext.train.models import build_llama, causal_lm_loss

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
M, MBS, SEQ = 4, 2, 256
STEPS = int(os.environ.get("STEPS", 4))
VARIANTS = os.environ.get("VARIANTS", "units,ddp").split(",")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


_orig = gs._plan_buckets


def ddp_layout(tensors, bucket_numel, unit_min_numel=None):
    """DDP's: the first bucket closes at the first unit boundary past 1 MiB, the rest fill to U."""
    first = _orig(tensors, bucket_numel, unit_min_numel)[0]
    return [first] + _orig(list(tensors)[: len(tensors) - len(first.slots)], bucket_numel, None)


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() * 1000, out


systems = {}
torch.manual_seed(0)
ddp = DDP(build_llama("small-llama"))
dopt = adamw(ddp.parameters())


def ddp_step(s):
    for m in range(M):
        b = micro_batch(s, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=MBS, seq_len=SEQ)
        with (ddp.no_sync() if m < M - 1 else contextlib.nullcontext()):
            (causal_lm_loss(ddp, b) / M).backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    dopt.step()
    dopt.zero_grad(set_to_none=True)


systems["ddp"] = ddp_step
for v in VARIANTS:
    gs._plan_buckets = {"units": _orig, "ddp": ddp_layout}[v]
    torch.manual_seed(0)
    model, opt = shard(build_llama("small-llama"), "p=1x1,g=1x1,os=1x1", adamw,
                       config=EngineConfig(gpus_per_node=2, precision="fp32", reduce_dtype="fp32"))
    if rank == 0:
        print(v, "buckets (MiB):", [round(b.numel * 4 / 2**20, 2) for b in model.amsp.grad_sync.buckets], flush=True)

    def amsp_step(s, model=model, opt=opt):
        for m in range(M):
            b = micro_batch(s, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=MBS, seq_len=SEQ)
            with (model.no_sync() if m < M - 1 else contextlib.nullcontext()):
                opt.backward(causal_lm_loss(model, b) / M)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    systems[f"amsp-{v}"] = amsp_step

times = {k: [] for k in systems}
names = list(systems)
for s in range(STEPS + 1):
    order = names if s % 2 == 0 else names[::-1]
    for k in order:
        t, _ = timed(lambda: systems[k](s))
        if s > 0:
            times[k].append(t)
for k, ts in times.items():
    if rank == 0:
        print(f"{k:12s} median {statistics.median(ts):7.0f} ms  all {[round(t) for t in ts]}", flush=True)
if rank == 0:
    for k in names[1:]:
        r = [d / a for d, a in zip(times["ddp"], times[k])]
        print(f"{k} / ddp throughput ratio per step: median {statistics.median(r):.3f} {[round(x, 3) for x in r]}")
dist.destroy_process_group()
