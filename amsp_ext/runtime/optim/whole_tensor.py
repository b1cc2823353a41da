"""Whole-tensor optimizers on row-sharded plans: each tensor stepped whole by one owner.

[Note: whole-tensor optimizers on row shards]
With sp > 1 a rank's local tensor is a row shard (FSDP2's torch.chunk rows), and a whole-tensor
optimizer (kinds.py) must see the whole matrix. For one, ownership is assigned by global size
(layout.py ``by_global``), so a tensor's sp row shards are owned by the sp ranks of one
param_shard group (those with the same optim_bcast coordinate) and every rank of that group owns
the same tensors. Among them one rank, the tensor's *whole owner*, keeps the fp32 master of the
whole tensor and the optimizer's states for it; whole owners are spread over the group by the
optimizer's work under a byte cap (ownership.py [Note: owners balanced by the optimizer's
work]: m*n*min(m, n) for a matrix Muon orthogonalises, the element count for Adafactor). A step is then: one all-to-all in the group sends each rank's reduced,
clipped row-shard gradients to their whole owners; the owners step; a second all-to-all sends
each rank its new rows, which it writes into its fp32 rows and its local parameter and then
broadcasts to its optim_bcast group as before (param_sync.py). So every rank of the group sends
and receives (sp - 1)/sp of its owned tensors' bytes twice a step, the same volume as a
reduce-scatter plus an all-gather of them, and no rank ever holds another's states.

Each shard travels padded to its tensor's chunk (ceil(rows / sp) rows), so every split follows
from the global shapes alone and no sizes are exchanged. Invariant: the rows a rank holds are
the rows this module computes for its position; the constructor checks it, tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.optim.ownership import assign_by_cost
from amsp_ext.topology.mesh import GroupHandle

__all__ = ["WholeTensors"]


@dataclass(frozen=True)
class _Entry:
    index: int
    name: str
    global_shape: tuple[int, ...]
    rows: tuple[int, ...]  # rows held at each group position
    chunk: int  # padded rows per position
    row_numel: int
    whole_owner: int  # group position

    @property
    def padded(self) -> int:
        return self.chunk * self.row_numel


def _rows(d0: int, size: int) -> tuple[int, tuple[int, ...]]:
    chunk = -(-d0 // size)
    return chunk, tuple(max(0, min(chunk, d0 - i * chunk)) for i in range(size))


class WholeTensors:
    """The whole owners of this rank's param_shard group, and the two all-to-alls of a step."""

    def __init__(self, tensors: Sequence[LocalTensor], *, rank: int, group: GroupHandle,
                 group_ranks: Sequence[int], comm: C.CollectiveContext,
                 rows: Mapping[int, torch.Tensor], aliased: bool) -> None:
        """``rows``: this rank's fp32 rows of each tensor it owns (the shard masters); ``aliased``:
        they are the local parameters' own storage (fp32 compute). Collective over ``group``:
        gathers the whole fp32 masters to their owners."""
        self.aliased = aliased
        self.comm, self.group = comm, group
        self.size = len(group_ranks)
        self.pos = list(group_ranks).index(rank)
        if group.pg is not None and dist.get_process_group_ranks(group.pg) != list(group_ranks):
            raise RuntimeError(f"{group.name}: group order {dist.get_process_group_ranks(group.pg)} is not "
                               f"the shard order {list(group_ranks)}")
        owned = [t for t in tensors if t.owner_rank == rank]
        where = assign_by_cost([t.work for t in owned], [math.prod(t.global_shape) for t in owned], self.size)
        self.entries: list[_Entry] = []
        for t, j in zip(owned, where):
            if not t.global_shape:
                raise ValueError(f"tensor {t.name!r}: a 0-d parameter under a row-sharded plan")
            chunk, rows_at = _rows(t.global_shape[0], self.size)
            if tuple(t.local_shape) != (rows_at[self.pos], *t.global_shape[1:]):
                raise RuntimeError(f"tensor {t.name!r}: rank {rank} holds {tuple(t.local_shape)} of "
                                   f"{t.global_shape}, not the torch.chunk rows {rows_at[self.pos]}")
            self.entries.append(_Entry(t.index, t.name, tuple(t.global_shape), rows_at, chunk,
                                       math.prod(t.global_shape[1:]), j))
        self.rows = dict(rows)  # tensor index -> this rank's fp32 rows (kept current by scatter)
        self.device = next(iter(self.rows.values())).device if self.rows else torch.device("cpu")
        self.mine = [e for e in self.entries if e.whole_owner == self.pos]
        self.masters: dict[int, torch.nn.Parameter] = {
            i: torch.nn.Parameter(w) for i, w in self.gather(self.rows).items()}
        for e in self.mine:
            self.masters[e.index].amsp_name = e.name

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """The whole masters from the rows (after a checkpoint load wrote the rows): collective."""
        for i, w in self.gather(self.rows).items():
            self.masters[i].copy_(w)

    def _exchange(self, inp: torch.Tensor, in_splits: list[int], out_splits: list[int],
                  what: str) -> torch.Tensor:
        out = torch.empty(sum(out_splits), dtype=torch.float32, device=inp.device)
        with record_function(f"amsp::whole_tensor::{what}"):
            C.all_to_all(self.comm, out, inp, self.group.pg, output_splits=out_splits, input_splits=in_splits,
                         name=self.group.name, stream=None, timeout=self.group.timeout)
        return out

    def gather(self, shards: Mapping[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
        """Row shards (tensor index -> local-shaped tensor, or None: no gradient) in; the whole
        fp32 tensors this rank is whole owner of out (None where its own shard was None: a
        tensor without a gradient has none on any rank)."""
        if not self.entries:  # every rank of the group owns the same (no) tensors
            return {}
        # one flat send buffer, the shards in destination order, each padded to its chunk
        in_splits = [sum(e.padded for e in self.entries if e.whole_owner == j) for j in range(self.size)]
        send = torch.zeros(sum(in_splits), dtype=torch.float32, device=self.device)
        off = 0
        for e in sorted(self.entries, key=lambda e: e.whole_owner):  # stable: forward order within
            g = shards.get(e.index)
            if g is not None:
                send[off: off + g.numel()].copy_(g.reshape(-1))
            off += e.padded
        mine = sum(e.padded for e in self.mine)
        out = self._exchange(send, in_splits, [mine] * self.size, "gather")
        whole: dict[int, list[torch.Tensor]] = {e.index: [] for e in self.mine}
        off = 0
        for i in range(self.size):
            for e in self.mine:
                whole[e.index].append(out[off: off + e.rows[i] * e.row_numel])
                off += e.padded
        return {e.index: (torch.cat(whole[e.index]).view(e.global_shape)
                          if shards.get(e.index) is not None else None) for e in self.mine}

    @torch.no_grad()
    def scatter(self, wholes: Mapping[int, torch.Tensor], tensors: Sequence[LocalTensor]) -> None:
        """The whole owners' tensors (tensor index -> whole fp32) out to every rank's rows: each
        rank writes its rows into its fp32 rows and its local parameter."""
        if not self.entries:
            return
        mine = sum(e.padded for e in self.mine)
        in_splits = [mine] * self.size
        send = torch.zeros(mine * self.size, dtype=torch.float32, device=self.device)
        off = 0
        for i in range(self.size):  # rank i's rows of every tensor this rank is whole owner of
            for e in self.mine:
                part = wholes[e.index].detach().reshape(e.global_shape[0], -1)[i * e.chunk: i * e.chunk + e.rows[i]]
                send[off: off + part.numel()].copy_(part.reshape(-1))
                off += e.padded
        out_splits = [0] * self.size
        for e in self.entries:
            out_splits[e.whole_owner] += e.padded
        out = self._exchange(send, in_splits, out_splits, "scatter")
        off = 0
        for j in range(self.size):
            for e in self.entries:
                if e.whole_owner != j:
                    continue
                n = e.rows[self.pos] * e.row_numel
                rows = self.rows[e.index]
                new = out[off: off + n].view(rows.shape)
                if not self.aliased:
                    rows.copy_(new)
                tensors[e.index].local().copy_(new)  # under fp32 that is ``rows`` too
                off += e.padded
