"""Worker for tests/test_bound_rendezvous.py: under ``python -m amsp_ext.tools.rendezvous``
(2 ranks, master address 127.0.0.2) the ranks meet through the agent's store, all-reduce, and
rank 0 prints the local addresses of every LISTEN socket on MASTER_PORT (kernel table)."""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from test_loopback import _listening

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
port = int(os.environ["MASTER_PORT"])
if dist.get_rank() == 0:
    addrs = sorted({a.split(":")[0] for a in _listening().values() if int(a.split(":")[1], 16) == port})
    print("RESULT " + json.dumps({"sum": float(t), "addrs": addrs, "master": os.environ["MASTER_ADDR"],
                                  "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}), flush=True)
dist.barrier()
dist.destroy_process_group()
