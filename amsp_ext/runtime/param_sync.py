"""After the optimizer step: async Broadcast of every updated local tensor inside its
``optim_bcast`` group, in forward order, and forward pre-hooks that wait only for their unit's.

[Note: broadcast waits and FSDP2 prefetch]
A unit's broadcasts must be complete before anything reads its parameters. For sp = 1 that is
the unit's own forward. For sp > 1 it is FSDP2's all-gather of the unit, which is issued either
by the unit's own pre-forward or, earlier, as a prefetch from the previous unit's pre-forward.
So the pre-hook of unit i waits for the broadcasts of unit i *and* of the unit it prefetches,
and it is registered with ``prepend=True`` after ``fully_shard`` so it runs before FSDP2's
pre-forward hook issues those gathers. With ``overlap.broadcast`` off, all broadcasts are
waited for right after the step (the paper's Table V ablation).

[Note: GPU streams (not exercised on this project's CPU machines)]
On NCCL, waiting makes the *current* stream wait for the broadcast. FSDP2's all-gather
copy-in stream synchronizes with the current stream only at the root's pre-forward, which
runs before these waits, so after waiting we make FSDP2's all-gather streams wait on the
current stream again (``after_wait``, set by the engine when sp > 1 on an accelerator);
otherwise a gather could read a shard before its broadcast landed.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.layout import LocalTensor
from amsp_ext.runtime.units import Unit

__all__ = ["ParamSync"]


class ParamSync:
    def __init__(self, tensors: Sequence[LocalTensor], units: Sequence[Unit], *,
                 group: dist.ProcessGroup, name: str, size: int, rank: int,
                 prefetch: dict[int, int], overlap: bool, timeout: float) -> None:
        self.tensors, self.units = list(tensors), list(units)
        self.group, self.name, self.size, self.rank = group, name, size, rank
        self.prefetch, self.overlap, self.timeout = prefetch, overlap, timeout
        self.pending: dict[int, list] = collections.defaultdict(list)  # unit -> work handles
        self._handles = []
        self.log: list[tuple[str, int]] | None = None  # ("issue"/"wait", unit) when enabled
        self.after_wait: Callable[[], None] | None = None
        self.wait_seconds = 0.0  # time spent blocked in broadcast waits (benchmarks)

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
            if self.pending:
                with record_function("amsp::pre_forward_wait::optim_bcast"):
                    self.wait_unit(unit)
                    nxt = self.prefetch.get(unit)
                    if nxt is not None:
                        self.wait_unit(nxt)
                    if self.after_wait is not None:
                        self.after_wait()
        return hook

    def broadcast_all(self) -> None:
        """Issue every broadcast, in forward order (call after the owners' step)."""
        if self.size == 1:
            return
        with record_function("amsp::broadcast_params::optim_bcast"), torch.no_grad():
            for t in self.tensors:
                if t.numel == 0:
                    continue
                p = C.broadcast(t.local(), t.owner_rank, self.group, name=self.name, async_op=True)
                self.pending[t.unit].append(p)
                if self.log is not None:
                    self.log.append(("issue", t.unit))
        if not self.overlap:
            self.wait_all()

    def wait_unit(self, unit: int) -> None:
        works = self.pending.pop(unit, None)
        if not works:
            return
        t0 = time.perf_counter()
        for p in works:
            C.wait(p, timeout=self.timeout)
        self.wait_seconds += time.perf_counter() - t0
        if self.log is not None:
            self.log.append(("wait", unit))

    def wait_all(self) -> None:
        for unit in sorted(self.pending):
            self.wait_unit(unit)
