"""Launch a tiny gloo job from a test, with a hard timeout and the output on failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_ranks(nproc: int, module: str, *args: str, timeout: float = 300, env: dict | None = None,
              check: bool = True, preload: str = "torch,amsp") -> subprocess.CompletedProcess:
    """``python -m module args`` on ``nproc`` gloo ranks, forked by tests/fork_launch.py from one
    interpreter that imported ``preload`` once (see [Note: forked ranks in tests]); the repo on
    PYTHONPATH. Tests of the launch path itself use the real ``amsp train`` / torchrun."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "tests.fork_launch", str(nproc), preload, module, *args]
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


def start_case_worker(cases) -> tuple[int, list[str], list[str], float]:
    """Start of a worker run as ``python -m WORKER GPUS_PER_NODE PLAN[;PLAN...] [CASE,...]``:
    the gloo group up; ``(gpus_per_node, plans, case names, start time)``."""
    import time

    import torch.distributed as dist

    gpus_per_node, plans = int(sys.argv[1]), sys.argv[2].split(";")
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(cases)
    dist.init_process_group("gloo")
    return gpus_per_node, plans, names, time.perf_counter()


def end_worker(t0: float) -> None:
    """End of a torchrun worker: rank 0 prints its DONE line, then every rank leaves together."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"DONE {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def script_env(site_dir: Path) -> dict:
    """The environment for launching a third-party-style script as a user would: no AMSP_* or
    ACCELERATE_* variable, one thread per rank, the repo importable.

    [Note: the start-up hook in tests]
    The routes need ``amsp_ext_startup.pth`` in site-packages (``pip install -e .`` puts it
    there; test_integrations_units checks the packaging). Where this interpreter has no such file
    (a dev checkout on PYTHONPATH), ``site_dir`` gets a ``sitecustomize`` that runs the repo's
    copy of its line - what site.py does with an installed .pth."""
    import site

    # the suite's own profile cache stays (conftest.py): a user's is never written by a test
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AMSP_", "ACCELERATE_")) or k == "AMSP_PROFILE_CACHE"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    paths = [str(REPO)]
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    if not any((Path(d) / "amsp_ext_startup.pth").is_file() for d in dirs):
        pth = REPO / "amsp_ext" / "integrations" / "amsp_ext_startup.pth"
        site_dir.mkdir(parents=True, exist_ok=True)
        (site_dir / "sitecustomize.py").write_text(f"exec(open({str(pth)!r}).read())\n")
        paths.insert(0, str(site_dir))
    env["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
    return env


def run_script(cmd: list[str], env: dict, cwd, *, timeout: float = 400,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run a launcher command; on failure (when ``check``) the assertion carries its output."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(map(str, cmd))} timed out after {timeout}s") from e
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def free_plan_groups(mesh) -> None:
    """End of a test case inside a worker: destroy the plan's process groups (the runtime's
    destroy_plan_mesh) and forget DTensor's cached sharding decisions.

    [Note: freeing a case's groups in a worker]
    Kept, every case's groups (at most 7 on 2 x 2, each with gloo threads) pile up over a launch and slow every
    later case. Freed alone, a later case whose mesh has the same layout fails in DTensor
    (``full_tensor``: "Could not resolve the process group registered under the name 15"):
    DeviceMesh compares equal by layout, so DTensor's sharding-propagation caches (a Python
    LRU cache and the C++ dispatch fast path's) hand back output specs holding the freed mesh.
    Clearing both caches after the destroy fixes it (2 ranks, p=2x1 three times in a row with
    consolidated_state_dict each time: fails without the clear, passes with it, torch 2.13)."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    from amsp_ext.topology.mesh import destroy_plan_mesh

    destroy_plan_mesh(mesh)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    # the engines of earlier cases sit in reference cycles (hooks <-> modules) that hold their
    # groups' gloo contexts and threads until a full collection
    gc.collect()
