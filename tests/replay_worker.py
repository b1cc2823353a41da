"""2 ranks: one step's collectives recorded and replayed alone (runtime/collectives.py [Note: a
step's collectives replayed alone]); prints what was recorded and what the replay moved."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from amsp_ext.runtime import collectives as C

dist.init_process_group("gloo")
ctx = C.CollectiveContext(timeout=60)
sub = dist.new_group([0, 1])
torch.manual_seed(0)
# 4 layers of 32x32 + 32 (4224 B each in fp32), 5,000 B buckets: DDP's reducer issues from C++
ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]), bucket_cap_mb=5000 / 2**20)
for _ in range(2):
    ddp(torch.randn(4, 32)).sum().backward()
with C.recording_collectives() as ops:
    ddp(torch.randn(4, 32)).sum().backward()
    out = torch.empty(2 * 100, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.ones(100, dtype=torch.bfloat16), group=sub)
    dist.broadcast(torch.zeros(7, dtype=torch.float64), src=0, group=sub)
got = C.replay_alone(ctx, ops, name="world")
if dist.get_rank() == 0:
    print("REPLAY " + json.dumps({"ops": [name for name, _, _, _ in ops], **got}), flush=True)
dist.barrier()
dist.destroy_process_group()
