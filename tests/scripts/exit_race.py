"""Repro for the abort at interpreter exit (runtime/collectives.py [Note: process groups torn
down at exit]): four ranks shard a small model, train two steps, run the script's own
collectives on temporaries and destroy their groups, as a user's script does. Not a test (a
race): run it many times on a loaded machine and count the failed jobs.

    (timeout 400 yes > /dev/null &); (timeout 400 yes > /dev/null &)
    for i in $(seq 20); do torchrun --nproc-per-node 4 tests/scripts/exit_race.py >/dev/null 2>&1 || echo failed; done
"""
import datetime
import os

import torch
import torch.distributed as dist

from amsp_ext import shard
from amsp_ext.engine_config import EngineConfig

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
model, opt = shard(model, os.environ.get("PLAN", "p=1x1,g=1x1,os=2x1"), lambda p: torch.optim.AdamW(p),
                   config=EngineConfig(gpus_per_node=2))
for _ in range(2):
    loss = model(torch.randn(8, 64)).square().mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
for _ in range(20):  # the script's own collectives on temporaries, right before exit
    out = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.ones(4) * dist.get_rank())
dist.destroy_process_group()
