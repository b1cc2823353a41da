"""Every collective the AMSP engine issues, as small free functions.

This is the ONLY module of amsp_ext that calls ``torch.distributed`` collectives (FSDP2 issues
its all-gathers and reduce-scatters through :mod:`amsp_ext.runtime.sync.param_shard`'s comm objects,
which call back into here). Each function takes its group as an argument plus a ``name`` (the
group's label, e.g. ``param_replica[0,2]``, see ``PlanMesh.name``), runs under
``record_function("amsp::<op>::<group kind>")`` and returns a work handle when ``async_op``.

[Note: timeouts that name their group]
A collective that never completes (a rank died, or skipped a collective) must not hang silently.
``wait`` passes a timeout to ``Work.wait``: on gloo that raises after the timeout, and we
re-raise :class:`CollectiveTimeout` naming the op and the group, e.g. ``broadcast on
optim_bcast[0,1] did not complete within 5.0s``. On NCCL, ``Work.wait(timeout)`` would block the
CPU thread until the collective finishes, which would serialize the launch queue and defeat the
overlap, so there we only make the current stream wait (``Work.wait()``) and rely on the
process-group timeout (the NCCL watchdog), whose error carries the group description.

[Note: counters]
``stats`` counts the collectives issued per (op, group kind). The guard-rail tests use it to
show that a bad plan is refused before any collective, and the benchmarks use it to report
how many collectives a step issues.

[Note: observer]
``observer(event, op, name, info)`` sees every collective: ``"issue"`` before it is started,
``"issued"`` right after with ``info`` = the pending handle (``.work``, ``.nbytes``: the
collective's v as the planner counts it), ``"wait_begin"`` / ``"wait_end"`` (same handle)
around every blocking wait. runtime/measure/comm_trace.py turns these into measured and exposed time per kind. A
handle given to FSDP2 is a ``WorkHandle`` (a ``dist.Work``), so FSDP2's own waits for its
all-gathers also pass through ``wait`` and are seen (and time out naming their group).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = [
    "barrier",
    "CollectiveTimeout",
    "all_gather_bytes",
    "all_gather_objects",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "checkpoint_group",
    "full_tensor",
    "gather_objects",
    "reduce_scatter_tensor",
    "stats",
    "wait",
    "WorkHandle",
]

# (op, group kind) -> number of collectives issued by this process
stats: collections.Counter = collections.Counter()
# Optional observer ``fn(event, op, name, info)`` with event in {"issue", "issued", "wait_begin",
# "wait_end"} (see [Note: observer]); comm_trace.py and the benchmarks hook in here. Keep it cheap.
observer = None

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names the op and the group."""


def _kind(name: str) -> str:
    return name.split("[", 1)[0] if name else "world"


def _issue(op: str, name: str) -> None:
    stats[(op, _kind(name))] += 1
    if observer is not None:
        observer("issue", op, name, None)


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return _DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


class _Pending:
    """A work handle plus what ``wait`` needs to name it in a timeout."""

    __slots__ = ("work", "op", "name", "on_accelerator", "nbytes")

    def __init__(self, work: Any, op: str, name: str, on_accelerator: bool, nbytes: int = 0) -> None:
        self.work, self.op, self.name = work, op, name
        self.on_accelerator = on_accelerator
        self.nbytes = nbytes

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _finish(work: Any, op: str, name: str, tensor: torch.Tensor, async_op: bool,
            timeout, nbytes: int) -> _Pending | None:
    pending = _Pending(work, op, name, tensor.device.type != "cpu", nbytes)
    if observer is not None:
        observer("issued", op, name, pending)
    if async_op:
        return pending
    wait(pending, timeout=timeout)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WorkHandle(dist.Work):
    """A ``dist.Work`` whose ``wait()`` is :func:`wait`: for code that waits on its own (FSDP2),
    so its waits are timed by the observer and time out naming the group."""

    def __init__(self, pending: _Pending, timeout=None) -> None:
        super().__init__()
        self._pending, self._timeout = pending, timeout

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - ours is the group's timeout
        wait(self._pending, timeout=self._timeout)
        return True

    def is_completed(self) -> bool:
        return self._pending.is_completed()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, name: str,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = True,
               timeout=None, stream: torch.Stream | None = None) -> _Pending | None:
    """Sum (or ``op``) ``tensor`` in place over ``group``. ``stream``: issue (and, if not
    ``async_op``, wait) on this accelerator stream rather than the current one."""
    with _on_stream(stream):
        with record_function(f"amsp::all_reduce::{_kind(name)}"):
            _issue("all_reduce", name)
            work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _finish(work, "all_reduce", name, tensor, async_op, timeout, _nbytes(tensor))


