"""Every collective the AMSP engine issues, as small free functions.

This is the ONLY module of amsp_ext that calls ``torch.distributed`` collectives (FSDP2 issues
its all-gathers and reduce-scatters through :mod:`amsp_ext.runtime.sync.param_shard`'s comm objects,
which call back into here). Each function takes the ``CollectiveContext`` first ([Note: the
collective context]), its group as an argument plus a ``name`` (the group's label, e.g.
``param_replica[0,2]``, see ``PlanMesh.name``) and, when it can run async, its ``stream``; it runs under
the label ``amsp::<op>::<group kind>`` (``compat.label``: a ``record_function`` while a profiler
records, [Note: labels cost nothing unprofiled] in _torch_compat.py) and returns a work handle
when ``async_op``.

[Note: timeouts that name their group]
A collective that never completes (a rank died, or skipped a collective) must not hang silently.
``wait`` passes a timeout to ``Work.wait``: on gloo that raises after the timeout, and we
re-raise :class:`CollectiveTimeout` naming the op and the group, e.g. ``broadcast on
optim_bcast[0,1] did not complete within 5.0s``. On NCCL, ``Work.wait(timeout)`` would block the
CPU thread until the collective finishes, which would serialize the launch queue and defeat the
overlap, so there we only make the current stream wait (``Work.wait()``) and rely on the
process-group timeout (the NCCL watchdog), whose error carries the group description.

[Note: the collective context]
What the collectives share lives in one ``CollectiveContext`` that is passed to every free
function as its first argument, as FSDP2 hands its ``FSDPCommContext`` (streams) and its
process group to ``foreach_all_gather`` rather than keeping them in module state: the counters,
the observers, the default timeout and the async-save group. The engine owns one (``shard``
makes it, or takes the caller's ``comm=``; ``switch_plan`` keeps it, so counters and observers
span a switch) and hands it to every part that issues collectives (FSDP2's comm objects,
GradSync, ParamSync, the optimizer's norm group, checkpoints, export, the adaptive run). Code
that issues collectives outside an engine (a training loop's loss all-reduce, ``amsp profile``,
``amsp compare``'s worker) makes its own. Module globals would let two engines in one process
(tests, ``amsp tune``'s candidates, a dry run) count into and observe each other, and make a
test that installs an observer leak it into the next. A pending handle remembers its context
and timeout, so ``wait(pending)`` needs neither.

[Note: counters]
``ctx.counts`` counts the collectives issued per (op, group kind). The guard-rail tests use it
to show that a bad plan is refused before any collective, and the benchmarks use it to report
how many collectives a step issues.

[Note: observer]
Each ``fn(event, op, name, info)`` in ``ctx.observers`` sees every collective: ``"issue"``
before it is started, ``"issued"`` right after with ``info`` = the pending handle (``.work``,
``.nbytes``: the collective's v as the planner counts it), ``"wait_begin"`` / ``"wait_end"``
(same handle) around every blocking wait. runtime/measure/comm_trace.py turns these into
measured and exposed time per kind; ``observing(ctx, fn)`` installs one for a block. A handle
given to FSDP2 is a ``WorkHandle`` (a ``dist.Work``), so FSDP2's own waits for its all-gathers
also pass through ``wait`` and are seen (and time out naming their group).

[Note: streams are explicit]
Every collective that can run asynchronously takes ``stream=`` without a default: the caller
says where it is issued (and, when blocking, waited for). ``None`` is the current stream, and a
caller passing it says why that is the right one (FSDP2 calls its comm objects inside its own
all-gather / reduce-scatter stream; the post-step broadcasts run on the step's stream). On CPU
(gloo) there are no streams and every caller passes None.

[Note: process groups torn down at exit]
A rank that had finished cleanly now and then died in interpreter teardown with "terminate
called without an active exception" (SIGABRT), and torchrun failed the job. The cause, read off
a core dump (a 4-rank script that called ``shard`` and then ``destroy_process_group()`` itself;
comparisons/results/design_history.md, "Teardown abort"): a gloo worker thread
(``ProcessGroupGloo::runLoop``) dropped its reference to a finished collective
(``~AsyncAllgatherWork``) after the main thread had begun finalizing. The work held the last
reference to a tensor whose Python object had already gone, so releasing it must take the GIL; a
thread that asks for the GIL during finalization is ended by ``pthread_exit``, and its forced
unwind through a ``noexcept`` destructor calls ``std::terminate``. Any collective can be that
one, a user's or ours: the worker drops its reference a moment after the waiting thread saw the
work complete.
``destroy_process_group()`` does not stop gloo's workers (``shutdown``/``abort`` are no-ops for
gloo in torch 2.13): a group's threads are joined only when its last reference goes (the
call joined the world group's three threads, but not those of a subgroup the script still
held). The engine holds references to its groups, so their threads outlive the call, and the
DDP test scripts' cure of old (destroy your group yourself) does not hold under the engine:
tests/scripts/exit_race.py, which does, failed 5 runs in 32 on a loaded machine (two busy
loops on the 2 cores).
``shard`` therefore registers ``destroy_groups_at_exit``. At exit, while the interpreter is
whole, it destroys every group (unless the script did: local on gloo, no collective; a pending
collective whose peer has gone does not block it, checked with a 2-rank run) and then waits,
with the GIL released, until no gloo worker thread of the process is running for two polls
in a row (at most ``EXIT_DRAIN_S``): whatever a worker still had to release, it releases
then (the same script: 0 failed runs in 40). torch's own atexit for this (pytorch#179291)
was withdrawn. The per-rank entry points (`amsp train`'s ranks, the compare worker) leave with
``os._exit`` once their results are written and skip teardown altogether.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from amsp_ext.runtime import _torch_compat as compat

__all__ = [
    "barrier",
    "CollectiveContext",
    "CollectiveTimeout",
    "all_gather_bytes",
    "all_gather_objects",
    "all_gather_into_tensor",
    "broadcast_bytes",
    "advance",
    "issue_gathers",
    "all_reduce",
    "all_reduce_two_level",
    "broadcast",
    "checkpoint_group",
    "destroy_groups_at_exit",
    "drain_gloo_workers",
    "full_tensor",
    "gather_objects",
    "observing",
    "reduce_scatter_tensor",
    "reduce_scatter_polled",
    "recording_collectives",
    "replay_alone",
    "wait",
    "WorkHandle",
]

Observer = Callable[[str, str, str, Any], None]


@dataclasses.dataclass(eq=False, kw_only=True)
class CollectiveContext:
    """What every collective of one engine (or one loop) shares; see [Note: the collective
    context]. ``timeout``: seconds a wait may take when the call gives none; no default here:
    the engine's is ``EngineConfig.timeout`` (the one definition), others say their own."""

    timeout: float
    # (op, group kind) -> number of collectives issued through this context ([Note: counters])
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # ``fn(event, op, name, info)``, see [Note: observer]; keep them cheap
    observers: list[Observer] = dataclasses.field(default_factory=list)
    # the async-save thread's gloo group and its label, made on first use (``checkpoint_group``)
    async_save_group: tuple[dist.ProcessGroup, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
            raise ValueError(f"CollectiveContext.timeout must be a number of seconds > 0, got {self.timeout!r}")

    def notify(self, event: str, op: str, name: str, info: Any) -> None:
        for fn in self.observers:
            fn(event, op, name, info)


@contextlib.contextmanager
def observing(ctx: CollectiveContext, fn: Observer):
    """``fn`` sees every collective of ``ctx`` inside the block."""
    ctx.observers.append(fn)
    try:
        yield fn
    finally:
        ctx.observers.remove(fn)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names the op and the group."""


def _kind(name: str) -> str:
    return name.split("[", 1)[0] if name else "world"


def _issue(ctx: CollectiveContext, op: str, name: str) -> None:
    ctx.counts[(op, _kind(name))] += 1
    if ctx.observers:
        ctx.notify("issue", op, name, None)


def _seconds(ctx: CollectiveContext, timeout: float | datetime.timedelta | None) -> float:
    if timeout is None:
        return float(ctx.timeout)
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class _Pending:
    """A work handle plus what ``wait`` needs: its context, its timeout, and how to name it."""

    __slots__ = ("work", "op", "name", "on_accelerator", "nbytes", "ctx", "timeout")

    def __init__(self, ctx: CollectiveContext, work: Any, op: str, name: str, on_accelerator: bool,
                 nbytes: int, timeout: float) -> None:
        self.ctx, self.work, self.op, self.name = ctx, work, op, name
        self.on_accelerator = on_accelerator
        self.nbytes, self.timeout = nbytes, timeout

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _finish(ctx: CollectiveContext, work: Any, op: str, name: str, tensor: torch.Tensor,
            async_op: bool, timeout, nbytes: int) -> _Pending | None:
    pending = _Pending(ctx, work, op, name, tensor.device.type != "cpu", nbytes, _seconds(ctx, timeout))
    if ctx.observers:
        ctx.notify("issued", op, name, pending)
    if async_op:
        return pending
    wait(pending)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _on_stream(stream: torch.Stream | None):
    return contextlib.nullcontext() if stream is None else stream


class WorkHandle(dist.Work):
    """A ``dist.Work`` whose ``wait()`` is :func:`wait`: for code that waits on its own (FSDP2),
    so its waits are timed by the observers and time out naming the group."""

    def __init__(self, pending: _Pending) -> None:
        super().__init__()
        self._pending = pending

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - ours is the one given at issue
        wait(self._pending)
        return True

    def is_completed(self) -> bool:
        return self._pending.is_completed()


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, group: dist.ProcessGroup | None, *,
               name: str, stream: torch.Stream | None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = True,
               timeout=None) -> _Pending | None:
    """Sum (or ``op``) ``tensor`` in place over ``group``, issued (and, if not ``async_op``,
    waited for) on ``stream`` ([Note: streams are explicit])."""
    with _on_stream(stream):
        with compat.label(f"amsp::all_reduce::{_kind(name)}"):
            _issue(ctx, "all_reduce", name)
            work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _finish(ctx, work, "all_reduce", name, tensor, async_op, timeout, _nbytes(tensor))


# [Note: two-level all-reduce]
# A ring all-reduce over a group with several ranks on each of two nodes crosses the node link
# twice per ring, each time with 2(p-1)/p of the tensor: 1.5x the tensor each way for a 2x2
# group. Reduce-scatter inside the node, all-reduce of the 1/p0 shard across nodes (p0 such
# all-reduces share the link) and all-gather inside the node send the tensor once each way:
# 2/3 of the ring's bytes on the slow link, for two extra collectives on the fast one. Whether
# that wins depends on the link: where the link is fast, the extra collectives' CPU time can
# outweigh the link time saved (comparisons/results/design_history.md, "Flat or two-level
# all-reduce"). Hence a setting, EngineConfig.all_reduce, that the planner prices
# (planner/profile.py [Note: a two-level all-reduce's time]).
# On an accelerator the three are issued at once, each after its stream was made to wait for
# the phase before (``Work.wait`` is stream-ordered there). On gloo a phase can only be issued
# once the one before has finished, so the chain is moved on by the caller: ``advance`` issues the
# cross-node all-reduce once the first phase is done, without blocking (GradSync calls it from
# every gradient hook), and ``wait`` finishes the chain. Only that step is ever taken at a time
# that depends on a collective's progress; the all-gather is issued by ``wait`` or
# ``issue_gathers``, at a point of the program every rank reaches in the same order, so each
# process group sees its collectives in the same order on every rank (gloo matches them by
# order): the local group its first phases in bucket order and its all-gathers at those points,
# the node group its all-reduces in bucket order (callers advance chains oldest first and stop
# at the first that cannot move). At the end of backward GradSync calls ``issue_gathers`` on
# the chains in flight before it waits for any: each bucket's in-node all-gather then runs
# while the next bucket's cross-node all-reduce is still on the link, where waiting chain by
# chain had left them end to end (comparisons/results/design_history.md,
# "Two-level all-reduce chains").
# On gloo the first phase is an all-reduce of the whole tensor inside the node, and the shard
# is this rank's slice of it: gloo runs a reduce-scatter as that all-reduce anyway (its trace
# shows ``gloo:all_reduce`` of the whole input), and its reduce-scatter's Work never reports
# ``is_completed()`` before it is waited for (checked on 2 ranks: still False after 200 ms,
# where an all-reduce's turned True), so ``advance`` could not move it on: on the lab at 100
# Mbit every cross-node all-reduce then started only at the end of backward.


class _TwoLevel:
    """A two-level all-reduce in flight: the phase running now and what the next ones need."""

    __slots__ = ("ctx", "tensor", "shard", "local", "node", "stream", "timeout", "phase", "pending")

    def __init__(self, ctx: CollectiveContext, tensor: torch.Tensor, local: tuple[dist.ProcessGroup, str],
                 node: tuple[dist.ProcessGroup, str], stream: torch.Stream | None, timeout) -> None:
        self.ctx, self.tensor, self.local, self.node = ctx, tensor, local, node
        self.stream, self.timeout = stream, timeout
        self.phase = "local_reduce"
        num_local, me = dist.get_world_size(local[0]), dist.get_rank(local[0])
        if tensor.numel() % num_local:
            raise ValueError(f"all_reduce_two_level: {tensor.numel()} elements do not split over the "
                             f"{num_local} ranks of {local[1]}")
        n = tensor.numel() // num_local
        if self.sliced:  # gloo: see the Note's last paragraph
            self.shard = tensor[me * n:(me + 1) * n]
            self.pending = all_reduce(ctx, tensor, local[0], name=local[1], stream=stream, timeout=timeout)
        else:
            with _on_stream(stream):
                self.shard = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
            self.pending = reduce_scatter_tensor(ctx, self.shard, tensor, local[0], name=local[1],
                                                 stream=stream, timeout=timeout)

    @property
    def sliced(self) -> bool:
        """On gloo the shard is this rank's slice of the tensor (a view), else a buffer of its own."""
        return self.tensor.device.type == "cpu"


def all_reduce_two_level(ctx: CollectiveContext, tensor: torch.Tensor,
                         local: tuple[dist.ProcessGroup, str], node: tuple[dist.ProcessGroup, str], *,
                         stream: torch.Stream | None, timeout=None) -> _TwoLevel:
    """Sum ``tensor`` in place over the group whose levels are ``local`` (this node's ranks of
    it) and ``node`` (the ranks at the same place on the other nodes), each a (group, name):
    see [Note: two-level all-reduce]. ``tensor.numel()`` must divide by the local group's size.
    Always async: finish it with ``wait``, move it on with ``advance``."""
    chain = _TwoLevel(ctx, tensor, local, node, stream, timeout)
    if not chain.sliced:  # stream-ordered: nothing to wait for between the phases
        _next_phase(chain)
        _next_phase(chain)
    return chain


def _next_phase(chain: _TwoLevel, timeout=None) -> None:
    """Wait for the running phase (on an accelerator: the stream waits, as the next phase runs on
    another group's stream) and issue the next one."""
    wait(chain.pending, timeout=timeout)
    if chain.phase == "local_reduce":
        chain.phase = "node_all_reduce"
        chain.pending = all_reduce(chain.ctx, chain.shard, chain.node[0], name=chain.node[1],
                                   stream=chain.stream, timeout=chain.timeout)
    elif chain.phase == "node_all_reduce":
        chain.phase = "local_gather"
        # on gloo the shard is a slice of the output: gather from a copy, not from itself
        shard = chain.shard.clone() if chain.sliced else chain.shard
        chain.pending = all_gather_into_tensor(chain.ctx, chain.tensor, shard, chain.local[0],
                                               name=chain.local[1], stream=chain.stream,
                                               timeout=chain.timeout)
    else:
        chain.phase, chain.pending, chain.shard = "done", None, None


def advance(pending: "_TwoLevel | _Pending | None", *, block: bool = False) -> bool:
    """Move a two-level all-reduce on to its cross-node all-reduce if its first phase has
    finished (or, with ``block``, once it has); True when it is past that phase (or is no chain)."""
    if not isinstance(pending, _TwoLevel):
        return True
    if pending.phase == "local_reduce":
        if not block and not pending.pending.is_completed():
            return False
        _next_phase(pending)
    return True


def issue_gathers(pendings: Iterable["_TwoLevel | _Pending | None"]) -> None:
    """Move every two-level all-reduce of ``pendings`` (oldest first) on to its cross-node
    all-reduce, then issue each one's all-gather once that is done, waiting for none of the
    gathers. Call it where every rank is at the same point of the program ([Note: two-level
    all-reduce]); other handles are left as they are."""
    chains = [p for p in pendings if isinstance(p, _TwoLevel)]
    for chain in chains:
        advance(chain, block=True)
    for chain in chains:
        if chain.phase == "node_all_reduce":
            _next_phase(chain)


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None,
              *, name: str, stream: torch.Stream | None, async_op: bool = True,
              timeout=None) -> _Pending | None:
    """Broadcast ``tensor`` from global rank ``src`` to the other ranks of ``group``."""
    with _on_stream(stream):
        with compat.label(f"amsp::broadcast::{_kind(name)}"):
            _issue(ctx, "broadcast", name)
            work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        return _finish(ctx, work, "broadcast", name, tensor, async_op, timeout, _nbytes(tensor))


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn there); earlier releases, such as a GPU image's torch, have only the old names.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(ctx: CollectiveContext, output: torch.Tensor, input: torch.Tensor,
                           group: dist.ProcessGroup | None, *, name: str, stream: torch.Stream | None,
                           async_op: bool = True, timeout=None) -> _Pending | None:
    with _on_stream(stream):
        with compat.label(f"amsp::all_gather::{_kind(name)}"):
            _issue(ctx, "all_gather", name)
            work = _ALL_GATHER_SINGLE(output, input, group=group, async_op=True)
        return _finish(ctx, work, "all_gather", name, output, async_op, timeout, _nbytes(output))


