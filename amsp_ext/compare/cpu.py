"""CPU seconds a rank's threads use per step: its training thread and every other thread (gloo's
workers and transport, DeepSpeed's and the profiler's helpers), from the kernel's per-thread
counters.

[Note: CPU time beside wall time]
On a host where the ranks share cores (the lab: 4 ranks on 2), a step's wall time mixes work with
waiting for a core: a rank that waits for its communication leaves its core to the others, a rank
that computes while its communication is in flight does not, so a row that overlaps more can
take longer outside its exposed communication without doing more work. CPU seconds per thread
tell the two apart: the training thread's (forward, backward, hooks, bucket copies, optimizer;
CPU autograd runs on the calling thread) and the other threads' (gloo's reductions and the
kernel's TCP work for them, mostly). ``utime + stime`` of ``/proc/self/task/<tid>/stat``, in
clock ticks (10 ms on Linux): one step's figure is coarse, its median over the timed steps and
the ranks is not. Softirq time for received packets is charged to whichever thread the kernel
interrupted, so the split between the two is approximate. None where ``/proc`` has no task list
(not Linux).
"""

from __future__ import annotations

import os
import threading

__all__ = ["step_cpu", "thread_cpu_s"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_s() -> dict[int, float] | None:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def step_cpu(before: dict[int, float] | None, after: dict[int, float] | None) -> dict[str, float] | None:
    """CPU seconds between two ``thread_cpu_s`` readings of the calling thread (``main``) and of
    all the others (``other``; a thread that ended in between is left out)."""
    if before is None or after is None:
        return None
    me = threading.get_native_id()
    used = {tid: after.get(tid, t0) - t0 for tid, t0 in before.items()}
    used.update({tid: t for tid, t in after.items() if tid not in before})
    main = used.pop(me, 0.0)
    return {"main": main, "other": sum(used.values())}
