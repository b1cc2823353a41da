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
and copy them only once it has been waited for. Unit k's reduce-scatter is waited for when the
next unit's (k - 1 in backward) has been issued: it runs under unit k - 1's backward compute,
and at most two are alive at once, each keeping its input (the unit's unsharded gradients) and
output. The end-of-backward flush waits for the last (``wait_all``). They are waited for in
issue order, not polled: gloo's reduce-scatter Work never reports ``is_completed()`` before it
is waited for (collectives.py). Only on gloo: the fake backend of a dry run or a compute-only
job keeps the synchronous path the planner's memory model describes.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C

__all__ = ["DeferredReduceScatters"]


class _Entry:
    __slots__ = ("pending", "keep", "storage", "waited", "held")

    def __init__(self, pending, output: torch.Tensor, input: torch.Tensor) -> None:
        self.pending, self.keep = pending, (output, input)
        self.storage = output.untyped_storage().data_ptr()
        self.waited = False
        self.held: list[int] = []  # the gradient hooks' indices waiting for it (grad_sync.py)


class DeferredReduceScatters:
    """The reduce-scatters in flight past their FSDP2 call, oldest first ([Note: a
    reduce-scatter decoupled on CPU])."""

    def __init__(self) -> None:
        self._entries: collections.deque[_Entry] = collections.deque()

    @staticmethod
    def defer(output: torch.Tensor, group: dist.ProcessGroup, params) -> bool:
        """Whether FSDP2 leaves ``output`` unread until grad_sync.py's hooks of ``params`` (the
        unit's sharded parameters): a gloo group, no cast, no ``.grad`` to add into, no hook
        but grad_sync.py's one per parameter."""
        if output.device.type != "cpu" or dist.get_backend(group) != "gloo":
            return False
        return all(p.grad is None and p.dtype == output.dtype
                   and compat.post_accumulate_grad_hook_count(p) <= 1 for p in params)

    def add(self, pending, output: torch.Tensor, input: torch.Tensor) -> None:
        """``pending`` was just issued: wait for the ones before it (they ran under the
        compute since their own call), keep it in flight."""
        for e in self._entries:
            if not e.waited:
                C.wait(e.pending)
                e.waited = True
        self._entries.append(_Entry(pending, output, input))

    def holds(self, grad: torch.Tensor | None, index: int) -> bool:
        """Hold gradient ``index`` if ``grad`` is the output of a reduce-scatter not yet waited
        for; it is handed back by ``ready``."""
        if grad is None or not self._entries:
            return False
        ptr = grad.untyped_storage().data_ptr()
        for e in self._entries:
            if e.storage == ptr and not e.waited:
                e.held.append(index)
                return True
        return False

    def ready(self) -> list[int]:
        """The held indices whose reduce-scatters have been waited for, in issue order; their
        entries are dropped."""
        out: list[int] = []
        while self._entries and self._entries[0].waited:
            out += self._entries.popleft().held
        return out

    def wait_all(self) -> list[int]:
        """End of backward: wait for every reduce-scatter still in flight; every held index."""
        for e in self._entries:
            if not e.waited:
                C.wait(e.pending)
                e.waited = True
        return self.ready()

    def __len__(self) -> int:
        return len(self._entries)
