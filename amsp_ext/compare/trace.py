"""Exposed communication time from a ``torch.profiler`` trace of one training step (CPU, gloo).

[Note: definition on CPU]
On a GPU, exposed communication is the time communication kernels run while no compute kernel
does. On CPU with gloo the analogue is threads: collectives execute on gloo's worker threads
(``gloo:<op>`` events) and the training threads (main and autograd) run the ``aten::`` ops. A
synchronous collective shows up twice - ``c10d::<op>`` on the training thread, blocked, and
``gloo:<op>`` on a worker - and an async one as a short ``c10d::`` launch plus the worker's
``gloo:`` span. We take

    communication = union(gloo:* spans, c10d::* spans)
    compute       = union(aten::* spans on training threads) minus union(c10d::* spans)
    exposed       = |communication minus compute|

i.e. the wall time during which communication is in flight and the training threads are not
computing. Python overhead between ops counts as "not computing", so this slightly over-states
exposure; a trace of one step after the timed steps is used so the profiler does not perturb
the throughput numbers. ``amsp::*`` labels are not used to classify (they also wrap hooks).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["comm_breakdown", "subtract", "total", "union"]

Interval = tuple[float, float]

COMM_WORKER_PREFIXES = ("gloo:", "nccl:")
COMM_API_PREFIXES = ("c10d::", "c10d_functional::", "_c10d_functional::")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(base: list[Interval], cut: list[Interval]) -> list[Interval]:
    """``base`` minus ``cut``; both must be unions (sorted, disjoint)."""
    out: list[Interval] = []
    j = 0
    for a, b in base:
        start = a
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def total(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def comm_breakdown(events) -> dict[str, float]:
    """Seconds of communication and of exposed communication in the profiled events.

    ``events``: ``prof.events()`` (FunctionEvent with ``name``, ``thread``, ``time_range``), or
    any objects with those attributes.
    """
    worker, api, aten = [], [], []
    comm_threads = {e.thread for e in events if e.name.startswith(COMM_WORKER_PREFIXES)}
    for e in events:
        span = (e.time_range.start, e.time_range.end)  # microseconds
        if e.name.startswith(COMM_WORKER_PREFIXES):
            worker.append(span)
        elif e.name.startswith(COMM_API_PREFIXES):
            api.append(span)
        elif e.name.startswith("aten::") and e.thread not in comm_threads:
            aten.append(span)
    comm = union(worker + api)
    compute = subtract(union(aten), union(api))
    exposed = subtract(comm, compute)
    return {"comm_s": total(comm) * 1e-6, "exposed_comm_s": total(exposed) * 1e-6,
            "compute_s": total(compute) * 1e-6}
