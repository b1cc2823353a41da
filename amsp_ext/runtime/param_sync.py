"""After the optimizer step: async Broadcast of every updated local tensor inside its
``optim_bcast`` group, in forward order, and forward pre-hooks that wait only for their unit's.

[Note: broadcast items: coalesced runs, issued in forward order]
T1_os counts one broadcast per owner of the bytes it owns; one broadcast per tensor would pay a
collective's latency for every norm weight. So consecutive tensors (in forward order) that have
the same owner and are each at most half a bucket (U/2, U = the gradient bucket size) are packed
into one flat buffer of at most U/2 bytes and broadcast as one item; a larger tensor, or a run of
one, is broadcast in place. Contiguous runs are what ``ownership="blocks"`` produces; under
``greedy`` the owners alternate and fewer tensors coalesce. Items are issued strictly in forward
order (a group runs its collectives in issue order, so an item issued out of order would hold
back the first units' waits), and the packed buffers in flight never exceed U bytes, the
"broadcast_staging" that the planner's memory model charges: when the next item would exceed
it, issuing pauses and resumes from the forward pre-hooks as earlier items complete. In-place
items need no staging. Every rank of the group derives the same items from the same layout, so
the issue order agrees across ranks.

[Note: broadcast waits and FSDP2 prefetch]
A unit's broadcasts must be complete before anything reads its parameters. For sp = 1 that is
the unit's own forward. For sp > 1 it is FSDP2's all-gather of the unit, which is issued either
by the unit's own pre-forward or, earlier, as a prefetch from the previous unit's pre-forward.
So the pre-hook of unit i waits for the items holding tensors of unit i *and* of the unit it
prefetches, and it is registered with ``prepend=True`` after ``fully_shard`` so it runs before
FSDP2's pre-forward hook issues those gathers. With ``overlap.broadcast`` off, all broadcasts are
waited for right after the step (the paper's Table V ablation).

[Note: GPU streams (not exercised on this project's CPU machines)]
On NCCL, waiting makes the *current* stream wait for the broadcast. FSDP2's all-gather
copy-in stream synchronizes with the current stream only at the root's pre-forward, which
runs before these waits, so after waiting we make FSDP2's all-gather streams wait on the
current stream again (``after_wait``, set by the engine when sp > 1 on an accelerator);
otherwise a gather could read a shard before its broadcast landed. The unpacking copies of a
coalesced item run on the current stream after that wait, so they are ordered too.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.layout import LocalTensor
from amsp_ext.runtime.units import Unit

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
    items: list[BroadcastItem] = []
    run: list[LocalTensor] = []

    def nbytes(t: LocalTensor) -> int:
        return t.numel * t.local().element_size()

    def close() -> None:
        if run:
            items.append(BroadcastItem(tensors=list(run), owner_rank=run[0].owner_rank,
                                       nbytes=sum(nbytes(t) for t in run)))
            run.clear()

    for t in tensors:
        if t.numel == 0:
            continue
        b = nbytes(t)
        if b > cap:
            close()
            items.append(BroadcastItem(tensors=[t], owner_rank=t.owner_rank, nbytes=b))
            continue
        if run and (run[0].owner_rank != t.owner_rank or run[0].local().dtype != t.local().dtype
                    or sum(nbytes(x) for x in run) + b > cap):
            close()
        run.append(t)
    close()
    return items


class ParamSync:
    def __init__(self, tensors: Sequence[LocalTensor], units: Sequence[Unit], *,
                 group: dist.ProcessGroup, name: str, size: int, rank: int,
                 prefetch: dict[int, int], overlap: bool, timeout: float,
                 bucket_bytes: int) -> None:
        self.tensors, self.units = list(tensors), list(units)
        self.group, self.name, self.size, self.rank = group, name, size, rank
        self.prefetch, self.overlap, self.timeout = prefetch, overlap, timeout
        self.staging_limit = bucket_bytes
        self.items = broadcast_items(self.tensors, bucket_bytes) if size > 1 else []
        self._last_item: dict[int, int] = {}  # unit -> index of the last item holding its tensors
        self._items_of: dict[int, list[int]] = collections.defaultdict(list)
        for k, it in enumerate(self.items):
            for u in it.units:
                self._last_item[u] = k
                self._items_of[u].append(k)
        self._next = len(self.items)  # next item to issue; == len(items): nothing to issue
        self._inflight: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._staging = 0  # packed bytes in flight
        self.peak_staging = 0  # most packed bytes ever in flight (tests, memory accounting)
        self.num_paused = 0  # times issuing waited for staging room (tests)
        self._handles = []
        self.log: list[tuple[str, int]] | None = None  # ("issue"/"wait", unit) when enabled
        self.after_wait: Callable[[], None] | None = None
        self.wait_seconds = 0.0  # time spent blocked in broadcast waits (benchmarks)

    @property
    def busy(self) -> bool:
        """Broadcasts of the last step are still to be issued or waited for."""
        return self._next < len(self.items) or bool(self._inflight)

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
        def hook(module, args):
            if self.busy:
                with record_function("amsp::pre_forward_wait::optim_bcast"):
                    self.wait_unit(unit)
                    nxt = self.prefetch.get(unit)
                    if nxt is not None:
                        self.wait_unit(nxt)
                    if self.after_wait is not None:
                        self.after_wait()
        return hook

    # -- issuing -----------------------------------------------------------------------------
    def broadcast_all(self) -> None:
        """Start this step's broadcasts, in forward order (call after the owners' step)."""
        if self.size == 1:
            return
        self.wait_all()  # a previous round still open (e.g. two steps without a forward)
        self._next = 0
        with record_function("amsp::broadcast_params::optim_bcast"), torch.no_grad():
            self._issue_until(len(self.items) - 1, block=False)
        if not self.overlap:
            self.wait_all()

    def _issue_until(self, last: int, *, block: bool) -> None:
        """Issue items up to index ``last`` while staging allows; with ``block``, complete the
        oldest packed items in flight to make room (a pre-hook that needs item ``last``)."""
        while self._next <= last:
            it = self.items[self._next]
            if it.packed and self._staging and self._staging + it.nbytes > self.staging_limit:
                self.num_paused += 1
                if not block:
                    return
                oldest = next(k for k, (_, buf) in self._inflight.items() if buf is not None)
                self._complete(oldest)
                continue
            self._issue(self._next)
            self._next += 1

    def _issue(self, k: int) -> None:
        it = self.items[k]
        with torch.no_grad():
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
            p = C.broadcast(target, it.owner_rank, self.group, name=self.name, async_op=True)
        self._inflight[k] = (p, buf)
        if self.log is not None:
            self.log.append(("issue", it.units[0]))

    # -- waiting -----------------------------------------------------------------------------
    def _complete(self, k: int) -> None:
        p, buf = self._inflight.pop(k)
        t0 = time.perf_counter()
        C.wait(p, timeout=self.timeout)
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

    def wait_unit(self, unit: int) -> None:
        last = self._last_item.get(unit)
        if last is None or not self.busy:
            return
        self._issue_until(last, block=True)
        waited = False
        for k in self._items_of[unit]:
            if k in self._inflight:
                self._complete(k)
                waited = True
        if waited and self.log is not None:
            self.log.append(("wait", unit))

    def wait_all(self) -> None:
        if not self.items:
            return
        self._issue_until(len(self.items) - 1, block=True)
        for k in list(self._inflight):
            self._complete(k)