def reduce_scatter_tensor(ctx: CollectiveContext, output: torch.Tensor, input: torch.Tensor,
                          group: dist.ProcessGroup | None, *, name: str, stream: torch.Stream | None,
                          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = True,
                          timeout=None) -> _Pending | None:
    with _on_stream(stream):
        with compat.label(f"amsp::reduce_scatter::{_kind(name)}"):
            _issue(ctx, "reduce_scatter", name)
            work = _REDUCE_SCATTER_SINGLE(output, input, op=op, group=group, async_op=True)
        return _finish(ctx, work, "reduce_scatter", name, output, async_op, timeout, _nbytes(input))


# [Note: a reduce-scatter that can be polled (gloo)]
# gloo's reduce-scatter Work never reports ``is_completed()`` before it is waited for (see
# [Note: two-level all-reduce]), so nothing can be started the moment one ends. gloo runs a
# reduce-scatter as an all-reduce of the whole input anyway, and its all-reduce does report
# completion. ``reduce_scatter_polled`` therefore all-reduces ``input`` in place and, when
# waited for, copies this rank's chunk into ``output``: the same bytes on the link, a Work that
# can be polled, and the counters and labels of a reduce-scatter (it replaces one, so the
# collective counts compared with FSDP2's stay as they are). ``input`` is overwritten with the
# sums, so it is for callers that do not read it afterwards (FSDP2's reduce-scatter input).
class _PolledReduceScatter:
    """An all-reduce of a reduce-scatter's input in flight, and the chunk it fills ``output``
    from once waited for."""

    __slots__ = ("pending", "output", "chunk")

    def __init__(self, pending: _Pending, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self.pending, self.output, self.chunk = pending, output, chunk

    def is_completed(self) -> bool:
        return self.pending.is_completed()


def reduce_scatter_polled(ctx: CollectiveContext, output: torch.Tensor, input: torch.Tensor,
                          group: dist.ProcessGroup, *, name: str, timeout=None) -> _PolledReduceScatter:
    """Sum-reduce-scatter ``input`` into ``output`` over ``group`` (gloo), as an all-reduce of
    ``input`` in place whose completion can be polled ([Note: a reduce-scatter that can be
    polled (gloo)]). Always async: finish it with ``wait``."""
    me, n = dist.get_rank(group), output.numel()
    if input.numel() != n * dist.get_world_size(group):
        raise ValueError(f"reduce_scatter_polled: input of {input.numel()} elements is not "
                         f"{dist.get_world_size(group)} x the output's {n} on {name}")
    with compat.label(f"amsp::reduce_scatter::{_kind(name)}"):
        _issue(ctx, "reduce_scatter", name)
        work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    pending = _finish(ctx, work, "reduce_scatter", name, input, True, timeout, _nbytes(input))
    return _PolledReduceScatter(pending, output, input.view(-1)[me * n:(me + 1) * n])


def all_to_all(ctx: CollectiveContext, output: torch.Tensor, input: torch.Tensor,
               group: dist.ProcessGroup | None, *, output_splits: list[int], input_splits: list[int],
               name: str, stream: torch.Stream | None, async_op: bool = False,
               timeout=None) -> _Pending | None:
    """``input_splits[j]`` elements of ``input`` (in order) to the j-th rank of ``group``;
    ``output_splits[i]`` elements from its i-th rank into ``output`` (whole-tensor optimizers'
    gradients to the owner and parameters back, optim/whole_tensor.py)."""
    with _on_stream(stream):
        with compat.label(f"amsp::all_to_all::{_kind(name)}"):
            _issue(ctx, "all_to_all", name)
            work = dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                          async_op=True)
        return _finish(ctx, work, "all_to_all", name, output, async_op, timeout, _nbytes(input))


