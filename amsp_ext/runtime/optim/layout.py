"""The local tensors a rank holds, in forward order, with their owner and gradient keeper.

A local tensor is what one rank stores of one parameter: the whole parameter when sp = 1, the
rank's FSDP2 shard (the DTensor's local tensor) when sp > 1. It is the unit of inter-tensor
optimizer-state ownership, of gradient bucketing and of the parameter broadcast. Each carries
the metadata a checkpoint needs (name, global shape, local shape, shard index, owner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime.optim.ownership import assign_by_cost, assign_owners, step_cost
from amsp_ext.runtime.sync.units import Unit, layout_order
from amsp_ext.topology.groups import MESH_AXES, mesh_ranks

__all__ = ["LocalTensor", "build_layout"]


@dataclass(kw_only=True, eq=False)
class LocalTensor:
    index: int  # position in forward order
    name: str  # parameter name in the model
    param: nn.Parameter  # the model's parameter (a DTensor when sp > 1)
    unit: int  # index of its unit
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    shard_index: int  # this rank's position in its param_shard group
    owner_rank: int  # global rank that steps it and broadcasts it
    keeper_rank: int  # global rank of my gradient group that keeps its Tg-reduced gradient
    # how many ranks of my TP group hold this same tensor: 1 for a TP shard, T for a parameter
    # outside the TP plan (tensor_parallel.py [Note: TP shards and replicated parameters])
    tp_replicas: int = 1
    # the optimizer's work on the whole tensor (ownership.py [Note: owners balanced by the
    # optimizer's work]); whole-tensor optimizers only, 0 otherwise
    work: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n

    def local(self) -> torch.Tensor:
        """The tensor this rank stores (re-read each time: FSDP2 may re-pad and swap it)."""
        return compat.dtensor_local(self.param)

    def local_grad(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None:
            return None
        return compat.dtensor_local(g) if isinstance(g, DTensor) else g

    def metadata(self) -> dict:
        return {"name": self.name, "global_shape": list(self.global_shape),
                "local_shape": list(self.local_shape), "shard_index": self.shard_index,
                "owner": self.owner_rank}


def build_layout(units: Sequence[Unit], *, plan, world, rank: int, bcast_ranks: Sequence[int],
                 shard_ranks: Sequence[int], policy: str,
                 tp_sharded: frozenset[str] = frozenset(), by_global: bool = False,
                 costs: Mapping[str, int] | None = None) -> list[LocalTensor]:
    """``tp_sharded``: the names of the parameters split over TP (world.tensor_parallel > 1);
    every other parameter is held whole by the T ranks of a TP group (``tp_replicas``).
    ``by_global``: owners balanced on the parameters' global sizes, so a tensor has the same
    owner index at every shard position (whole_tensor.py [Note: whole-tensor optimizers on row
    shards]); else on the local sizes, which may differ by position when rows do not divide.
    ``costs`` (a whole-tensor optimizer's work per parameter name; a name not in it is costed
    as a matrix by its global shape): the greedy policy balances that work under a byte cap
    (ownership.py [Note: owners balanced by the optimizer's work]); None balances bytes."""
    T = world.tensor_parallel
    entries = []
    # units.py [Note: one root unit]: where the root's tensors go depends on when their
    # gradients arrive, hence on sp
    for ui, name, p in layout_order(list(units), root_reduced_last=plan.sp > 1):
        if not p.requires_grad:  # frozen: no gradient, no optimizer state, never changes
            continue
        local = compat.dtensor_local(p)
        entries.append((ui, name, p, tuple(p.shape), tuple(local.shape)))
    numels = [int(torch.Size(e[3] if by_global else e[4]).numel()) for e in entries]
    work = [0] * len(entries) if costs is None else [costs.get(e[1], step_cost(e[3])) for e in entries]
    if costs is not None and policy == "greedy":
        owners = assign_by_cost(work, numels, len(bcast_ranks))
    else:
        owners = assign_owners(numels, len(bcast_ranks), policy)
    coords = {r: c for c, r in mesh_ranks(plan, world).items()}
    mine = coords[rank]
    grad_axes = [MESH_AXES.index("node_g"), MESH_AXES.index("local_g")]
    by_coord = {c: r for r, c in coords.items()}

    def keeper_of(owner_rank: int) -> int:
        c = list(mine)
        for a in grad_axes:
            c[a] = coords[owner_rank][a]
        return by_coord[tuple(c)]

    shard_index = list(shard_ranks).index(rank)
    out = []
    for i, ((ui, name, p, gshape, lshape), k) in enumerate(zip(entries, owners)):
        owner_rank = bcast_ranks[k]
        out.append(LocalTensor(index=i, name=name, param=p, unit=ui, global_shape=gshape,
                               local_shape=lshape, shard_index=shard_index,
                               owner_rank=owner_rank, keeper_rank=keeper_of(owner_rank),
                               tp_replicas=1 if name in tp_sharded else T, work=work[i]))
    return out