def _on_stream(stream: torch.Stream | None):
    return contextlib.nullcontext() if stream is None else stream


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, *, name: str,
              async_op: bool = True, timeout=None) -> _Pending | None:
    """Broadcast ``tensor`` from global rank ``src`` to the other ranks of ``group``."""
    with record_function(f"amsp::broadcast::{_kind(name)}"):
        _issue("broadcast", name)
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _finish(work, "broadcast", name, tensor, async_op, timeout, _nbytes(tensor))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                           *, name: str, async_op: bool = True, timeout=None) -> _Pending | None:
    with record_function(f"amsp::all_gather::{_kind(name)}"):
        _issue("all_gather", name)
        work = dist.all_gather_single(output, input, group=group, async_op=True)
    return _finish(work, "all_gather", name, output, async_op, timeout, _nbytes(output))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                          *, name: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                          async_op: bool = True, timeout=None) -> _Pending | None:
    with record_function(f"amsp::reduce_scatter::{_kind(name)}"):
        _issue("reduce_scatter", name)
        work = dist.reduce_scatter_single(output, input, op=op, group=group, async_op=True)
    return _finish(work, "reduce_scatter", name, output, async_op, timeout, _nbytes(input))


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None, *, name: str,
                     width: int = 128, timeout=None) -> list[bytes]:
    """Gather a short byte string (``<= width`` bytes) from every rank of ``group``, in rank order.

    Used at init to compare plan/config fingerprints; a fixed-width uint8 all-gather (rather than
    ``all_gather_object``) so it runs through ``wait`` and its timeout.
    """
    if len(payload) > width:
        raise ValueError(f"all_gather_bytes: payload of {len(payload)} bytes exceeds width={width}")
    from amsp_ext.runtime._torch_compat import real_tensors

    size = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    row = len(payload).to_bytes(4, "little") + payload + bytes(width - len(payload))  # length, bytes
    with real_tensors():  # host bookkeeping: real bytes even inside a dry run's FakeTensorMode
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(device)
        out = torch.empty(size * (width + 4), dtype=torch.uint8, device=device)
        all_gather_into_tensor(out, mine, group, name=name, async_op=False, timeout=timeout)
        if backend == "fake":  # [Note: dry run] the fake backend moves no data; every simulated
            return [payload] * size  # rank runs the same code, so each sent what this one did
        data = out.cpu().numpy().tobytes()
    rows = [data[i * (width + 4): (i + 1) * (width + 4)] for i in range(size)]
    return [r[4: 4 + int.from_bytes(r[:4], "little")] for r in rows]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None, *, name: str, timeout=None) -> list:
    """Every rank's ``obj`` (as JSON data, runtime/wire.py: tensors, dtypes and tuples travel
    too, nothing is unpickled), in rank order: two ``all_gather_bytes``, the lengths and then the
    payloads, so it times out naming its group."""
    from amsp_ext.runtime import wire

    mine = wire.dumps(obj, f"object sent on {name}")
    sizes = all_gather_bytes(len(mine).to_bytes(8, "little"), group, name=name, width=8, timeout=timeout)
    width = max(int.from_bytes(s, "little") for s in sizes)
    got = all_gather_bytes(mine, group, name=name, width=width, timeout=timeout)
    return [wire.loads(g) for g in got]


def barrier(group: dist.ProcessGroup | None, *, name: str, timeout=None) -> None:
    """Every rank of ``group`` reaches this point (a 1-element all-reduce, so it times out
    with the group's name like every other collective)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    all_reduce(torch.zeros(1, device=device), group, name=name, async_op=False, timeout=timeout)


def wait(pending: _Pending | None, *, name: str | None = None, timeout=None) -> None:
    """Wait for ``pending`` (from an ``async_op=True`` call); raise CollectiveTimeout naming the group."""
    if pending is None or pending.work is None:
        return
    label = name or pending.name
    with record_function(f"amsp::wait::{pending.op}::{_kind(label)}"):
        if observer is not None:
            observer("wait_begin", pending.op, label, pending)
        work = pending.work
        if pending.on_accelerator:
            work.wait()  # stream-ordered; see [Note: timeouts that name their group]
        else:
            td = _as_timedelta(timeout)
            t0 = time.perf_counter()
            try:
                work.wait(timeout=td)
            except RuntimeError as e:
                waited = time.perf_counter() - t0
                what = (f"did not complete within {td.total_seconds():g}s"
                        if waited >= 0.9 * td.total_seconds() else f"failed after {waited:.1f}s")
                raise CollectiveTimeout(
                    f"amsp: {pending.op} on {label} {what} (a rank of {label} died, hangs, or "
                    f"skipped it): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from e
        pending.work = None
        if observer is not None:
            observer("wait_end", pending.op, label, pending)


# -- checkpoint I/O ------------------------------------------------------------------------------
# [Note: collectives of a checkpoint]
# A checkpoint's tensors are written and read by each rank alone (runtime/state/dcp_io.py: DCP
# without a process group, whose own coordination pickles objects between ranks); what the ranks
# must agree on travels here: ``all_gather_objects`` (JSON) of the chunk table and of the written
# files, ``all_gather_bytes`` of what went wrong, ``barrier`` to mark a checkpoint complete on
# every rank, ``full_tensor`` (DTensor's all-gather) for a consolidated export. An async save's
# background thread uses ``checkpoint_group``. All run on the default group or a plan group,
# whose timeout bounds them.


_checkpoint_group: tuple[dist.ProcessGroup, str] | None = None


def checkpoint_group(timeout) -> tuple[dist.ProcessGroup, str]:
    """A gloo group over the whole world for the async-save thread (created once, on first use,
    by every rank): the training thread keeps the default group and the plan's groups."""
    global _checkpoint_group
    if _checkpoint_group is None:
        group = dist.new_group(backend="gloo", timeout=_as_timedelta(timeout))
        _checkpoint_group = (group, f"checkpoint[0..{dist.get_world_size() - 1}]")
    return _checkpoint_group


def gather_objects(obj: Any, group: dist.ProcessGroup | None, *, name: str, dst: int = 0,
                   timeout=None) -> list | None:
    """One small object per rank (JSON data, as ``all_gather_objects``: never a pickle) to
    global rank ``dst``; the others get None. An all-gather underneath (the objects are small),
    so it runs through ``wait`` and times out naming its group, unlike ``dist.gather_object``."""
    got = all_gather_objects(obj, group, name=name, timeout=timeout)
    return got if dist.get_rank() == dst else None


def full_tensor(tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    """The whole tensor of a DTensor (its own all-gather over its mesh); a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with record_function(f"amsp::all_gather::{_kind(name)}"):
        _issue("all_gather", name)
        return tensor.full_tensor()
