"""One system per job, with its CPU accounted (issue 23: AMSP's replicate plan against DDP as
separate jobs). `amsp compare`'s job (small-llama, fp32, seq 256, micro-batch 2, M = 4, AdamW,
clipping 1.0) run by ``SYSTEM`` alone: ``ddp``, or ``amsp`` with the plan ``p=1x1,g=1x1,os=1x1``.
Run the systems alternately, several rounds, and compare per round:

    for i in 1 2 3 4 5 6; do for s in ddp amsp; do
      SYSTEM=$s STEPS=4 torchrun --nproc-per-node 4 comparisons/separate_jobs.py; done; done

Rank 0 prints one JSON line: the median step (each step timed by its slowest rank, after a
barrier; step 0 is a warm-up), and per step, summed over ranks, the process CPU time, the
main (training) thread's, and the involuntary context switches; per rank, the main thread's
CPU and wall time in the forward, backward and optimizer phases. With every rank busy, a step
takes about (CPU over all ranks) / (cores); ``core_use`` = CPU / (cores x step) says how much
of the cores the job kept busy, so a system that needs no more CPU but waits more shows there.

``PIN_CORES=1`` (an experiment): rank r and every thread it starts run on core r mod cores
only, so the scheduler cannot move them. ``NUM_IDLE_GROUPS=N`` (an experiment): the job first
makes N gloo groups over all ranks and never uses them, as the engine's mesh does with its
one-rank and unused groups (each gloo group has its own TCP loop thread; on rank 0 of an AMSP
job each of them woke 585-1174 times, used or not).
"""

import contextlib
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from amsp_ext.compare.systems import amsp, ddp
from amsp_ext.common.models import build_llama
from replicate_job import start

SYSTEM = os.environ["SYSTEM"]
if SYSTEM not in ("ddp", "amsp"):
    raise SystemExit(f"SYSTEM must be ddp or amsp, got {SYSTEM!r}")
STEPS = int(os.environ.get("STEPS", 4))
CORES = sorted(os.sched_getaffinity(0))
if os.environ.get("PIN_CORES") == "1":  # an experiment: rank r and its threads on core r % cores
    os.sched_setaffinity(0, {CORES[int(os.environ["RANK"]) % len(CORES)]})
spec, ctx = start()  # after the pinning: the groups' threads inherit it
rank, world = ctx.rank, ctx.world_size

PHASES = ("forward", "backward", "optimizer")
phase_cpu_wall = {p: [0.0, 0.0] for p in PHASES}


@contextlib.contextmanager
def timed_phase(name: str):
    c0, w0 = time.thread_time(), time.perf_counter()
    try:
        yield
    finally:
        phase_cpu_wall[name][0] += time.thread_time() - c0
        phase_cpu_wall[name][1] += time.perf_counter() - w0


amsp.phase = ddp.phase = timed_phase  # the harness's phase labels, timed here instead

# NUM_IDLE_GROUPS (see the docstring): made and never used
for _ in range(int(os.environ.get("NUM_IDLE_GROUPS", 0))):
    dist.new_group(list(range(world)))

torch.manual_seed(spec.seed)
model = build_llama(spec.model)
train_step = (ddp.setup("ddp", model, ctx) if SYSTEM == "ddp" else amsp.setup("amsp-plan", model, ctx)).train_step

steps = []  # (slowest rank's wall, CPU over ranks, main-thread CPU over ranks, invol. switches)
for s in range(STEPS + 1):
    dist.barrier()
    r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    train_step(s)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    sums = torch.tensor([r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                         time.thread_time() - m0, r1.ru_nivcsw - r0.ru_nivcsw], dtype=torch.float64)
    slowest = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if s > 0:
        steps.append((slowest.item(), *sums.tolist()))

mine = torch.tensor([v / (STEPS + 1) for p in PHASES for v in phase_cpu_wall[p]], dtype=torch.float64)
per_rank = [torch.zeros_like(mine) for _ in range(world)]
dist.all_gather(per_rank, mine)
if rank == 0:
    cores = len(CORES)
    step_s = statistics.median(x[0] for x in steps)
    cpu_s = statistics.median(x[1] for x in steps)
    print(json.dumps({
        "system": SYSTEM,
        "num_idle_groups": int(os.environ.get("NUM_IDLE_GROUPS", 0)),
        "pinned": os.environ.get("PIN_CORES") == "1",
        "step_ms_median": round(step_s * 1000), "step_ms": [round(x[0] * 1000) for x in steps],
        "cpu_ms_per_step": round(cpu_s * 1000),
        "main_thread_cpu_ms_per_step": round(statistics.median(x[2] for x in steps) * 1000),
        "involuntary_switches_per_step": round(statistics.median(x[3] for x in steps)),
        "core_use": round(cpu_s / (cores * step_s), 3),
        "phase_cpu_wall_ms_per_rank": {p: [[round(r[2 * i].item() * 1000), round(r[2 * i + 1].item() * 1000)]
                                           for r in per_rank] for i, p in enumerate(PHASES)},
    }), flush=True)
dist.destroy_process_group()
