"""Build the process groups a plan's collectives run on, once (the torch half of the topology:
the rank lists themselves are pure Python, in amsp_ext.topology.groups).

[Note: only the groups the plan issues collectives on]
A plan names five group kinds over an eight-axis mesh (groups.py), but a rank issues
collectives on at most four of them, and only on those with more than one rank: a group of one
rank moves nothing (GradSync, ParamSync and FSDP2 skip it), and the ``optim`` kind sizes the
grad-norm reduction, which runs on the default group (engine.py ``norm_group``). So we build one
process group per kind in KINDS_WITH_COLLECTIVES whose groups have several ranks (plus the two
levels of a two-level all-reduce), with ``dist.new_group``, and none for the rest.
- Why not the whole mesh: an eight-axis DeviceMesh builds a group per axis and per flattened
  kind: 12 gloo groups per rank for DDP's plan on 2 x 2, which uses one. Each gloo group holds
  connections and a TCP loop thread per rank, and each NCCL group a communicator. On the CPU
  lab (4 ranks, DDP's plan as separate jobs), going from 12 groups to 1 cut the CPU outside the
  training threads from 172 to 94 ms a step (DDP: 75) and raised core use from 0.94 to 0.98
  (comparisons/results/design_history.md, "Gradient bucket views and per-kind groups").
- FSDP2 takes a DeviceMesh: for sp > 1 the ``param_shard`` group becomes a 1-D mesh with
  ``DeviceMesh.from_group``, which builds no further group.
- ``new_group`` is collective over the default group: every rank walks every group of every kind
  in the same (sorted) order, members or not, as DeviceMesh does.
We cross-check every built group against the pure-Python rank lists, so the tested layout is the
one that runs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from amsp_ext.engine_config import DEFAULT_TIMEOUT_S
from amsp_ext.planner.plan import Plan
from amsp_ext.topology.groups import (ALL_REDUCE_KINDS, World, group_of, groups_over, level_axes,
                                      mesh_ranks, rank_groups)

__all__ = ["KINDS_WITH_COLLECTIVES", "GroupHandle", "PlanMesh", "build_data_parallel_group", "build_plan_mesh",
           "destroy_plan_mesh"]

# the kinds the runtime issues collectives on (Tp, T0_os, Tg, T1_os); see the Note above
KINDS_WITH_COLLECTIVES = ("param_shard", "param_replica", "grad", "optim_bcast")


@dataclass(frozen=True, kw_only=True)
class GroupHandle:
    """One process group as the engine hands it around: the group, the label traces and timeout
    errors name it by, its size, how long a wait on it may take, and whether it spans nodes (its
    collectives cross the slow links). ``pg`` None: the default group, or, when ``size`` is 1, no
    group at all (nothing is issued on it). ``levels``: the group's (inside this node, across
    nodes) halves when its all-reduce runs on two levels (groups.py [Note: the two levels of an
    all-reduce group]); None: one flat collective."""

    pg: dist.ProcessGroup | None
    name: str
    size: int
    timeout: float
    cross_node: bool
    levels: "tuple[GroupHandle, GroupHandle] | None" = None


@dataclass(frozen=True, kw_only=True)
class PlanMesh:
    plan: Plan
    world: World
    groups: dict[str, dist.ProcessGroup | None]  # kind -> this rank's group; None: not built
    ranks: dict[str, list[int]]  # kind -> this rank's group, as global ranks (every kind)
    shard_mesh: DeviceMesh | None  # FSDP2's 1-D mesh over the param_shard group; None: sp = 1

    def group(self, kind: str) -> dist.ProcessGroup | None:
        return self.groups[kind]

    def size(self, kind: str) -> int:
        return len(self.ranks[kind])

    def name(self, kind: str) -> str:
        """Label used in traces and timeout messages, e.g. ``param_replica[0,2]``."""
        return f"{kind}[{','.join(map(str, self.ranks[kind]))}]"

    def handle(self, kind: str, *, timeout: float) -> GroupHandle:
        """This rank's group of ``kind`` as one object, with its two levels when they were built."""
        nodes = {self.world.node_of(r) for r in self.ranks[kind]}
        levels = None
        if f"{kind}_local" in self.ranks:
            levels = (self.handle(f"{kind}_local", timeout=timeout),
                      self.handle(f"{kind}_node", timeout=timeout))
        return GroupHandle(pg=self.groups[kind], name=self.name(kind), size=self.size(kind),
                           timeout=timeout, cross_node=len(nodes) > 1, levels=levels)


