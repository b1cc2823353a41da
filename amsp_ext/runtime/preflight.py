"""``shard()``'s preflight: everything before the engine is assembled (runtime/engine.py).

[Note: preflight, resolve, assemble]
``shard()`` reads as three steps. The preflight checks the arguments and the world, with no
collective: the data-parallel world of the plan (``plan_world``), the job it describes
(``job_of``: amsp_ext/job.py [Note: one job, resolved once]) and what resolving it still lacks.
Resolving fills that - the cluster's profile (measured by the ranks together or found in the
cache, runtime/measure/cluster.py) and the device's memory - and calls ``amsp_ext.job.resolve``,
as every launcher does (``resolve_on_ranks``); a job a launcher already resolved
(a ``ResolvedJob``) skips it. Then every rank compares fingerprints of what it is about to build
(``check_same_everywhere``: the first collective) and the engine is assembled. The start-up
helpers here (``same_initial_weights``, ``engine_device``, ``enable_recompute``) prepare the
model between the two.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.job import Job, needs, resolve
from amsp_ext.planner.plan import Plan, PlanError
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.measure.cluster import cluster_profile, cluster_profile_named
from amsp_ext.runtime.sync.units import decoder_layers
from amsp_ext.topology.groups import World
from amsp_ext.topology.mesh import build_data_parallel_group
from amsp_ext.topology.profile_cache import cpu_memory_per_rank

__all__ = ["MismatchError", "check_same_everywhere", "device_memory", "enable_recompute", "engine_device",
           "job_of", "plan_world", "resolve_on_ranks", "run_fingerprint", "same_initial_weights"]


class MismatchError(ValueError):
    """Ranks were given different plans, configs or models."""


def plan_world(config: ShardConfig) -> World:
    """The data-parallel world the plan runs on (topology/groups.py [Note: the data-parallel
    world of a 2-D mesh]): R / T ranks per node under tensor parallelism of degree T."""
    world_size = dist.get_world_size()
    R = config.gpus_per_node or world_size
    if world_size % R:
        raise PlanError(
            f"config.gpus_per_node={R} must divide the world size {world_size}"
        )
    T = config.tensor_parallel
    if R % T:
        raise ValueError(f"config.tensor_parallel={T} must divide the GPUs per node ({R}); allowed: "
                         f"{', '.join(str(t) for t in range(1, R + 1) if R % t == 0)}")
    return World.with_leaves(num_nodes=world_size // R, gpus_per_node=R // T,
                             nodes_per_leaf=config.nodes_per_leaf, tensor_parallel=T)


def run_fingerprint(plan: Plan, config: ShardConfig, world: World, model: nn.Module) -> bytes:
    shapes = hashlib.sha256(
        repr([(n, tuple(p.shape)) for n, p in model.named_parameters()]).encode()
    ).hexdigest()[:8]
    return f"{plan.fingerprint()}:{config.fingerprint()}:{shapes}:{world.num_nodes}x{world.gpus_per_node}|{plan}".encode()


def check_same_everywhere(comm: C.CollectiveContext, payload: bytes, config: ShardConfig) -> None:
    got = C.all_gather_bytes(comm, payload, None, name="world", timeout=config.timeout)
    if any(g != got[0] for g in got):
        bad = next(r for r, g in enumerate(got) if g != got[0])
        what = []
        a, b = got[0].decode().split("|")[0].split(":"), got[bad].decode().split("|")[0].split(":")
        for field, x, y in zip(("plan", "config", "model", "world"), a, b):
            if x != y:
                what.append(field)
        if "config" in what:  # every rank is here: one more gather names the field
            what[what.index("config")] = _config_difference(comm, config, bad)
        raise MismatchError(
            f"amsp: ranks disagree on the {', '.join(what) or 'setup'}: rank 0 has plan "
            f"{got[0].decode().split('|')[1]}, rank {bad} has plan {got[bad].decode().split('|')[1]} "
            f"(fingerprints {got[0].decode().split('|')[0]} vs {got[bad].decode().split('|')[0]})"
        )


def _config_difference(comm: C.CollectiveContext, config: ShardConfig, bad: int) -> str:
    mine = json.dumps({k: repr(v) for k, v in config.fingerprint_fields().items()}).encode()
    got = [json.loads(g) for g in C.all_gather_bytes(comm, mine, None, name="world", width=4096,
                                                    timeout=config.timeout)]
    fields = [k for k in got[0] if got[0][k] != got[bad].get(k)]
    return "config (" + ", ".join(f"field {k}: {got[0][k]} on rank 0, {got[bad][k]} on rank {bad}"
                                  for k in fields) + ")"


@torch.no_grad()
def same_initial_weights(comm: C.CollectiveContext, model: nn.Module, config: ShardConfig, world: World) -> None:
    """[Note: initial weights agree]
    Every rank must start from the same weights, or the replicas silently train a mix (a
    rank-dependent seed is enough). ``init_weights="broadcast"`` (default, as DDP): rank 0's
    parameters and buffers are broadcast to the others before sharding. ``"check"``: a SHA-256
    of each rank's weights is compared, and differing ranks are refused with one line (for
    users who want to know that their ranks built different models)."""
    tensors = list({id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    T = world.tensor_parallel
    if T > 1:  # TP shards differ across a TP group: agree per TP coordinate
        tensors = [compat.dtensor_local(t) for t in tensors]
    if config.init_weights == "broadcast":
        group, src, name = None, 0, "world"
        if T > 1:  # from the first data-parallel rank of my TP coordinate
            dp = build_data_parallel_group(world, datetime.timedelta(seconds=config.timeout))
            group, src, name = dp.pg, dist.get_rank() % T, dp.name
        # all issued, then waited for, on the current stream (the model's tensors are there)
        pending = [C.broadcast(comm, t.detach(), src, group, name=name, stream=None,
                               timeout=config.timeout) for t in tensors]
        for p in pending:
            C.wait(p)
        return
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    got = C.all_gather_bytes(comm, h.digest()[:16], None, name="world", timeout=config.timeout)
    differ = [r for r, g in enumerate(got) if g != got[r % T]]  # vs the first rank of its TP coordinate
    if differ:
        raise MismatchError(
            f"amsp: ranks' initial weights differ (rank(s) {', '.join(map(str, differ))} vs rank 0): build "
            f"the model with the same seed on every rank, or use ShardConfig(init_weights='broadcast')")


def engine_device(model: nn.Module) -> torch.device:
    """Where the engine runs: the GPU of an NCCL rank, else the CPU (gloo). The fake backend of
    a dry run (tools/dryrun.py [Note: dry run]) moves no data, so its rank runs where
    its model was built (a model on meta: the default device it is sharded under): on a GPU,
    the streams, events and allocator are a real run's."""
    backend = dist.get_backend()
    where = next(model.parameters()).device
    if backend == "fake" and where.type == "meta":  # the dry run's ``with torch.device(...)``
        where = torch.get_default_device()
    if backend == "nccl" or (backend == "fake" and where.type == "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def enable_recompute(model: nn.Module) -> None:
    if hasattr(model, "gradient_checkpointing_enable"):
        if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(model):
        fwd = layer.forward
        layer.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def job_of(model: nn.Module, plan: "Plan | str", config: ShardConfig, world: World) -> Job:
    """``shard()``'s surface as a Job: the model's Hugging Face config (None for another
    module: explicit plans only), the world's nodes and physical ranks per node, ``config``."""
    hf = getattr(model, "config", None)
    shape = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None
    R = world.gpus_per_node * world.tensor_parallel
    return Job(model=shape, num_nodes=world.num_nodes, plan=plan,
               engine=config if config.gpus_per_node == R else dataclasses.replace(config, gpus_per_node=R))


def resolve_on_ranks(comm: C.CollectiveContext, job: Job, world: World, *, log=print):
    """``(resolved job, ProfileSource or None)``: the ranks' half of [Note: one job, resolved
    once] - what ``needs(job)`` lacks filled here (the profile by every rank together, the memory
    from the device), then ``resolve``, the same function with the same inputs on every rank. A
    named profile is said once by rank 0 and loaded by the planner."""
    missing = needs(job)  # a job the planner cannot price: one line, before any collective
    profile = source = None
    auto = job.engine.auto
    if "profile" in missing:
        profile, source = cluster_profile(comm, world, timeout=job.engine.timeout, log=log)
    elif job.priced() and auto is not None and isinstance(auto.profile, str):
        source = cluster_profile_named(auto.profile, log=log)
    memory = device_memory(job.gpus_per_node) if "memory" in missing else None
    resolved = resolve(job, profile=profile, gpu_memory_bytes=memory,
                       profile_source=source.as_dict() if source is not None else None)
    return resolved, source


def device_memory(gpus_per_node: int) -> int:
    """Memory per rank: an NCCL rank's GPU, else the host's RAM shared by a node's ranks."""
    if dist.get_backend() == "nccl":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return cpu_memory_per_rank(gpus_per_node)