def _host_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a blocking bookkeeping collective's small tensor lives: NCCL needs it on the GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(ctx: CollectiveContext, payload: bytes, group: dist.ProcessGroup | None, *,
                     name: str, width: int = 128, timeout=None) -> list[bytes]:
    """Gather a short byte string (``<= width`` bytes) from every rank of ``group``, in rank order.

    Used at init to compare plan/config fingerprints; a fixed-width uint8 all-gather (rather than
    ``all_gather_object``) so it runs through ``wait`` and its timeout. Blocking, on the current
    stream (the bytes are read right after).
    """
    if len(payload) > width:
        raise ValueError(f"all_gather_bytes: payload of {len(payload)} bytes exceeds width={width}")
    from amsp_ext.runtime._torch_compat import real_tensors

    size = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = _host_device(group)
    row = len(payload).to_bytes(4, "little") + payload + bytes(width - len(payload))  # length, bytes
    with real_tensors():  # host bookkeeping: real bytes even inside a dry run's FakeTensorMode
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(device)
        out = torch.empty(size * (width + 4), dtype=torch.uint8, device=device)
        all_gather_into_tensor(ctx, out, mine, group, name=name, stream=None, async_op=False,
                               timeout=timeout)
        if backend == "fake":  # [Note: dry run] the fake backend moves no data; every simulated
            return [payload] * size  # rank runs the same code, so each sent what this one did
        data = out.cpu().numpy().tobytes()
    rows = [data[i * (width + 4): (i + 1) * (width + 4)] for i in range(size)]
    return [r[4: 4 + int.from_bytes(r[:4], "little")] for r in rows]


