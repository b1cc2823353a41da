"""Build the plan's process groups once, with torch's DeviceMesh (the torch half of the
topology: the rank lists themselves are pure Python, in amsp_ext.topology.groups).

The eight-axis mesh of :mod:`amsp_ext.topology.groups` becomes one ``DeviceMesh``; each group
kind is a flattened sub-mesh over its axes. We cross-check every group against the pure-Python
rank lists, so the tested layout is the one that runs.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from amsp_ext.planner.plan import Plan
from amsp_ext.topology.groups import (ALL_REDUCE_KINDS, GROUP_AXES, MESH_AXES, World, axis_sizes,
                                      groups_over, level_axes, mesh_ranks, rank_groups)

__all__ = ["GroupHandle", "PlanMesh", "build_plan_mesh", "destroy_plan_mesh"]


@dataclass(frozen=True, kw_only=True)
class GroupHandle:
    """One process group as the engine hands it around: the group (None: the default world
    group), the label traces and timeout errors name it by, its size, how long a wait on it may
    take, and whether it spans nodes (its collectives cross the slow links). ``levels``: the
    group's (inside this node, across nodes) halves when its all-reduce runs on two levels
    (groups.py [Note: the two levels of an all-reduce group]); None: one flat collective."""

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
    device_mesh: DeviceMesh
    submeshes: dict[str, DeviceMesh]  # kind -> 1-D mesh
    groups: dict[str, dist.ProcessGroup]  # kind -> this rank's group
    ranks: dict[str, list[int]]  # kind -> this rank's group, as global ranks

    def group(self, kind: str) -> dist.ProcessGroup:
        return self.groups[kind]

    def size(self, kind: str) -> int:
        return len(self.ranks[kind])

    def name(self, kind: str) -> str:
        """Label used in traces and timeout messages, e.g. ``param_replica[0,2]``."""
        return f"{kind}[{','.join(map(str, self.ranks[kind]))}]"

    def handle(self, kind: str, *, timeout: float) -> GroupHandle:
        """This rank's group of ``kind`` as one object, with its two levels when they were built."""
        nodes = {r // self.world.gpus_per_node for r in self.ranks[kind]}
        levels = None
        if f"{kind}_local" in self.groups:
            levels = (self.handle(f"{kind}_local", timeout=timeout),
                      self.handle(f"{kind}_node", timeout=timeout))
        return GroupHandle(pg=self.groups[kind], name=self.name(kind), size=self.size(kind),
                           timeout=timeout, cross_node=len(nodes) > 1, levels=levels)


def _compat():
    """runtime/_torch_compat, imported when a mesh is built: importing it at the top would run
    amsp_ext/runtime/__init__.py, which imports the engine, which imports this module."""
    from amsp_ext.runtime import _torch_compat

    return _torch_compat


def _backend_override(timeout: datetime.timedelta | None):
    """Process-group options carrying ``timeout`` for the default backend (None: defaults).

    The group timeout bounds every collective on the group, including the waits that
    torch (FSDP2) does itself, and on NCCL it arms the watchdog that aborts a hung collective.
    """
    return None if timeout is None else _compat().backend_options(timeout)


def build_plan_mesh(plan: Plan, world: World, device_type: str = "cpu",
                    timeout: datetime.timedelta | None = None, two_level: bool = False) -> PlanMesh:
    """Collective over the default group: every rank must call it with the same plan.

    ``timeout``: the timeout of the per-kind process groups (default: the default group's).
    ``two_level``: also build the two levels (kinds ``<kind>_local`` and ``<kind>_node``) of each
    group of ALL_REDUCE_KINDS that has several ranks on each of several nodes.
    """
    if dist.get_world_size() != world.size:
        raise ValueError(
            f"world size {dist.get_world_size()} != num_nodes x gpus_per_node = "
            f"{world.num_nodes} x {world.gpus_per_node}"
        )
    sizes = axis_sizes(plan, world)
    layout = torch.empty([sizes[a] for a in MESH_AXES], dtype=torch.int)
    for coord, rank in mesh_ranks(plan, world).items():
        layout[coord] = rank
    mesh = DeviceMesh(device_type, layout, mesh_dim_names=MESH_AXES)
    expected = rank_groups(plan, world)
    kind_axes = dict(GROUP_AXES)
    if two_level:
        coords = mesh_ranks(plan, world)
        for kind in ALL_REDUCE_KINDS:
            local, across = level_axes(kind)
            if math.prod(sizes[a] for a in local) > 1 and math.prod(sizes[a] for a in across) > 1:
                for suffix, axes in (("local", local), ("node", across)):
                    kind_axes[f"{kind}_{suffix}"] = axes
                    expected[f"{kind}_{suffix}"] = groups_over(coords, axes)
    me = dist.get_rank()
    submeshes: dict[str, DeviceMesh] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for kind, axes in kind_axes.items():
        sub = (_compat().flatten_mesh(mesh[axes], kind, backend_override=_backend_override(timeout))
               if len(axes) > 1 else mesh[axes[0]])
        pg = sub.get_group()
        got = sorted(dist.get_process_group_ranks(pg))
        want = next(g for g in expected[kind] if me in g)
        if got != want:  # pragma: no cover - guards the layout against DeviceMesh changes
            raise RuntimeError(f"{kind}: DeviceMesh group {got} != planned {want}")
        submeshes[kind], groups[kind], ranks[kind] = sub, pg, want
    return PlanMesh(plan=plan, world=world, device_mesh=mesh, submeshes=submeshes,
                    groups=groups, ranks=ranks)


def destroy_plan_mesh(pm: PlanMesh) -> None:
    """Destroy the process groups ``build_plan_mesh`` created (every axis of the 8-axis mesh and
    every flattened kind; never the default group). Every rank calls it with its own PlanMesh,
    after the last collective on those groups completed (runtime/replan/switch.py)."""
    groups = {id(g): g for g in pm.device_mesh.get_all_groups()}
    groups.update({id(g): g for g in pm.groups.values()})
    for g in groups.values():
        if g is not dist.group.WORLD:
            dist.destroy_process_group(g)
