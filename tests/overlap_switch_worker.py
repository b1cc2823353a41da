"""torchrun worker for tests/test_overlap_switches.py: for each Table V switch, the same tiny run
with the switch on and off, profiled; rank 0 prints ``RESULT {json}``: per case, per kind, how
many collectives were waited for and how many of those had compute (a matmul) between their
issue and their wait (compare/breakdown.py [Note: issue-to-wait windows]).

Usage: python -m tests.overlap_switch_worker
"""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from amsp_ext.compare.breakdown import overlap_windows
from amsp_ext.runtime.config import OverlapConfig, ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from tests.dist_utils import end_worker, free_plan_groups
from tests.parity_check import adamw

# switch -> (plan, the engine settings that make that kind issue several collectives a step)
CASES = {
    "allgather": ("p=2x1,g=2x1,os=2x1", {}),
    "allreduce": ("p=1x1,g=1x1,os=1x1", {"grad_bucket_bytes": 64 * 1024}),
    # one broadcast per tensor (no packing), so each unit's forward waits for its own
    "broadcast": ("p=1x1,g=1x1,os=2x1", {"broadcast_bucket_bytes": 0}),
}


def run_case(plan: str, settings: dict, overlap: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ShardConfig(gpus_per_node=2, precision="fp32", overlap=OverlapConfig(**overlap),
                         **settings)
    model, opt = shard(build_llama("tiny-llama"), plan, adamw, config=config)

    def step(s: int) -> None:
        batch = micro_batch(s, 0, rank, world_size=world, num_micro_batches=1,
                            micro_batch_size=1, seq_len=32)
        opt.backward(causal_lm_loss(model, batch))
        with opt.broadcast_under_next_forward():  # the overlap under test
            opt.step()
        opt.zero_grad()

    model.amsp.wait_params()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(1)
        step(2)  # waits, in its forward, for step 1's broadcasts
        # compare/worker.py [Note: no collective in flight across a profiler boundary]
        with record_function("test::drain"):
            model.amsp.wait_params()
    events = prof.events()
    end = next(e.time_range.start for e in events if e.name == "test::drain")
    out = overlap_windows([e for e in events if e.time_range.end <= end])  # the steps, not the drain
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    free_plan_groups(model.amsp.mesh)
    return out


def main() -> None:
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    result = {}
    for switch, (plan, settings) in CASES.items():
        for on in (True, False):
            overlap = {"allgather": True, "allreduce": True, "broadcast": True, switch: on}
            result[f"{switch}:{'on' if on else 'off'}"] = run_case(plan, settings, overlap)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    end_worker(t0)


if __name__ == "__main__":
    main()