def broadcast_bytes(ctx: CollectiveContext, payload: bytes | None, src: int, *, name: str,
                    timeout=None) -> bytes:
    """Global rank ``src``'s ``payload`` (any length; the others pass None) on every rank: its
    length, then its bytes, each one broadcast over the world (so a large payload, such as a
    profile, is not padded to every rank's row as ``all_gather_bytes`` would)."""
    from amsp_ext.runtime._torch_compat import real_tensors

    device = _host_device(None)
    with real_tensors():
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=device)
        broadcast(ctx, size, src, None, name=name, stream=None, async_op=False, timeout=timeout)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload is not None
                else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        if data.numel():
            broadcast(ctx, data, src, None, name=name, stream=None, async_op=False, timeout=timeout)
        return payload if payload is not None else data.cpu().numpy().tobytes()


def all_gather_objects(ctx: CollectiveContext, obj: Any, group: dist.ProcessGroup | None, *,
                       name: str, timeout=None) -> list:
    """Every rank's ``obj`` (as JSON data, runtime/wire.py: tensors, dtypes and tuples travel
    too, nothing is unpickled), in rank order: two ``all_gather_bytes``, the lengths and then the
    payloads, so it waits with ``timeout`` (else the context's) and times out naming its group."""
    from amsp_ext.runtime import wire

    mine = wire.dumps(obj, f"object sent on {name}")
    sizes = all_gather_bytes(ctx, len(mine).to_bytes(8, "little"), group, name=name, width=8,
                             timeout=timeout)
    width = max(int.from_bytes(s, "little") for s in sizes)
    got = all_gather_bytes(ctx, mine, group, name=name, width=width, timeout=timeout)
    return [wire.loads(g) for g in got]


