"""Reduce-scatters decoupled from the backward on CPU, where FSDP2's run synchronously.

[Note: a reduce-scatter decoupled on CPU]
On an accelerator FSDP2 issues a unit's reduce-scatter on its own stream and the backward goes
on. On CPU (gloo, no streams) it calls our reduce-scatter synchronously and uses the output
right away, so each unit's reduce-scatter blocked the backward thread for its whole length (the
MiCS config's limit runs on the 1 Gbit lab, in comparisons/results/, show every in-node
reduce-scatter exposed).
Between our reduce-scatter and the parameters' post-accumulate-grad hooks FSDP2 does with the
output only this: a post-divide (none: the engine's divide factor is 1), a cast where the
reduce dtype differs from the parameters' (a read), views that become each ``.grad`` (no read),
and ``+=`` into a ``.grad`` already there (a read), then every post-accumulate-grad hook of
the parameter, ours and any the user registered (which may read it). So where no cast, no
accumulation and no hook but grad_sync.py's follows (``defer`` checks the unit's sharded
parameters; anything else keeps the synchronous path), the reduce-scatter is left in flight
and the call returns at once; grad_sync.py's hooks then hold the gradients it covers (``holds``)
and take them once it has completed. Each one is issued as collectives.py's
``reduce_scatter_polled`` ([Note: a reduce-scatter that can be polled (gloo)]), so its end can
be seen without waiting: the hooks look at every gradient, and ``poll_points`` gives each
layer's children a tensor hook at the start of their backward, so a unit's gradients go to
the replica all-reduce within a sub-module's backward of its reduce-scatter's end, not at the
next unit's reduce-scatter call. Unit k's reduce-scatter is still waited for when the next
unit's (k - 1 in backward) is issued if it has not completed by then: at most two are alive
at once, each keeping its input (the unit's unsharded gradients) and output. The
end-of-backward flush waits for the last (``wait_all``). When a bucket goes out depends on
timing; the order does not: grad_sync.py launches buckets strictly in order on every rank.
Every sum-reduce-scatter of a CPU engine on gloo is issued this way, the ones kept synchronous
too, so the collective each rank issues never depends on the per-unit check (only the waiting
does). A non-boundary micro-batch's sum is kept by grad_sync.py's hooks, not in ``.grad``
([Note: three modes of a backward pass] there), so every micro-batch's reduce-scatter passes
the check. Only on gloo: the fake backend of a dry run or a compute-only job keeps FSDP2's
synchronous reduce-scatter, as the planner's memory model describes.
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.sync.units import Unit

__all__ = ["DeferredReduceScatters", "deferral", "poll_points"]


class _Entry:
    __slots__ = ("held", "pending", "storage")

    def __init__(self, pending) -> None:
        self.pending = pending  # collectives.reduce_scatter_polled's: it keeps both tensors
        self.storage = pending.output.untyped_storage().data_ptr()
        self.held: list[int] = []  # the gradient hooks' indices waiting for it (grad_sync.py)


class DeferredReduceScatters:
    """The reduce-scatters in flight past their FSDP2 call, oldest first ([Note: a
    reduce-scatter decoupled on CPU]). An entry counts as done once its handle reports
    completion; ``C.wait`` on it is then free and copies the chunk once (collectives.py)."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self._entries: collections.deque[_Entry] = collections.deque()
        self.poll_modules = poll_points(units)

    @staticmethod
    def polled(group: dist.ProcessGroup, op) -> bool:
        """Whether a reduce-scatter on ``group`` is issued as a polled all-reduce: a gloo
        group summing. Equal on every rank of the group, unlike ``defer``."""
        return op == dist.ReduceOp.SUM and dist.get_backend(group) == "gloo"

    @staticmethod
    def defer(output: torch.Tensor, params) -> bool:
        """Whether FSDP2 leaves ``output`` unread until grad_sync.py's hooks of ``params`` (the
        unit's sharded parameters): no cast, no ``.grad`` to add into, no hook but
        grad_sync.py's one per parameter."""
        return all(p.grad is None and p.dtype == output.dtype
                   and compat.post_accumulate_grad_hook_count(p) <= 1 for p in params)

    def add(self, pending) -> None:
        """``pending`` (a polled reduce-scatter) was just issued: wait for the ones before it,
        keep it in flight."""
        for e in self._entries:
            C.wait(e.pending)
        self._entries.append(_Entry(pending))

    def holds(self, grad: torch.Tensor | None, index: int) -> bool:
        """Hold gradient ``index`` if ``grad`` is the output of a reduce-scatter still queued;
        it is handed back by ``ready``."""
        if grad is None or not self._entries:
            return False
        ptr = grad.untyped_storage().data_ptr()
        for e in self._entries:
            if e.storage == ptr:
                e.held.append(index)
                return True
        return False

    def ready(self) -> list[int]:
        """The held indices whose reduce-scatters have completed, oldest first, stopping at the
        first still running; their entries are dropped."""
        out: list[int] = []
        while self._entries and self._entries[0].pending.is_completed():
            e = self._entries.popleft()
            C.wait(e.pending)  # completed: copies the chunk, blocks on nothing
            out += e.held
        return out

    def wait_all(self) -> list[int]:
        """End of backward: wait for every reduce-scatter still in flight; every held index."""
        for e in self._entries:
            C.wait(e.pending)
        return self.ready()

    def __len__(self) -> int:
        return len(self._entries)


def poll_points(units: Sequence[Unit]) -> list[nn.Module]:
    """The modules whose output's gradient marks a point inside a unit's backward where the
    hooks look for completed reduce-scatters: each layer unit's children that are not units
    themselves (a decoder layer's attention, MLP and norms)."""
    unit_modules = {id(u.module) for u in units}
    return [c for u in units if u.kind == "layer" for c in u.module.children()
            if id(c) not in unit_modules]


def deferral(units: Sequence[Unit], *, sharded: bool, device: torch.device,
             overlap: bool) -> DeferredReduceScatters | None:
    """The queue an engine's reduce-scatters are left in: only where FSDP2 shards (sp > 1) on
    CPU, where it has no streams to decouple them itself, and not under the overlap-off
    ablation, whose reduce-scatters are waited for where they are issued."""
    return DeferredReduceScatters(units) if sharded and device.type == "cpu" and overlap else None
