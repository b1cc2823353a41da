"""Plan -> rank groups, in pure Python (no torch.distributed), so it can be enumerated in tests.

World: ``num_nodes`` nodes x ``gpus_per_node`` ranks; global rank = node * R + local rank, the
order torchrun gives. Each rank belongs to exactly one group of each kind:

============== ===================================== =====================================
kind            size (mesh)                           what runs on it
============== ===================================== =====================================
param_shard     s0_p x s1_p                           AllGather / ReduceScatter (Tp)
param_replica   (R/s0_p) x (N/s1_p)                   gradient AllReduce, last micro-batch (T0_os)
grad            (s0_g/s0_p) x (s1_g/s1_p)             gradient AllReduce, other micro-batches (Tg)
optim           s0_os x s1_os                         sizes grad-norm / overflow reductions
optim_bcast     (s0_os/s0_p) x (s1_os/s1_p)           Broadcast of updated parameters (T1_os)
============== ===================================== =====================================

[Note: placement]
Local ranks are split into contiguous blocks (a shard group of 2 on a node of 8 is {0,1},
{2,3}, ...), since neighbouring GPUs share the fastest links. Nodes are first put in leaf-switch
order (stable sort by leaf id) and then split into contiguous blocks, so a cross-node shard group
of ``s1 <= nodes_per_leaf`` nodes stays under one leaf switch whenever the leaf size allows.
Because every factor divides the next (p | g | os | dp), the blocks nest: a parameter-shard group
sits inside one gradient group, which sits inside one optimizer-state group.

The same layout is a DeviceMesh of nine axes
``(node_outer, node_os, node_g, node_p, local_outer, local_os, local_g, local_p, local_tp)``, where
``node_p`` has size s1_p, ``node_g`` s1_g/s1_p, ``node_os`` s1_os/s1_g and ``node_outer``
N/s1_os (likewise for local ranks); every group kind above is a set of those axes.

[Note: the data-parallel world of a 2-D mesh]
Under tensor parallelism of degree T (``World.tensor_parallel``) a node's R ranks are R/T
data-parallel slots of T consecutive ranks each, the TP group innermost (torchtitan's
``("dp", "tp")`` mesh: global rank = data-parallel index x T + TP index), so a TP group never
leaves its node and its per-layer all-reduces stay on the fastest links. A plan is a plan of the
data-parallel world (``World.gpus_per_node`` = R/T ranks per node, ``World.size`` = the number of
data-parallel ranks); the innermost axis ``local_tp`` (size T) belongs to no group kind, so every
group holds ranks of one TP coordinate only: each TP rank shards and reduces its own TP shard with
the ranks that hold the same shard. T = 1 is the pure data-parallel world of the paper.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from amsp_ext.planner.plan import Plan, PlanError, validate_plan

__all__ = ["ALL_REDUCE_KINDS", "GROUP_KINDS", "MESH_AXES", "GROUP_AXES", "World", "axis_sizes", "group_kind",
           "level_axes", "node_order", "rank_groups"]

GROUP_KINDS = ("param_shard", "param_replica", "grad", "optim", "optim_bcast")
MESH_AXES = (
    "node_outer", "node_os", "node_g", "node_p",
    "local_outer", "local_os", "local_g", "local_p", "local_tp",
)
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "param_shard": ("node_p", "local_p"),
    "param_replica": ("node_outer", "node_os", "node_g", "local_outer", "local_os", "local_g"),
    "grad": ("node_g", "local_g"),
    "optim": ("node_os", "node_g", "node_p", "local_os", "local_g", "local_p"),
    "optim_bcast": ("node_os", "node_g", "local_os", "local_g"),
}

# [Note: the two levels of an all-reduce group]
# An all-reduce group whose ranks sit on several nodes, several on each, can run as three
# collectives (runtime/collectives.py all_reduce_two_level): a reduce-scatter over its ranks on
# this node, an all-reduce of the shard over the ranks at the same place on the other nodes,
# and an all-gather back over this node's ranks. The two levels are the group's local and node
# axes; each rank is in exactly one group of each, and the node level's members share their
# local coordinates, so they hold the same shard after the reduce-scatter.
# the kinds whose collective is the gradient all-reduce (T0_os, Tg); each may run on two levels
ALL_REDUCE_KINDS = ("param_replica", "grad")


def group_kind(name: str) -> str:
    """The group kind a group's label belongs to (``param_replica[0,2]`` and its level
    ``param_replica_local[0,1]`` -> ``param_replica``): a level's collectives are part of its
    group's all-reduce, and traces count them as that (AR)."""
    kind = name.split("[", 1)[0]
    for suffix in ("_local", "_node"):
        if kind.endswith(suffix) and kind[: -len(suffix)] in ALL_REDUCE_KINDS:
            return kind[: -len(suffix)]
    return kind


def is_cross_node_level(name: str) -> bool:
    """Whether a group label is the across-nodes level of a two-level all-reduce
    (``param_replica_node[...]``): it reduces the shard of a gradient its in-node level already
    took whole, so a count of reductions counts that gradient once, at the in-node level."""
    kind = name.split("[", 1)[0].rsplit("::", 1)[-1]
    return kind.endswith("_node") and kind[: -len("_node")] in ALL_REDUCE_KINDS


def level_axes(kind: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes inside a node, axes across nodes) of ``kind``'s group."""
    axes = GROUP_AXES[kind]
    return (tuple(a for a in axes if a.startswith("local_")),
            tuple(a for a in axes if a.startswith("node_")))


