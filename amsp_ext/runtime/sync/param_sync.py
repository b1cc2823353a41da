"""After the optimizer step: async Broadcast of every updated local tensor inside its
``optim_bcast`` group, in forward order, and forward pre-hooks that wait only for their unit's.

[Note: broadcast items: small tensors packed per owner]
T1_os counts one broadcast per owner of the bytes it owns; one broadcast per tensor would pay a
collective's latency for every norm weight. So the smallest tensors, up to a budget of U bytes in
all (U = the gradient bucket size: the "broadcast_staging" the planner's memory model charges),
are packed per owner, in forward order, into flat buffers of at most U/2 bytes; every other
tensor is broadcast in place, with no staging. An item is issued at the position of its first
tensor, all of them in forward order right after the step, so no rank ever has to issue a
broadcast later than another (a rank that waits alone, e.g. rank 0 taking a state_dict, finds
every broadcast already issued everywhere). Every rank of the group derives the same items from
the same layout, so the issue order agrees across ranks. Under ``ownership="blocks"`` a unit's
tensors have one owner, so its forward pre-hook waits on one rank's items.

[Note: broadcast waits and FSDP2 prefetch]
A unit's broadcasts must be complete before anything reads its parameters. For sp = 1 that is
the unit's own forward. For sp > 1 it is FSDP2's all-gather of the unit, which is issued either
by the unit's own pre-forward or, earlier, as a prefetch from the previous unit's pre-forward.
So the pre-hook of unit i waits for the items holding tensors of unit i *and* of the unit it
prefetches (and, first, those of the root unit, which the model may read anywhere in
its forward: outside_reads.py [Note: parameters read outside their module's forward]), and it is registered with ``prepend=True`` after ``fully_shard`` so it runs before
FSDP2's pre-forward hook issues those gathers. With ``overlap.broadcast`` off, all broadcasts are
waited for right after the step (the paper's Table V ablation).

[Note: GPU streams (not exercised on this project's CPU machines)]
On NCCL, waiting makes the *current* stream wait for the broadcast. FSDP2's all-gather
copy-in stream synchronizes with the current stream only at the root's pre-forward, which
runs before these waits, so after waiting we make FSDP2's all-gather streams wait on the
current stream again (``after_wait``, given by the engine when sp > 1 on an accelerator);
otherwise a gather could read a shard before its broadcast landed. The unpacking copies of a
coalesced item run on the current stream after that wait, so they are ordered too.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from amsp_ext.planner.buckets import packable
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.sync.units import Unit
from amsp_ext.topology.mesh import GroupHandle

__all__ = ["BroadcastItem", "ParamSync", "broadcast_items"]


@dataclass(kw_only=True, eq=False)
class BroadcastItem:
    tensors: list[LocalTensor]  # in forward order, one owner
    owner_rank: int
    nbytes: int

    @property
    def packed(self) -> bool:
        return len(self.tensors) > 1

    @property
    def units(self) -> list[int]:
        return sorted({t.unit for t in self.tensors})


def broadcast_items(tensors: Sequence[LocalTensor], bucket_bytes: int) -> list[BroadcastItem]:
    """Group ``tensors`` (forward order) into broadcast items; see [Note: broadcast items]."""
    cap = bucket_bytes // 2

    def nbytes(t: LocalTensor) -> int:
        return t.numel * t.local().element_size()

    live = [t for t in tensors if t.numel > 0]
    packed = packable([nbytes(t) for t in live], bucket_bytes)  # planner/buckets.py
    items: list[BroadcastItem] = []
    open_pack: dict[tuple, BroadcastItem] = {}  # (owner, dtype) -> pack being filled
    for pos, t in enumerate(live):
        b = nbytes(t)
        if pos not in packed:
            items.append(BroadcastItem(tensors=[t], owner_rank=t.owner_rank, nbytes=b))
            continue
        key = (t.owner_rank, t.local().dtype)
        it = open_pack.get(key)
        if it is None or it.nbytes + b > cap:
            it = open_pack[key] = BroadcastItem(tensors=[], owner_rank=t.owner_rank, nbytes=0)
            items.append(it)  # at the position of its first tensor
        it.tensors.append(t)
        it.nbytes += b
    return items


class ParamSync:
    def __init__(self, tensors: Sequence[LocalTensor], units: Sequence[Unit], *,
                 comm: C.CollectiveContext, group: GroupHandle, rank: int, prefetch: dict[int, int],
                 overlap: bool, bucket_bytes: int, after_wait: Callable[[], None] | None = None,
                 params_changed: Callable[[], None] | None = None) -> None:
        self.tensors, self.units = list(tensors), list(units)
        self.comm = comm
        self.group, self.rank = group, rank
        self.size, self.timeout = group.size, group.timeout
        self.prefetch, self.overlap = prefetch, overlap
        self.staging_limit = bucket_bytes
        self.items = broadcast_items(self.tensors, bucket_bytes) if group.size > 1 else []
        self._items_of: dict[int, list[int]] = collections.defaultdict(list)  # unit -> items
        for k, it in enumerate(self.items):
            for u in it.units:
                self._items_of[u].append(k)
        # waited for by the first pre-hook of a forward, whichever unit's it is
        # (outside_reads.py [Note: parameters read outside their module's forward])
        self._outer_items = sorted({k for i, u in enumerate(self.units) if u.kind == "root"
                                    for k in self._items_of.get(i, ())})
        self._inflight: dict[int, tuple] = {}  # item -> (pending, packed buffer or None)
        self._staging = 0  # packed bytes in flight
        self.peak_staging = 0  # most packed bytes ever in flight (tests, memory accounting)
        self._handles = []
        self.log: list[tuple[str, int]] | None = None  # ("issue"/"wait", unit) when enabled
        self.after_wait = after_wait
        # called first by broadcast_all, when the owners have written new parameters: drops a
        # gathered copy of the old ones (outside_reads.py [Note: a gathered root after a step])
        self.params_changed = params_changed
        self.wait_seconds = 0.0  # time spent blocked in broadcast waits (benchmarks)

    @property
    def busy(self) -> bool:
        """Broadcasts of the last step are still to be waited for."""
        return bool(self._inflight)

    def install(self) -> None:
        if self.size == 1:
            return
        for i, u in enumerate(self.units):
            self._handles.append(u.module.register_forward_pre_hook(self._make_hook(i), prepend=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, unit: int):
        # [Note: hooks under torch.compile] a compiled block (``block.compile()``) runs its
        # hooks inside the compiled call; dynamo must not trace this wait (a Work.wait, timers):
        # it runs eagerly before the block's graph, as FSDP2's hooks do (docs/usage.md,
        # "torch.compile per block"; tests/test_compile.py: no graph break).
        @torch.compiler.disable
        def hook(module, args):
            if self._inflight:
                with compat.label("amsp::pre_forward_wait::optim_bcast"):
                    self.wait_unit(unit, first=self._outer_items)
                    nxt = self.prefetch.get(unit)
                    if nxt is not None:
                        self.wait_unit(nxt)
                    if self.after_wait is not None:
                        self.after_wait()
        return hook

    # -- issuing -----------------------------------------------------------------------------
    def broadcast_all(self) -> None:
        """Issue this step's broadcasts, in forward order (call after the owners' step)."""
        if self.params_changed is not None:
            self.params_changed()
        if self.size == 1:
            return
        self.wait_all()  # a previous round still open (e.g. two steps without a forward)
        with compat.label("amsp::broadcast_params::optim_bcast"), torch.no_grad():
            for k in range(len(self.items)):
                self._issue(k)
        if not self.overlap:
            self.wait_all()

    def _issue(self, k: int) -> None:
        it = self.items[k]
        if it.packed:
            if it.owner_rank == self.rank:
                buf = torch.cat([t.local().reshape(-1) for t in it.tensors])
            else:
                first = it.tensors[0].local()
                buf = torch.empty(sum(t.numel for t in it.tensors), dtype=first.dtype,
                                  device=first.device)
            self._staging += it.nbytes
            self.peak_staging = max(self.peak_staging, self._staging)
        else:
            buf = None
        target = buf if buf is not None else it.tensors[0].local()
        # the step's (current) stream: the owners' updated parameters were written there
        p = C.broadcast(self.comm, target, it.owner_rank, self.group.pg, name=self.group.name,
                        stream=None, async_op=True, timeout=self.timeout)
        self._inflight[k] = (p, buf)
        if self.log is not None:
            self.log.append(("issue", it.units[0]))

    # -- waiting -----------------------------------------------------------------------------
    def _complete(self, k: int) -> None:
        p, buf = self._inflight.pop(k)
        t0 = time.perf_counter()
        C.wait(p)  # with the group's timeout, given at issue
        self.wait_seconds += time.perf_counter() - t0
        if buf is None:
            return
        it = self.items[k]
        if it.owner_rank != self.rank:
            with torch.no_grad():
                offset = 0
                for t in it.tensors:
                    dst = t.local()
                    dst.copy_(buf[offset:offset + t.numel].view(dst.shape))
                    offset += t.numel
        self._staging -= it.nbytes

    def wait_unit(self, unit: int, first=()) -> None:
        """Wait for the items of ``unit``, after those of ``first``."""
        waited = self._wait_items(first)
        if self._wait_items(self._items_of.get(unit, ())) or waited:
            if self.log is not None:
                self.log.append(("wait", unit))

    def _wait_items(self, items) -> bool:
        waited = False
        for k in items:
            if k in self._inflight:
                self._complete(k)
                waited = True
        return waited

    def wait_all(self) -> None:
        """Wait for every broadcast in flight. Local: every rank issued them all at the step."""
        for k in sorted(self._inflight):
            self._complete(k)
