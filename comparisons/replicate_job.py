"""The job comparisons/paired_replicate.py and comparisons/separate_jobs.py run (issue 23):
`amsp compare`'s full table (its model and shape, from ``amsp_ext.cli.compare.FULL``) in fp32,
AMSP on the replicate plan ``p=1x1,g=1x1,os=1x1``, 4 ranks posing as 2 nodes x 2, on gloo."""

import datetime

import torch
import torch.distributed as dist

from amsp_ext.cli.compare import FULL
from amsp_ext.compare.config import RunSpec
from amsp_ext.compare.systems.base import Context

JOB = ("model", "seq_len", "micro_batch_size", "num_micro_batches")


def start() -> tuple[RunSpec, Context]:
    """Join the launched job (one thread per rank) and return what every system runs."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RunSpec(**{k: FULL[k] for k in JOB}, precision="fp32", amsp_plan="p=1x1,g=1x1,os=1x1")
    return spec, Context(spec=spec, rank=rank, world_size=world, num_nodes=world // 2,
                         gpus_per_node=2)
