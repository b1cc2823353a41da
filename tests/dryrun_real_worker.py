"""Real 4-rank gloo run of tiny-llama for test_dryrun's equivalence check: per plan, one step of
the dry run's loop (tools/dryrun.dry_step) with the same CollectiveLog, then rank 0
writes {plan: {"collectives": [...], "model_state_bytes": {...}}} as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.tools.dryrun import CollectiveLog, DryRunSpec, dry_step
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.config import EngineConfig
from amsp_ext.common.models import build_llama
from tests.dist_utils import free_plan_groups

ENGINE = EngineConfig(precision="bf16", reduce_dtype="fp32", granularity="module")  # as test_dryrun's

PLANS = ("zero3", "mics:2", "p=2x1,g=2x1,os=2x2", "p=1x1,g=1x1,os=2x2")


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = {}
    for plan in PLANS:
        spec = DryRunSpec(engine=ENGINE, model="tiny-llama", num_nodes=2, gpus_per_node=2, plan=plan, seq_len=32, steps=1)
        clog = CollectiveLog(world=4, gpus_per_node=2)
        model, opt = shard(build_llama("tiny-llama"), plan, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                           config=ShardConfig(gpus_per_node=2, precision="bf16", reduce_dtype="fp32",
                                              granularity="module"),
                           comm=C.CollectiveContext(timeout=120, observers=[clog]))
        dry_step(model, opt, spec, torch.device("cpu"), clog)
        got[plan] = {"collectives": [c for c in clog.records if c["phase"] != "setup"],
                     "model_state_bytes": model.model_state_bytes()}
        model.amsp.grad_sync.remove()
        model.amsp.param_sync.remove()
        mesh = model.amsp.mesh
        del model, opt
        free_plan_groups(mesh)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