def plan_groups(plan: Plan, world: World, two_level: bool = False) -> dict[str, list[list[int]]]:
    """Pure Python: kind -> every group of that kind, for each kind that gets a process group
    (see the Note), in the order ``build_plan_mesh`` creates them. ``two_level``: also the two
    levels (``<kind>_local``, ``<kind>_node``) of each ALL_REDUCE_KINDS group that has several
    ranks on each of several nodes."""
    out = {kind: groups for kind, groups in rank_groups(plan, world).items()
           if kind in KINDS_WITH_COLLECTIVES and len(groups[0]) > 1}
    if two_level:
        coords = mesh_ranks(plan, world)
        for kind in ALL_REDUCE_KINDS:
            local, node = (groups_over(coords, axes) for axes in level_axes(kind))
            if len(local[0]) > 1 and len(node[0]) > 1:
                out[f"{kind}_local"], out[f"{kind}_node"] = local, node
    return out


def build_plan_mesh(plan: Plan, world: World, device_type: str = "cpu",
                    timeout: datetime.timedelta | None = None, two_level: bool = False,
                    tp_shard_mesh: DeviceMesh | None = None) -> PlanMesh:
    """Collective over the default group: every rank must call it with the same plan.

    ``tp_shard_mesh``: under tensor parallelism with sp > 1, FSDP2's mesh: the data-parallel
    dimension of the model's own 2-D mesh (FSDP2 joins it with the TP DTensors' mesh, which
    needs one root mesh); it must hold exactly this rank's param_shard group.

    ``timeout``: the timeout of the groups built (default: the default group's). It bounds every
    collective on them, including the waits torch (FSDP2) does itself, and on NCCL it arms the
    watchdog that aborts a hung collective.
    ``two_level``: see ``plan_groups``.
    """
    if dist.get_world_size() != world.global_size:
        raise ValueError(
            f"world size {dist.get_world_size()} != num_nodes x gpus_per_node x tensor_parallel = "
            f"{world.num_nodes} x {world.gpus_per_node} x {world.tensor_parallel}"
        )
    me = dist.get_rank()
    ranks = {kind: group_of(me, groups) for kind, groups in rank_groups(plan, world).items()}
    groups: dict[str, dist.ProcessGroup | None] = dict.fromkeys(ranks)
    for kind, all_groups in plan_groups(plan, world, two_level).items():
        for g in all_groups:
            pg = dist.new_group(g, timeout=timeout, group_desc=kind)
            if me in g:
                got = sorted(dist.get_process_group_ranks(pg))
                if got != g:  # pragma: no cover - guards the layout against new_group changes
                    raise RuntimeError(f"{kind}: process group {got} != planned {g}")
                groups[kind], ranks[kind] = pg, g
    shard_mesh = None
    if groups["param_shard"] is not None:
        shard_mesh = tp_shard_mesh if tp_shard_mesh is not None else DeviceMesh.from_group(
            groups["param_shard"], device_type, mesh_dim_names=("param_shard",))
        got = sorted(int(r) for r in shard_mesh.mesh.flatten().tolist())
        if got != ranks["param_shard"]:
            raise ValueError(f"the data-parallel mesh given for parameter sharding holds ranks {got}, "
                             f"the plan's param_shard group is {ranks['param_shard']}")
    return PlanMesh(plan=plan, world=world, groups=groups, ranks=ranks, shard_mesh=shard_mesh)


def build_data_parallel_group(world: World, timeout: datetime.timedelta | None = None) -> GroupHandle:
    """This rank's data-parallel group under tensor parallelism (the ranks of its TP coordinate,
    groups.py [Note: the data-parallel world of a 2-D mesh]); the initial weights are broadcast on
    it. Collective over the default group (one ``new_group`` per TP coordinate)."""
    T = world.tensor_parallel
    me, mine = dist.get_rank(), None
    for t in range(T):
        g = list(range(t, world.global_size, T))
        pg = dist.new_group(g, timeout=timeout, group_desc="data_parallel")
        if me in g:
            mine = GroupHandle(pg=pg, name=f"data_parallel[{','.join(map(str, g))}]", size=len(g),
                               timeout=timeout.total_seconds() if timeout else DEFAULT_TIMEOUT_S,
                               cross_node=world.num_nodes > 1)
    return mine


def destroy_plan_mesh(pm: PlanMesh) -> None:
    """Destroy the process groups ``build_plan_mesh`` created (never the default group). Every
    rank calls it with its own PlanMesh, after the last collective on those groups completed
    (runtime/replan/switch.py)."""
    for g in {id(g): g for g in pm.groups.values() if g is not None}.values():
        dist.destroy_process_group(g)
