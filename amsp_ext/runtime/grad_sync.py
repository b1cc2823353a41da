"""Gradient path for sg and sos: bucketed async AllReduce launched from post-accumulate-grad
hooks, then select & drop. One mechanism for sp = 1 and sp > 1.

[Note: where the gradient is picked up]
A hook is registered with ``register_post_accumulate_grad_hook`` on every *local* parameter:
the plain parameter when sp = 1 (autograd's AccumulateGrad calls it), the FSDP2 sharded DTensor
when sp > 1 (FSDP2 calls ``_post_accumulate_grad_hooks`` right after it accumulates the
reduce-scatter output into ``.grad``). The hook copies the gradient into its slot of a bucket of
``U = grad_bucket_bytes`` and frees ``.grad``; a bucket whose slots are all filled launches an
async AllReduce. Buckets are laid out statically in backward order (reverse forward order) and
launched strictly in bucket order, so every rank issues the same collectives in the same order
even if hooks fire in a slightly different order. At most two buckets are in flight: launching
a third first completes the oldest (as InternEvo does), bounding the bucket memory (D_tmp).
The last, partial buckets (and slots of parameters that got no gradient, zero-filled) are
flushed by an end-of-backward callback (``queue_callback``), queued by the first hook of the
pass; for sp > 1 FSDP2's own final callback is queued earlier (at its root pre-backward), so
its last reduce-scatters land before our flush.

[Note: three modes of a backward pass]
- boundary (the last micro-batch): AllReduce over ``param_replica`` (T0_os); each rank adds the
  gradients it *kept* from earlier micro-batches into its slot first; after the reduce the
  owner keeps its owned tensors (divided by the data-parallel size) and drops the rest.
- non-boundary with sg > sp: AllReduce over ``grad`` (Tg); the keeper (see ownership.py)
  accumulates the reduced gradient, the others drop it.
- non-boundary with sg == sp: nothing is communicated; ``.grad`` accumulates locally (autograd
  for sp = 1, FSDP2's sharded-grad accumulation for sp > 1) and the boundary hook sees the sum.
The sum is exact: every micro-batch's gradient of every rank enters the final replica
AllReduce exactly once (directly, or through exactly one keeper per gradient group).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.layout import LocalTensor

__all__ = ["GradSync"]

MAX_IN_FLIGHT = 2


@dataclass(kw_only=True)
class _Bucket:
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor index, offset, numel)
    numel: int = 0


def _plan_buckets(tensors: Sequence[LocalTensor], bucket_numel: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    cur = _Bucket()
    for t in reversed(tensors):  # backward order
        if cur.slots and cur.numel + t.numel > bucket_numel:
            buckets.append(cur)
            cur = _Bucket()
        cur.slots.append((t.index, cur.numel, t.numel))
        cur.numel += t.numel
    if cur.slots:
        buckets.append(cur)
    return buckets


class GradSync:
    def __init__(self, tensors: Sequence[LocalTensor], *, rank: int, dtype: torch.dtype,
                 device: torch.device, bucket_bytes: int, dp_size: int,
                 replica: tuple[dist.ProcessGroup, str, int], grad: tuple[dist.ProcessGroup, str, int],
                 overlap: bool, timeout: float) -> None:
        self.tensors = list(tensors)
        self.rank, self.dtype, self.device = rank, dtype, device
        self.dp_size = dp_size
        self.replica_group, self.replica_name, self.replica_size = replica
        self.grad_group, self.grad_name, self.grad_size = grad
        self.overlap, self.timeout = overlap, timeout
        elem = torch.empty((), dtype=dtype).element_size()
        self.buckets = _plan_buckets(self.tensors, max(1, bucket_bytes // elem))
        self.slot_of = {idx: (b, off, n) for b, bk in enumerate(self.buckets) for idx, off, n in bk.slots}
        # fp16 sums can overflow: divide each contribution before reducing; else divide once after
        self.predivide = dtype == torch.float16
        self.is_boundary = True  # set by the engine (no_sync / set_gradient_accumulation_boundary)
        self.owned: dict[int, torch.Tensor] = {}  # boundary result: owned tensors' averaged grads
        self.kept: dict[int, torch.Tensor] = {}  # Tg result: kept grads, accumulated
        self._reset_pass()
        self._handles = []
        self.peak_grad_bytes = 0

    # -- hooks ---------------------------------------------------------------------------------
    def install(self) -> None:
        for t in self.tensors:
            self._handles.append(t.param.register_post_accumulate_grad_hook(self._make_hook(t.index)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index)
        return hook

    def _reset_pass(self) -> None:
        self.mode: str | None = None
        self.buffers: dict[int, torch.Tensor] = {}
        self.filled: dict[int, set[int]] = collections.defaultdict(set)
        self.ready = [False] * len(self.buckets)
        self.next_launch = 0
        self.in_flight: collections.deque = collections.deque()

    def _begin_pass(self) -> None:
        if self.is_boundary:
            self.mode = "replica"
        elif self.grad_size > 1:
            self.mode = "grad"
        else:
            self.mode = "local"
        torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _on_grad(self, index: int) -> None:
        if self.mode is None:
            self._begin_pass()
        if self.mode == "local":
            return
        t = self.tensors[index]
        with record_function(f"amsp::grad_hook::{'param_replica' if self.mode == 'replica' else 'grad'}"):
            b, off, n = self.slot_of[index]
            if index in self.filled[b]:
                raise RuntimeError(f"amsp: parameter {t.name} received two gradients in one backward pass")
            grad = t.local_grad()
            view = self._buffer(b)[off : off + n]
            with torch.no_grad():
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
                    if self.predivide:
                        view.div_(self.dp_size)
                if self.mode == "replica" and index in self.kept:
                    view.add_(self.kept.pop(index).reshape(-1))
            t.param.grad = None  # its content lives in the bucket now
            self.filled[b].add(index)
            if len(self.filled[b]) == len(self.buckets[b].slots):
                self.ready[b] = True
                self._launch_ready()

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self.buffers.get(b)
        if buf is None:
            buf = torch.empty(self.buckets[b].numel, dtype=self.dtype, device=self.device)
            self.buffers[b] = buf
        return buf

    # -- collectives ---------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch]:
            b = self.next_launch
            self.next_launch += 1
            while len(self.in_flight) >= MAX_IN_FLIGHT:
                self._complete(*self.in_flight.popleft())
            group, name, size = ((self.replica_group, self.replica_name, self.replica_size)
                                 if self.mode == "replica" else
                                 (self.grad_group, self.grad_name, self.grad_size))
            pending = None
            if size > 1:
                pending = C.all_reduce(self.buffers[b], group, name=name, async_op=True)
            if self.overlap:
                self.in_flight.append((b, pending))
            else:
                self._complete(b, pending)

    def _complete(self, b: int, pending) -> None:
        C.wait(pending, timeout=self.timeout)
        buf = self.buffers.pop(b)
        with record_function("amsp::select_and_drop"), torch.no_grad():
            for idx, off, n in self.buckets[b].slots:
                t = self.tensors[idx]
                view = buf[off : off + n].view(t.local_shape)
                if self.mode == "replica":
                    if t.owner_rank == self.rank:
                        self.owned[idx] = view.clone() if self.predivide else view / self.dp_size
                elif t.keeper_rank == self.rank:
                    prev = self.kept.get(idx)
                    self.kept[idx] = view.clone() if prev is None else prev.add_(view)
        # ``buf`` is dropped here: the non-owned gradients are released

    def _flush(self) -> None:
        """End of backward: launch what is left (zero-filling missing slots), wait for all."""
        if self.mode == "local":
            self._end_pass()
            return
        with record_function("amsp::flush_buckets"):
            for b, bk in enumerate(self.buckets):
                if self.ready[b]:
                    continue
                missing = [(idx, off, n) for idx, off, n in bk.slots if idx not in self.filled[b]]
                buf = self._buffer(b)
                for idx, off, n in missing:
                    buf[off : off + n].zero_()
                    if self.mode == "replica" and idx in self.kept:
                        buf[off : off + n].add_(self.kept.pop(idx).reshape(-1))
                self.ready[b] = True
            self._launch_ready()
            while self.in_flight:
                self._complete(*self.in_flight.popleft())
        self._end_pass()

    def _end_pass(self) -> None:
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes())
        self._reset_pass()

    # -- state -----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.owned.clear()
        self.kept.clear()
        for t in self.tensors:
            t.param.grad = None

    def grad_bytes(self) -> int:
        """Gradient bytes held now: owned + kept + not-yet-reduced local ``.grad`` (no buckets)."""
        n = sum(g.numel() * g.element_size() for g in self.owned.values())
        n += sum(g.numel() * g.element_size() for g in self.kept.values())
        for t in self.tensors:
            g = t.local_grad()
            if g is not None:
                n += g.numel() * g.element_size()
        return n
