"""Paired steps on the lab: DDP and AMSP's replicate plan (p=1x1,g=1x1,os=1x1) alternate step
by step inside ONE job, so each pair of steps ran under the same load (issue 23; `amsp compare`
runs each system as its own job, minutes apart, and its per-round ratios move with the shared
machine's load). Each step is timed by its slowest rank, after a barrier. small-llama, fp32,
seq 256, micro-batch 2, M = 4, AdamW, clipping 1.0: `amsp compare`'s job.

    amsp cluster up --name amsplb --nodes 2 --gpus-per-node 2 --inter-node-bandwidth 100mbit
    STEPS=6 amsp cluster run --name amsplb -- comparisons/paired_replicate.py
    amsp cluster down --name amsplb

``VARIANTS`` (default ``units,two_level``) picks the AMSP variants run beside DDP: ``units``
is the engine as it is (runtime/sync/grad_sync.py [Note: buckets close at unit boundaries]),
``two_level`` the same with ``all_reduce="two_level"`` (runtime/collectives.py [Note:
two-level all-reduce]), ``ddp`` an experiment with DDP's bucket layout (the first bucket closes
at the first unit boundary past 1 MiB, the rest fill to U), patched in here for the
measurement only.
"""

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

import amsp_ext.runtime.sync.grad_sync as gs
from amsp_ext.compare.systems import amsp, ddp
from amsp_ext.common.models import build_llama
from replicate_job import start

STEPS = int(os.environ.get("STEPS", 4))
VARIANTS = os.environ.get("VARIANTS", "units,two_level").split(",")
spec, ctx = start()  # the training steps are the harness's own (compare/systems)
rank = ctx.rank
_orig = gs._plan_buckets


def ddp_layout(tensors, bucket_numel, unit_min_numel=None):
    """DDP's: the first bucket closes at the first unit boundary past 1 MiB, the rest fill to U."""
    first = _orig(tensors, bucket_numel, unit_min_numel)[0]
    return [first] + _orig(list(tensors)[: len(tensors) - len(first.slots)], bucket_numel, None)


def timed_ms(step) -> float:
    """One step's time on its slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() * 1000


def fresh_model():
    torch.manual_seed(spec.seed)
    return build_llama(spec.model)


systems = {"ddp": ddp.setup("ddp", fresh_model(), ctx).train_step}
for v in VARIANTS:
    gs._plan_buckets = {"units": _orig, "two_level": _orig, "ddp": ddp_layout}[v]
    model = fresh_model()
    vctx = ctx if v != "two_level" else dataclasses.replace(
        ctx, spec=spec.replace(amsp_all_reduce="two_level"))
    systems[f"amsp-{v}"] = amsp.setup("amsp-plan", model, vctx).train_step
    if rank == 0:
        mib = [round(b.numel * 4 / 2**20, 2) for b in model.amsp.grad_sync.buckets]
        print(v, "buckets (MiB):", mib, flush=True)
gs._plan_buckets = _orig

times = {k: [] for k in systems}
names = list(systems)
for s in range(STEPS + 1):  # step 0 is a warm-up
    for k in (names if s % 2 == 0 else names[::-1]):
        t = timed_ms(lambda: systems[k](s))
        if s > 0:
            times[k].append(t)
if rank == 0:
    for k, ts in times.items():
        print(f"{k:12s} median {statistics.median(ts):7.0f} ms  all {[round(t) for t in ts]}", flush=True)
    for k in names[1:]:
        r = [d / a for d, a in zip(times["ddp"], times[k])]
        print(f"{k} / ddp throughput ratio per step: median {statistics.median(r):.3f} {[round(x, 3) for x in r]}")
dist.destroy_process_group()
