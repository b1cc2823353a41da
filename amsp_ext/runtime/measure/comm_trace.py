"""Measured and exposed time of each collective kind, as an observer of a collective context
(collectives.py [Note: observer]).

``amsp tune`` compares these with the planner's predictions and fits the step model's overlap
constants on them (planner/fit.py).

[Note: what is measured]
For every collective the engine issues, the recorder keeps (kind, group, bytes, issued at,
completed at): "completed" is when the work's future completes (gloo: on its worker thread;
NCCL: when the kernel has run), so ``completed - issued`` includes queueing behind earlier
collectives of the same group and waiting for the slowest rank to join. And for every blocking
``wait`` it keeps (kind, begin, end): the time the training thread could not compute because of
that collective. Per kind and per time window (a step, or a phase of one):

* ``busy_s``: the wall time during which at least one collective of the kind was in flight
  (union of [issued, completed]), i.e. what the kind costs if nothing overlapped it;
* ``sum_s``: the sum of the per-collective durations (busy_s counts concurrent ones once);
* ``exposed_s``: the time the training thread was blocked in waits for that kind;
* ``count`` and ``bytes``.

Kinds: AG (all_gather), RS (reduce_scatter), AR (all_reduce of gradient buckets: groups
``param_replica`` and ``grad``), BC (broadcast of updated parameters); every other collective
(the clip-norm and loss all-reduces, barriers) is ``other``. A collective issued in one window
and completed in the next counts in the window of its issue; waits count where they happen.

On CPU the recorder costs a few microseconds per collective (a future callback and a list
append); it is meant for tuning runs, not left installed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from amsp_ext.runtime import collectives as C
from amsp_ext.topology.groups import ALL_REDUCE_KINDS, group_kind

__all__ = ["KINDS", "CommTrace", "kind_of", "union_length"]

KINDS = ("AG", "RS", "AR", "BC")
_OP_KIND = {"all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}


def kind_of(op: str, name: str) -> str:
    """AG / RS / AR / BC for the planner's four terms, ``other`` for everything else. Every
    collective of a two-level all-reduce (on a level of an all-reduce group) is AR."""
    if group_kind(name) in ALL_REDUCE_KINDS:
        return "AR"
    if op == "all_reduce":
        return "other"
    if op == "broadcast":
        return "BC" if name.split("[", 1)[0] == "optim_bcast" else "other"
    return _OP_KIND.get(op, "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class _Record:
    kind: str
    group: str
    nbytes: int
    issued: float
    completed: float | None = None


@dataclass
class CommTrace:
    """Install with ``with CommTrace(model.amsp.comm) as trace:`` (it observes that context's
    collectives: the engine's, or a context the caller passed to ``shard``); ``summary(t0, t1)``
    per kind."""

    comm: C.CollectiveContext
    records: list[_Record] = field(default_factory=list)
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    _open: dict[int, tuple[str, float]] = field(default_factory=dict)
    _by_handle: dict[int, _Record] = field(default_factory=dict)

    def __enter__(self) -> "CommTrace":
        self.comm.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.comm.observers.remove(self._observe)

    def clear(self) -> None:
        self.records.clear()
        self.waits.clear()
        self._open.clear()
        self._by_handle.clear()

    def _observe(self, event: str, op: str, name: str, info: Any) -> None:
        now = time.perf_counter()
        if event == "issued":
            rec = _Record(kind_of(op, name), name.split("[", 1)[0], int(getattr(info, "nbytes", 0)), now)
            self.records.append(rec)
            work = getattr(info, "work", None)
            if work is None:
                rec.completed = now
                return
            self._by_handle[id(info)] = rec
            try:
                work.get_future().add_done_callback(lambda _f, r=rec: _done(r))
            except (RuntimeError, AttributeError):  # no future (gloo reduce_scatter): the end
                pass                                 # of its wait is its completion
        elif event == "wait_begin":  # waits do not nest on one thread
            self._open[threading.get_ident()] = (kind_of(op, name), now)
        elif event == "wait_end":
            kind, begin = self._open.pop(threading.get_ident(), (kind_of(op, name), now))
            self.waits.append((kind, begin, now))
            rec = self._by_handle.pop(id(info), None)
            if rec is not None and rec.completed is None:
                rec.completed = now

    def summary(self, t0: float = -float("inf"), t1: float = float("inf"), *,
                complete_by: float | None = None) -> dict[str, dict[str, float]]:
        """Per kind (AG, RS, AR, BC, other): count, bytes, busy_s, sum_s, exposed_s of the
        collectives issued in [t0, t1) (their completion counted up to ``complete_by``) and
        the waits in [t0, t1)."""
        out: dict[str, dict[str, float]] = {}
        limit = float("inf") if complete_by is None else complete_by
        for kind in (*KINDS, "other"):
            recs = [r for r in self.records if r.kind == kind and t0 <= r.issued < t1]
            spans = [(r.issued, r.completed) for r in recs
                     if r.completed is not None and r.completed <= limit]
            waits = [(max(a, t0), min(b, t1)) for k, a, b in self.waits if k == kind and b > t0 and a < t1]
            out[kind] = {
                "count": len(recs),
                "bytes": sum(r.nbytes for r in recs),
                "busy_s": union_length(spans),
                "sum_s": sum(b - a for a, b in spans),
                "exposed_s": sum(b - a for a, b in waits if b > a),
                "incomplete": len(recs) - len(spans),
            }
        return out


def _done(rec: _Record) -> None:
    rec.completed = time.perf_counter()
