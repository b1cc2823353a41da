"""The same 11.57 MiB of fp32 gradients (small-llama's) all-reduced over the world as one bucket,
as DDP's two (1 MiB, then the rest), and as k equal buckets, issued back to back async (what
the engine does) or each waited for before the next (``serial``); with the training thread
idle (busy=0) or running 256x256 matmuls for 600 ms meanwhile (busy=600). Median of REPS.
Issue 23: does splitting the replica all-reduce into per-unit buckets cost link time?

    amsp cluster up --name amsplb --nodes 2 --gpus-per-node 2 --inter-node-bandwidth 100mbit
    REPS=3 amsp cluster run --name amsplb -- comparisons/lab_bucket_split.py
    amsp cluster down --name amsplb
"""

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
TOTAL = int(11.57 * 2**20) // 4  # fp32 elements
a = torch.randn(256, 256)


def shapes():
    yield "1x", [TOTAL]
    yield "ddp", [2**18, TOTAL - 2**18]
    for k in (2, 5, 10):
        yield f"{k}x", [TOTAL // k] * k


def run(sizes, busy_ms, serial):
    bufs = [torch.ones(n) for n in sizes]
    dist.barrier()
    t0 = time.perf_counter()
    works = []
    for b in bufs:
        w = dist.all_reduce(b, async_op=True)
        if serial:
            w.wait()
        else:
            works.append(w)
        if busy_ms:
            end = time.perf_counter() + busy_ms / 1000 / len(bufs)
            while time.perf_counter() < end:
                a @ a
    for w in works:
        w.wait()
    return (time.perf_counter() - t0) * 1000


res = {}
for busy in (0, 600):
    for name, sizes in shapes():
        for serial in (False,) if name == "1x" else (False, True):
            key = f"{name}{' serial' if serial else ''} busy={busy}"
            ts = [run(sizes, busy, serial) for _ in range(int(os.environ.get("REPS", 3)))]
            res[key] = sorted(ts)[len(ts) // 2]
            if rank == 0:
                print(f"{key:28s} median {res[key]:8.1f} ms  all {[round(t) for t in ts]}", flush=True)
if rank == 0:
    print("RESULT " + json.dumps(res))
dist.destroy_process_group()
