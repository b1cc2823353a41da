"""The only module that issues collectives: free functions taking their group as an argument.

Each call is wrapped in ``record_function("amsp::<op>::<group_name>")`` so traces name the group,
and has a timeout whose error names the op and the group.

[Note: timeouts]
A synchronous call is issued asynchronously and waited on with ``Work.wait(timeout)`` (gloo and
NCCL both honour it), so a missing peer surfaces as :class:`CollectiveTimeout` naming the group
instead of a silent hang. ``timeout=None`` leaves the process group's own timeout in charge.
With ``async_op=True`` the caller gets the ``Work`` and waits through :func:`wait`, which applies
the same naming.

Sizes follow the paper's conventions: ``all_gather`` takes this rank's shard and fills the
gathered output (v = output bytes), ``reduce_scatter`` takes the full input (v = input bytes).
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = ["CollectiveTimeout", "all_gather", "all_reduce", "broadcast", "reduce_scatter", "wait"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveTimeout(RuntimeError):
    """A collective did not finish in time; the message names op and group."""


def _delta(timeout: Optional[float]) -> Optional[datetime.timedelta]:
    return None if timeout is None else datetime.timedelta(seconds=timeout)


def wait(work: dist.Work, *, op: str, group_name: str, timeout: Optional[float] = None) -> None:
    """Wait for an async collective; a timeout raises CollectiveTimeout naming the group."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=_delta(timeout))
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise CollectiveTimeout(
                f"amsp::{op}::{group_name} did not finish within {timeout}s "
                f"(a rank of group {group_name} is missing or stuck): {e}"
            ) from e
        raise


def _finish(work, op: str, group_name: str, async_op: bool, timeout: Optional[float]):
    if async_op:
        return work
    wait(work, op=op, group_name=group_name, timeout=timeout)
    return None


def all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, op=dist.ReduceOp.SUM,
               async_op: bool = False, group_name: str = "world", timeout: Optional[float] = None):
    with record_function(f"amsp::all_reduce::{group_name}"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _finish(work, "all_reduce", group_name, async_op, timeout)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup], *,
               async_op: bool = False, group_name: str = "world", timeout: Optional[float] = None):
    """Gather every rank's ``shard`` into ``output`` (``output.numel() == group size * shard``)."""
    with record_function(f"amsp::all_gather::{group_name}"):
        work = _all_gather(output, shard, group=group, async_op=True)
        return _finish(work, "all_gather", group_name, async_op, timeout)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                   op=dist.ReduceOp.SUM, async_op: bool = False, group_name: str = "world",
                   timeout: Optional[float] = None):
    """Reduce ``input`` over the group and keep this rank's slice in ``output``."""
    with record_function(f"amsp::reduce_scatter::{group_name}"):
        work = _reduce_scatter(output, input, op=op, group=group, async_op=True)
        return _finish(work, "reduce_scatter", group_name, async_op, timeout)


def broadcast(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, group_src: int = 0,
              async_op: bool = False, group_name: str = "world", timeout: Optional[float] = None):
    """Broadcast from the group's ``group_src``-th rank (a group-local index)."""
    with record_function(f"amsp::broadcast::{group_name}"):
        work = dist.broadcast(tensor, group=group, group_src=group_src, async_op=True)
        return _finish(work, "broadcast", group_name, async_op, timeout)
