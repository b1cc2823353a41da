"""The one process reaper: stop a launched job and everything it started, wherever it ran.

A leaf module (psutil only): the lab (cluster/), ``amsp train``'s supervisor (train/supervise.py)
and the comparison harness (compare/launch.py) all stop their jobs with :func:`stop_job` and
give them the same :data:`GRACE_S`, so no two launchers disagree on how long a rank may take to
clean up.

[Note: why a process group is not enough]
torchrun starts every worker with ``start_new_session=True`` (torch's elastic subprocess
handler), so the workers are *not* in the launcher's process group: ``killpg`` on the launcher
stops torchrun alone, and a SIGKILLed torchrun leaves its workers running, re-parented to init
(a stray DDP worker that keeps computing inside the lab's namespaces holds the master port,
and every later job fails with EADDRINUSE). Two nets catch them:
- the tree: every descendant of the launcher, snapshotted *before* the first signal (after it,
  a dead torchrun's workers are no longer its children) and again while waiting;
- a marker: the launcher's environment carries ``AMSP_JOB_ID=<unique id>``, which torchrun,
  ``ip netns exec`` and the workers all inherit; afterwards every process of this user whose
  ``/proc/<pid>/environ`` holds that id is stopped too. ``ip netns exec`` changes the network
  namespace only, not the PID namespace, so this reaches the ranks of every lab node.
SIGTERM first (torchrun and the ranks clean up), SIGKILL to whatever is left after the grace.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import psutil

__all__ = ["GRACE_S", "JOB_ENV", "marked", "new_job_id", "stop_job"]

JOB_ENV = "AMSP_JOB_ID"
# SIGTERM -> SIGKILL. Long enough for torchrun to pass SIGTERM on and for a rank to write its
# one-line error (train/supervise.py [Note: one line on failure]); short enough that an
# interrupted job is gone within 10 s.
GRACE_S = 6.0
_REAP_WAIT_S = 5.0  # after SIGKILL: the kernel frees a killed process at once; only a D-state one waits


def new_job_id() -> str:
    return uuid.uuid4().hex


def marked(job_id: str) -> list[psutil.Process]:
    """Processes whose environment carries ``AMSP_JOB_ID=job_id`` (ours; others' are unreadable)."""
    needle = f"{JOB_ENV}={job_id}".encode()
    me = os.getpid()
    out = []
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    return out


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(procs, sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def stop_job(pid: int | None, job_id: str | None = None, *, pids: tuple[int, ...] = (),
             grace_s: float = GRACE_S, signalled: bool = False) -> list[int]:
    """Stop ``pid``'s whole tree, every process marked with ``job_id`` and the trees of
    ``pids`` (processes found another way: the lab's ``ip netns pids``); return the pids that
    were still alive when asked to stop (SIGTERM, then SIGKILL after ``grace_s``).
    ``signalled``: the caller already sent the first signal (amsp train forwards the user's
    SIGINT as it is), so only the grace and the SIGKILL remain."""
    known: dict[int, psutil.Process] = {}
    roots = ([pid] if pid else []) + [p for p in pids if p != os.getpid()]

    def collect() -> None:
        for p in [q for r in roots for q in _tree(r)] + (marked(job_id) if job_id else []):
            known.setdefault(p.pid, p)

    collect()
    stopped = sorted(known)
    if not signalled:
        _signal(list(known.values()), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        collect()  # a launcher may start a child between snapshot and signal
        if not any(_alive(p) for p in known.values()):
            break
        time.sleep(0.1)
    collect()
    _signal([p for p in known.values() if _alive(p)], signal.SIGKILL)
    psutil.wait_procs(list(known.values()), timeout=_REAP_WAIT_S)
    return stopped
