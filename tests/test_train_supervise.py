"""`amsp train` leaves nothing behind: SIGTERM, SIGINT or SIGKILL to the launcher while its ranks
train stops every process of the job within 10 s and removes its temp directory (torchrun's
own temp files included: they live inside it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import REPO

pytestmark = pytest.mark.distributed


def _descendants(root_pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root_pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's reaping is left


@pytest.mark.parametrize("sig", [
    signal.SIGTERM,
    # conftest.py [Note: test tiers]: the launcher forwards SIGINT as it does SIGTERM (_FORWARDED)
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    signal.SIGKILL,
])
def test_signal_to_the_launcher_leaves_no_process_and_no_temp_dir(sig, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "amsp_ext.cli", "train", "--nproc-per-node", "2",
                             "--steps", "100000", "--seq-len", "16", "--micro-batches", "1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job: set[int] = set()
    try:
        for line in proc.stdout:  # rank 0 logs its steps: the whole tree is up and training
            if line.startswith("step"):
                break
        else:
            pytest.fail(f"no step logged: {proc.stderr.read()[-3000:]}")
        job = _descendants(proc.pid)
        assert len(job) >= 3, job  # the agent (torchrun) and two ranks
        assert len(list(tmp.iterdir())) == 1  # the job's temp directory
        proc.send_signal(sig)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        while any(_alive(p) for p in job) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = [p for p in job if _alive(p)]
        assert not left, f"{signal.Signals(sig).name}: still running after 10 s: {left}"
        if sig != signal.SIGKILL:
            assert rc == 128 + sig, rc
            err = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
            assert err[-1] == f"amsp train: error: interrupted by {signal.Signals(sig).name}; the job was stopped"
            if sig == signal.SIGINT:  # Ctrl-C speaks once: no rank prints a KeyboardInterrupt traceback
                assert len(err) == 1, err[-40:]
        while list(tmp.iterdir()) and time.monotonic() - t0 < 10:
            time.sleep(0.1)  # after SIGKILL of the launcher, the agent removes it
        assert list(tmp.iterdir()) == []
    finally:
        for p in [proc.pid, *job, *_descendants(proc.pid)]:  # a failed test must not leave them
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.wait()
