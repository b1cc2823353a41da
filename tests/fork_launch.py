"""Launch N ranks of a test worker from one interpreter that imported the heavy modules once.

``python -m tests.fork_launch NPROC PRELOAD MODULE ARGS...``

[Note: forked ranks in tests]
On the 2-core CI machine a rank spends 10-25 s of CPU importing torch, transformers and (for the
DeepSpeed workers) deepspeed before it does anything, and torchrun's agent imports torch once
more: a 4-rank launch paid that five times, and the suite launches dozens. Here the parent
imports them once and forks the ranks, which inherit the modules copy-on-write, as a
DataLoader's forked workers do. The parent only imports: no tensor op, no thread pool, no
process group exists before the fork, so the children start clean and build their gloo groups
themselves from the same environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT=0).

What this launcher is not: torchrun's agent. Tests of the launch path itself (rank failures
propagated by the agent, elastic restarts, signals to the launcher, the rendezvous store) go
through the real ``amsp train`` / torchrun and never through here. Like torchrun it stops the
other ranks when one fails, and a child dies with its parent (PR_SET_PDEATHSIG), so a test's
timeout that kills the launcher leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback

PRELOADS = {
    "torch": ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint"),
    "amsp": ("transformers.models.llama.modeling_llama", "amsp_ext.runtime", "amsp_ext.train.loop"),
    "deepspeed": ("deepspeed",),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _run_rank(rank: int, nproc: int, port: int, module: str, args: list[str]) -> int:
    _die_with_parent()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"})
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _wait_all(pids: dict[int, int]) -> int:
    """torchrun's rule: the job fails with the first failing rank, and the others are stopped."""
    first_bad = 0
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first_bad == 0:
            first_bad = code if code > 0 else 128 - code
            print(f"fork_launch: rank {rank} exited {code}; stopping the others", file=sys.stderr, flush=True)
            for other in pids:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                done, status = os.waitpid(-1, os.WNOHANG)
                if done:
                    pids.pop(done, None)
                else:
                    time.sleep(0.1)
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return first_bad


def main() -> int:
    nproc, preload, module, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    for group in preload.split(","):
        for name in PRELOADS[group]:
            importlib.import_module(name)
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os._exit(_run_rank(rank, nproc, port, module, args))
        pids[pid] = rank
    return _wait_all(pids)


if __name__ == "__main__":
    sys.exit(main())
