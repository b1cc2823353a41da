"""The engine's exit handler (collectives.py [Note: process groups torn down at exit]).

1. A script that never calls destroy_process_group() exits with no live group. The probe's
   atexit handler is registered before ``shard``, so it runs after the engine's (atexit is
   last in, first out) and sees what the engine's left.
2. It then waits, with the GIL released, for gloo's worker threads to go idle. The abort
   that prevents is a race (a worker thread releasing a finished collective after the
   interpreter began finalizing: 5 runs in 32 of tests/scripts/exit_race.py on a loaded
   machine aborted without the wait, 0 in 40 with it). A race cannot be forced in a test, so
   these tests check the wait's contract on a stand-in: a thread that the OS knows by gloo's
   worker name and that keeps running for a known time.
"""

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from amsp_ext.runtime import collectives as C

SCRIPT = r"""
import atexit, sys
import torch, torch.distributed as dist
import amsp_ext

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
sub = dist.new_group([0])
atexit.register(lambda: print("live at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "shard":
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model, opt = amsp_ext.shard(model, "ddp", lambda ps: torch.optim.SGD(ps, lr=0.1))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
print("done", flush=True)
"""


def _exit_state(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_groups_destroyed_at_exit_after_shard():
    # the same script without the engine keeps its groups to the end: the probe can tell
    assert "live at exit: True" in _exit_state("plain")
    out = _exit_state("shard")
    assert "done" in out and "live at exit: False" in out, out


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")

PR_SET_NAME = 15


def _gloo_named_spinner(seconds: float, started: threading.Event, done: list[float]) -> threading.Thread:
    """A thread the OS calls ``pt_gloo_runloop`` (gloo's worker name) that computes for ``seconds``."""

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_SET_NAME, b"pt_gloo_runloop", 0, 0, 0) == 0
        started.set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        done.append(time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(5)
    return t


@needs_proc
def test_waits_until_a_running_gloo_worker_is_idle():
    started, done = threading.Event(), []
    t = _gloo_named_spinner(0.3, started, done)
    assert C._gloo_workers_running() is True
    assert C.drain_gloo_workers(max_s=5.0) is True
    returned = time.monotonic()
    t.join(5)
    assert done and done[0] <= returned, "the wait returned while the gloo-named thread still ran"
    assert C._gloo_workers_running() is False


@needs_proc
def test_returns_at_once_when_no_gloo_worker_runs():
    t0 = time.monotonic()
    assert C.drain_gloo_workers(max_s=5.0) is True
    assert time.monotonic() - t0 < 1.0  # two 10 ms polls, with slack for a loaded machine


@needs_proc
def test_gives_up_after_its_bound():
    started, done = threading.Event(), []
    t = _gloo_named_spinner(3.0, started, done)
    t0 = time.monotonic()
    assert C.drain_gloo_workers(max_s=0.2) is False
    assert time.monotonic() - t0 < 2.0
    assert not done, "the bound was not what ended the wait"
    t.join(5)


def test_the_handler_is_registered_once():
    import atexit

    calls = []
    real_register, real_unregister = atexit.register, atexit.unregister
    try:
        atexit.register = lambda fn: calls.append(("register", fn))
        atexit.unregister = lambda fn: calls.append(("unregister", fn))
        C.destroy_groups_at_exit()
        C.destroy_groups_at_exit()
    finally:
        atexit.register, atexit.unregister = real_register, real_unregister
    assert [c[0] for c in calls] == ["unregister", "register"] * 2
    assert {c[1] for c in calls} == {C._teardown_at_exit}