def barrier(ctx: CollectiveContext, group: dist.ProcessGroup | None, *, name: str, timeout=None) -> None:
    """Every rank of ``group`` reaches this point (a 1-element all-reduce, so it times out
    with the group's name like every other collective; blocking, on the current stream)."""
    all_reduce(ctx, torch.zeros(1, device=_host_device(group)), group, name=name, stream=None,
               async_op=False, timeout=timeout)


def wait(pending: "_Pending | _TwoLevel | _PolledReduceScatter | None", *, name: str | None = None,
         timeout=None) -> None:
    """Wait for ``pending`` (from an ``async_op=True`` call) with ``timeout`` (else the one it
    was issued with); raise CollectiveTimeout naming the group."""
    if isinstance(pending, _TwoLevel):
        while pending.phase != "done":
            _next_phase(pending, timeout)
        return
    if isinstance(pending, _PolledReduceScatter):
        if pending.pending.work is not None:
            wait(pending.pending, name=name, timeout=timeout)
            pending.output.view(-1).copy_(pending.chunk)
        return
    if pending is None or pending.work is None:
        return
    ctx = pending.ctx
    label = name or pending.name
    with compat.label(f"amsp::wait::{pending.op}::{_kind(label)}"):
        if ctx.observers:
            ctx.notify("wait_begin", pending.op, label, pending)
        work = pending.work
        if pending.on_accelerator:
            work.wait()  # stream-ordered; see [Note: timeouts that name their group]
        else:
            seconds = pending.timeout if timeout is None else _seconds(ctx, timeout)
            t0 = time.perf_counter()
            try:
                work.wait(timeout=datetime.timedelta(seconds=seconds))
            except RuntimeError as e:
                waited = time.perf_counter() - t0
                what = (f"did not complete within {seconds:g}s"
                        if waited >= 0.9 * seconds else f"failed after {waited:.1f}s")
                raise CollectiveTimeout(
                    f"amsp: {pending.op} on {label} {what} (a rank of {label} died, hangs, or "
                    f"skipped it): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from e
        pending.work = None
        if ctx.observers:
            ctx.notify("wait_end", pending.op, label, pending)


# -- a step's collectives alone -----------------------------------------------------------------
# [Note: a step's collectives replayed alone]
# A step's limit (compare/limit.py) needs what its collectives cost with nothing else running,
# on the same links. Every system's collectives - DDP's C++ reducer, FSDP2, DeepSpeed and this
# engine - reach the dispatcher as ``c10d::`` ops with their process group among the
# arguments, so a dispatch observer records one step's ops as they are issued (the op, its
# group and other arguments, each tensor's shape and dtype), and ``replay_alone`` issues them
# again in the recorded order on fresh zero tensors of those shapes, every one without waiting,
# then waits for all. Every rank recorded the same step, so each group sees the same sequence
# on every rank and the replay cannot deadlock; ops on different groups overlap as far as the
# links and gloo's worker threads allow. The time is what the step's bytes need on these links
# with no compute and no program order - a floor, not what the step's own order allows (that
# is the step's exposed time). Functional collectives (``_c10d_functional::``, DTensor's) are
# not recorded: the compared systems issue none.
@dataclasses.dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _described(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _Shape(tuple(a.shape), a.dtype, a.device)
    if isinstance(a, (list, tuple)):
        return type(a)(_described(x) for x in a)
    return a


def _fresh(a: Any) -> Any:
    if isinstance(a, _Shape):
        return torch.zeros(a.shape, dtype=a.dtype, device=a.device)
    if isinstance(a, (list, tuple)):
        return type(a)(_fresh(x) for x in a)
    return a


def _nbytes_of(a: Any) -> int:
    if isinstance(a, _Shape):
        return int(torch.Size(a.shape).numel()) * a.dtype.itemsize
    if isinstance(a, (list, tuple)):
        return sum(_nbytes_of(x) for x in a)
    return 0


@contextlib.contextmanager
def recording_collectives():
    """Inside the block, every ``c10d::`` op this thread (and the autograd work it starts)
    dispatches is appended, as it is issued, to the yielded list as ``(op name, op, args,
    kwargs)`` with tensors described by shape ([Note: a step's collectives replayed alone])."""
    from amsp_ext.runtime._torch_compat import op_recorder

    ops: list[tuple[str, Any, Any, Any]] = []

    def record(op_name: str, func, args, kwargs) -> None:
        if op_name.startswith("c10d::"):
            ops.append((op_name, func, _described(args), _described(kwargs or {})))

    with op_recorder(record):
        yield ops


def replay_alone(ctx: CollectiveContext, ops: list, *, name: str, timeout=None) -> dict[str, float]:
    """Issue ``ops`` (from ``recording_collectives``) again on fresh tensors, all before any
    wait, after a barrier of the world; ``{"s": seconds from the first issue to the last
    completion on this rank, "count", "bytes"}`` (the bytes of every tensor argument, outputs
    included). ``name``: the replay's label for the barrier and a timeout."""
    barrier(ctx, None, name=name, timeout=timeout)
    seconds = _seconds(ctx, timeout)
    with compat.label(f"amsp::replay::{name}"):
        t0 = time.perf_counter()
        works = []
        for op_name, func, args, kwargs in ops:
            out = func(*_fresh(args), **_fresh(kwargs))
            boxed = out[-1] if isinstance(out, (list, tuple)) else out
            works.append((op_name, dist.Work.unbox(boxed)))
        for op, work in works:
            try:
                work.wait(datetime.timedelta(seconds=seconds))
            except RuntimeError as e:
                raise CollectiveTimeout(f"amsp: replayed {op} ({name}) did not complete within "
                                        f"{seconds:g}s: {str(e).splitlines()[0] if str(e) else e}") from e
        elapsed = time.perf_counter() - t0
    return {"s": elapsed, "count": len(ops), "bytes": sum(_nbytes_of(a) for _, _, a, _ in ops)}


# -- checkpoint I/O ------------------------------------------------------------------------------
# [Note: collectives of a checkpoint]
# A checkpoint's tensors are written and read by each rank alone (runtime/state/dcp_io.py: DCP
# without a process group, whose own coordination pickles objects between ranks); what the ranks
# must agree on travels here: ``all_gather_objects`` (JSON) of the chunk table and of the written
# files, ``all_gather_bytes`` of what went wrong, ``barrier`` to mark a checkpoint complete on
# every rank, ``full_tensor`` (DTensor's all-gather) for a consolidated export. An async save's
# background thread uses ``checkpoint_group``. All run on the default group or a plan group,
# whose timeout bounds them.


def checkpoint_group(ctx: CollectiveContext) -> tuple[dist.ProcessGroup, str]:
    """A gloo group over the whole world for the async-save thread (created once per context,
    on first use, by every rank, with the context's timeout): the training thread keeps the
    default group and the plan's groups."""
    if ctx.async_save_group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctx.timeout))
        ctx.async_save_group = (group, f"checkpoint[0..{dist.get_world_size() - 1}]")
    return ctx.async_save_group


