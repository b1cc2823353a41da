"""Launch a tiny gloo job with torchrun from a test, with a hard timeout and the output on failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(nproc: int, module: str, *args: str, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m module args`` with the repo on PYTHONPATH."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *args]
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"{module} on {nproc} ranks timed out after {timeout}s\n{out[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{module} on {nproc} ranks exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def end_worker(t0: float) -> None:
    """End of a torchrun worker: rank 0 prints its DONE line, then every rank leaves together."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"DONE {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