@dataclass(frozen=True, kw_only=True)
class World:
    num_nodes: int
    gpus_per_node: int  # data-parallel ranks per node (the node's ranks / tensor_parallel)
    # leaf switch id of each node, in node order; None = all under one leaf
    leaf_of_node: tuple[int, ...] | None = None
    # ranks of one tensor-parallel group, consecutive inside a node ([Note: the data-parallel
    # world of a 2-D mesh]); 1: pure data parallelism
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise PlanError(f"world.num_nodes must be >= 1, got {self.num_nodes}")
        if self.gpus_per_node < 1:
            raise PlanError(f"world.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.tensor_parallel < 1:
            raise PlanError(f"world.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.leaf_of_node is not None and len(self.leaf_of_node) != self.num_nodes:
            raise PlanError(
                f"world.leaf_of_node must list one leaf id per node ({self.num_nodes}), "
                f"got {len(self.leaf_of_node)}"
            )

    @classmethod
    def with_leaves(cls, *, num_nodes: int, gpus_per_node: int, nodes_per_leaf: int | None,
                    tensor_parallel: int = 1) -> "World":
        if nodes_per_leaf is not None and nodes_per_leaf < 1:
            raise PlanError(f"nodes_per_leaf must be >= 1, got {nodes_per_leaf}")
        return cls(
            num_nodes=num_nodes,
            gpus_per_node=gpus_per_node,
            leaf_of_node=(None if nodes_per_leaf is None
                          else tuple(n // nodes_per_leaf for n in range(num_nodes))),
            tensor_parallel=tensor_parallel,
        )

    @property
    def size(self) -> int:
        """Data-parallel ranks (what a plan shards over and gradients are averaged over)."""
        return self.num_nodes * self.gpus_per_node

    @property
    def global_size(self) -> int:
        """Every rank of the job: data-parallel ranks x tensor_parallel."""
        return self.size * self.tensor_parallel

    def node_of(self, rank: int) -> int:
        """The node of a global rank."""
        return rank // (self.gpus_per_node * self.tensor_parallel)

    def leaf_of(self, rank: int) -> int:
        node = self.node_of(rank)
        return 0 if self.leaf_of_node is None else self.leaf_of_node[node]


def node_order(world: World) -> list[int]:
    """Nodes sorted by leaf switch (stable), so contiguous node blocks share a leaf."""
    nodes = list(range(world.num_nodes))
    if world.leaf_of_node is None:
        return nodes
    return sorted(nodes, key=lambda n: world.leaf_of_node[n])


def axis_sizes(plan: Plan, world: World) -> dict[str, int]:
    """Sizes of the eight mesh axes (see the module docstring); validates the plan first."""
    validate_plan(plan, gpus_per_node=world.gpus_per_node, num_nodes=world.num_nodes,
                  structural_only=True)
    R, N = world.gpus_per_node, world.num_nodes
    return {
        "node_outer": N // plan.s1_os,
        "node_os": plan.s1_os // plan.s1_g,
        "node_g": plan.s1_g // plan.s1_p,
        "node_p": plan.s1_p,
        "local_outer": R // plan.s0_os,
        "local_os": plan.s0_os // plan.s0_g,
        "local_g": plan.s0_g // plan.s0_p,
        "local_p": plan.s0_p,
        "local_tp": world.tensor_parallel,
    }


def mesh_ranks(plan: Plan, world: World) -> dict[tuple[int, ...], int]:
    """Coordinate (in MESH_AXES order) -> global rank."""
    sizes = axis_sizes(plan, world)
    order = node_order(world)
    R, T = world.gpus_per_node, world.tensor_parallel
    out: dict[tuple[int, ...], int] = {}
    for coord in itertools.product(*(range(sizes[a]) for a in MESH_AXES)):
        no, nos, ng, np_, lo, los, lg, lp, tp = coord
        node_slot = ((no * sizes["node_os"] + nos) * sizes["node_g"] + ng) * sizes["node_p"] + np_
        local = ((lo * sizes["local_os"] + los) * sizes["local_g"] + lg) * sizes["local_p"] + lp
        out[coord] = (order[node_slot] * R + local) * T + tp
    return out


def rank_groups(plan: Plan, world: World) -> dict[str, list[list[int]]]:
    """For each group kind, the list of groups (each a sorted list of global ranks).

    Groups are listed in a deterministic order, which every rank must follow when it creates
    process groups.
    """
    coords = mesh_ranks(plan, world)
    return {kind: groups_over(coords, GROUP_AXES[kind]) for kind in GROUP_KINDS}


def groups_over(coords: dict[tuple[int, ...], int], axes: Sequence[str]) -> list[list[int]]:
    """The groups spanned by ``axes`` of the mesh ``coords`` (from ``mesh_ranks``): ranks that
    differ only along those axes, each group sorted, in a deterministic order."""
    inside = {MESH_AXES.index(a) for a in axes}
    buckets: dict[tuple[int, ...], list[int]] = {}
    for coord, rank in coords.items():
        key = tuple(c for i, c in enumerate(coord) if i not in inside)
        buckets.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in buckets.values())


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> list[int]:
    for g in groups:
        if rank in g:
            return list(g)
    raise KeyError(f"rank {rank} is in none of the groups")


__all__.append("group_of")
__all__.append("groups_over")
__all__.append("mesh_ranks")
