"""Every collective amsp_ext issues, as small free functions taking their group as an argument.

This is the ONLY module that calls ``torch.distributed`` collectives. Each function takes the
group and a ``name`` (the group's label, e.g. ``param_replica[0,2]``), runs under
``record_function("amsp::<op>::<group kind>")`` and returns a pending handle when ``async_op``.

(Minimal version written for ``amsp profile``; its signatures are a subset of the engine's
``collectives.py``, which supersedes it when both land.)

[Note: timeouts that name their group]
A synchronous call is issued asynchronously and waited on with ``Work.wait(timeout)``; on gloo a
missing peer then surfaces as :class:`CollectiveTimeout` naming the op and group instead of a
silent hang. On accelerators ``Work.wait()`` only orders the current stream, and the process
group's own timeout (the NCCL watchdog) applies.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = [
    "CollectiveTimeout",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "reduce_scatter_tensor",
    "wait",
]

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names the op and the group."""


def _kind(name: str) -> str:
    return name.split("[", 1)[0] if name else "world"


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return _DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


class _Pending:
    __slots__ = ("work", "op", "name", "on_accelerator")

    def __init__(self, work: Any, op: str, name: str, on_accelerator: bool) -> None:
        self.work, self.op, self.name, self.on_accelerator = work, op, name, on_accelerator


def _finish(work: Any, op: str, name: str, tensor: torch.Tensor, async_op: bool, timeout):
    pending = _Pending(work, op, name, tensor.device.type != "cpu")
    if async_op:
        return pending
    wait(pending, timeout=timeout)
    return None


def all_reduce(tensor: torch.Tensor, group, *, name: str, op=dist.ReduceOp.SUM,
               async_op: bool = True, timeout=None):
    """Sum (or ``op``) ``tensor`` in place over ``group``."""
    with record_function(f"amsp::all_reduce::{_kind(name)}"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _finish(work, "all_reduce", name, tensor, async_op, timeout)


def broadcast(tensor: torch.Tensor, src: int, group, *, name: str, async_op: bool = True, timeout=None):
    """Broadcast ``tensor`` from global rank ``src`` to the other ranks of ``group``."""
    with record_function(f"amsp::broadcast::{_kind(name)}"):
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _finish(work, "broadcast", name, tensor, async_op, timeout)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group, *, name: str,
                           async_op: bool = True, timeout=None):
    """Gather every rank's ``input`` into ``output`` (v = output bytes)."""
    with record_function(f"amsp::all_gather::{_kind(name)}"):
        work = dist.all_gather_into_tensor(output, input, group=group, async_op=True)
    return _finish(work, "all_gather", name, output, async_op, timeout)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group, *, name: str,
                          op=dist.ReduceOp.SUM, async_op: bool = True, timeout=None):
    """Reduce ``input`` (v = input bytes) over ``group``; this rank's slice lands in ``output``."""
    with record_function(f"amsp::reduce_scatter::{_kind(name)}"):
        work = dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=True)
    return _finish(work, "reduce_scatter", name, output, async_op, timeout)


def wait(pending: "_Pending | None", *, name: str | None = None, timeout=None) -> None:
    """Wait for ``pending``; raise CollectiveTimeout naming the group."""
    if pending is None or pending.work is None:
        return
    label = name or pending.name
    with record_function(f"amsp::wait::{pending.op}::{_kind(label)}"):
        if pending.on_accelerator:
            pending.work.wait()
        else:
            td = _as_timedelta(timeout)
            try:
                pending.work.wait(timeout=td)
            except RuntimeError as e:
                raise CollectiveTimeout(
                    f"amsp: {pending.op} on {label} did not complete within "
                    f"{td.total_seconds():g}s (a rank of {label} died, hangs, or skipped it): {e}"
                ) from e
        pending.work = None