def gather_objects(ctx: CollectiveContext, obj: Any, group: dist.ProcessGroup | None, *, name: str,
                   dst: int = 0, timeout=None) -> list | None:
    """One small object per rank (JSON data, as ``all_gather_objects``: never a pickle) to
    global rank ``dst``; the others get None. An all-gather underneath (the objects are small),
    so it waits with ``timeout`` (else the context's) and times out naming its group, unlike
    ``dist.gather_object``."""
    got = all_gather_objects(ctx, obj, group, name=name, timeout=timeout)
    return got if dist.get_rank() == dst else None


def full_tensor(ctx: CollectiveContext, tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    """The whole tensor of a DTensor (its own all-gather over its mesh, blocking, on the
    current stream); a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with compat.label(f"amsp::all_gather::{_kind(name)}"):
        _issue(ctx, "all_gather", name)
        return tensor.full_tensor()


# -- lifecycle -----------------------------------------------------------------------------------

EXIT_DRAIN_S = 1.0  # [Note: process groups torn down at exit]; polled every 10 ms
_GLOO_WORKER_PREFIXES = ("pt_gloo", "gloo")


def _gloo_workers_running() -> bool | None:
    """Whether a gloo thread of this process is running or runnable (Linux ``/proc``; None
    where it cannot be read)."""
    import glob

    tasks = glob.glob("/proc/self/task/*")
    if not tasks:
        return None
    for task in tasks:
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            if not name.startswith(_GLOO_WORKER_PREFIXES):
                continue
            with open(f"{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended between the listing and the read
            continue
        if state in ("R", "D"):
            return True
    return False


def drain_gloo_workers(max_s: float = EXIT_DRAIN_S, poll_s: float = 0.01) -> bool:
    """Sleep (the GIL released) until no gloo worker thread runs for two polls in a row; True
    if they went idle within ``max_s``. Without ``/proc``, one poll interval."""
    deadline = time.monotonic() + max_s
    idle = 0
    while True:
        time.sleep(poll_s)
        running = _gloo_workers_running()
        if running is None:
            return True
        idle = 0 if running else idle + 1
        if idle >= 2:
            return True
        if time.monotonic() >= deadline:
            return False


def _teardown_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the process is exiting; say so, do not raise
            print(f"amsp: destroying the process groups at exit failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
    drain_gloo_workers()


def destroy_groups_at_exit() -> None:
    """Destroy every process group at interpreter exit and let gloo's workers go idle before
    finalization ([Note: process groups torn down at exit]); calling it again keeps one
    handler (the one registered last runs first)."""
    atexit.unregister(_teardown_at_exit)
    atexit.register(_teardown_at_exit)
