"""One gradient all-reduce of small-llama's 11.57 MiB (fp32) over the lab's 2 x 2 world, as one
flat ring (``dist.all_reduce``, what DDP issues) and as the engine's two-level all-reduce
(runtime/collectives.py all_reduce_two_level: reduce-scatter inside the node, all-reduce of the
half across nodes, all-gather inside), in alternated order, each timed by its slowest rank
after a barrier; median of REPS. Also checks that both give the same sum.

    amsp cluster up --name amsplb --nodes 2 --gpus-per-node 2 --inter-node-bandwidth 100mbit
    REPS=5 amsp cluster run --name amsplb -- comparisons/lab_two_level.py
    amsp cluster down --name amsplb
"""

import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from amsp_ext.runtime import collectives as C

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
R = int(os.environ["LOCAL_WORLD_SIZE"])
ctx = C.CollectiveContext(timeout=300.0)
local = node = None
for n in range(world // R):  # every rank creates every group, in the same order
    g = dist.new_group(list(range(n * R, (n + 1) * R)))
    if rank // R == n:
        local = (g, f"local[{n}]")
for i in range(R):
    g = dist.new_group(list(range(i, world, R)))
    if rank % R == i:
        node = (g, f"node[{i}]")
NUMEL = (int(11.57 * 2**20) // 4) // R * R


def flat(buf):
    C.wait(C.all_reduce(ctx, buf, None, name="world", stream=None))


def two_level(buf):
    C.wait(C.all_reduce_two_level(ctx, buf, local, node, stream=None))


x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
a, b = x.clone(), x.clone()
flat(a)
two_level(b)
err = torch.tensor([(a - b).abs().max().item() / a.abs().max().item()])
dist.all_reduce(err, op=dist.ReduceOp.MAX)


def timed_ms(fn) -> float:
    buf = torch.ones(NUMEL)
    dist.barrier()
    t0 = time.perf_counter()
    fn(buf)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() * 1000


times = {"flat": [], "two_level": []}
for r in range(int(os.environ.get("REPS", 5))):
    for name in (("flat", "two_level") if r % 2 == 0 else ("two_level", "flat")):
        times[name].append(timed_ms(flat if name == "flat" else two_level))
if rank == 0:
    res = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:10s} median {res[k]:7.1f} ms  all {[round(t) for t in v]}", flush=True)
    print(f"max relative difference of the sums: {err.item():.1e}")
    print("RESULT " + json.dumps({**res, "rel_diff": err.item()}))
dist.destroy_process_group()
