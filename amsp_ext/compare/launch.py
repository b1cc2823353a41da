"""Start one system's ranks - under plain torchrun or ``amsp cluster run`` - and collect its row.

Each system runs in its own job (fresh processes), so one system's memory, threads or failure
cannot leak into the next. The command is recorded with the result so every row can be
reproduced on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amsp_ext.reap import JOB_ENV, new_job_id, stop_job
from amsp_ext.compare.config import SYSTEM_TIMEOUT_S, RunSpec
from amsp_ext.tools.rendezvous import loopback_env, loopback_torchrun_args

__all__ = ["LAUNCHERS", "LaunchConfig", "run_compute_only", "run_system", "worker_command"]

LAUNCHERS = ("torchrun", "cluster")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    launcher: str = "torchrun"
    nproc_per_node: int = 4  # torchrun only; the cluster's size comes from `amsp cluster up`
    cluster_name: str = "amsp"
    timeout_s: float = SYSTEM_TIMEOUT_S
    # cluster only: 0 picks a free port in node 0's namespace for every system, so a port a
    # stopped system's straggler still holds is never reused (a reused one fails with EADDRINUSE)
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if not 1 <= self.nproc_per_node <= 8:
            raise ValueError(f"--nproc-per-node (nproc_per_node) must be in 1..8 on this machine, "
                             f"got {self.nproc_per_node}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout (timeout_s) must be > 0 seconds, got {self.timeout_s}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535 (0: a free one), got {self.master_port}")


def worker_command(system: str, spec_path: Path, out: Path, launch: LaunchConfig) -> list[str]:
    return on_ranks(["-m", "amsp_ext.compare.worker", "--spec", str(spec_path), "--system", system,
                     "--out", str(out)], launch)


def on_ranks(worker: list[str], launch: LaunchConfig) -> list[str]:
    """``worker`` (python arguments) run on every rank of ``launch``. On torchrun: node 0 of 1,
    its store on 127.0.0.1 only (tools/rendezvous.py)."""
    if launch.launcher == "torchrun":
        return [sys.executable, "-m", "amsp_ext.tools.rendezvous", *loopback_torchrun_args(),
                f"--nproc-per-node={launch.nproc_per_node}", *worker]
    return [sys.executable, "-m", "amsp_ext.cli", "cluster", "run", "--name", launch.cluster_name,
            "--timeout", str(int(launch.timeout_s)), "--master-port", str(launch.master_port),
            "--", *worker]


def _env(job_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env[JOB_ENV] = job_id  # every process of this system inherits it (amsp_ext/reap.py)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return env


def _failure(out: Path, proc_rc: int | None, log_tail: str, timeout_s: float) -> dict[str, Any]:
    errors = []
    for f in sorted(out.glob("error-rank*.json")):
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if errors:
        # The first rank to fail names the cause; later ones are usually its echo (timeouts).
        first = min(errors, key=lambda e: e.get("time", 0.0))
        return {"status": first["status"], "reason": first["reason"], "failed_rank": first["rank"]}
    if proc_rc is None:
        return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s (no rank reported an error)"}
    last = next((line for line in reversed(log_tail.splitlines()) if line.strip()), "")
    return {"status": "failed", "reason": f"exited {proc_rc} before any rank reported: {last[:300]}"}


def _run_job(cmd: list[str], launch: LaunchConfig, log_path: Path) -> tuple[int | None, list[int]]:
    """Run one job of the launcher's ranks to its end or ``launch.timeout_s``, its output in
    ``log_path``: (exit code, None on timeout; pids still alive when it ended, normally none)."""
    job_id = new_job_id()
    env = loopback_env(_env(job_id)) if launch.launcher == "torchrun" else _env(job_id)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=launch.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # Timed out, failed, finished, or the harness itself stopped (SIGTERM/SIGINT arrive
            # here as an exception): nothing of the job may outlive it.
            left = stop_job(proc.pid if proc.poll() is None else None, job_id)
    return rc, left


def find_cluster_profile(launch: LaunchConfig, *, gpus_per_node: int, out: Path) -> dict[str, Any]:
    """The profile plan "auto" uses on this launcher's cluster (runtime/measure/cluster.py
    [Note: where the measurement runs]): ``amsp profile --cache`` run on its ranks, which find it
    in the cache or measure it there. Returns its ProfileSource as a dict; a failed job raises
    one line."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "cluster-profile.json"
    result.unlink(missing_ok=True)
    cmd = on_ranks(["-m", "amsp_ext.cli", "profile", "--cache", "--ranks-per-node", str(gpus_per_node),
                    "--output", str(result)], launch)
    rc, _ = _run_job(cmd, launch, out / "cluster-profile.log")
    if rc != 0 or not result.exists():
        tail = (out / "cluster-profile.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise ValueError(f"--amsp-profile cluster: measuring this cluster's profile failed "
                         f"({'timed out' if rc is None else f'exit {rc}'}): {tail[0][:300]}; see "
                         f"{out / 'cluster-profile.log'}, or name a profile")
    return json.loads(result.read_text())


def run_system(system: str, spec: RunSpec, out: Path, launch: LaunchConfig,
               *, row_key: str | None = None) -> dict[str, Any]:
    """Run ``system`` and return its raw result (status ok) or status + one-line reason."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("error-rank*.json"), out / "result.json"]:
        stale.unlink(missing_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(spec.to_json() + "\n")
    t0 = time.perf_counter()
    cmd = worker_command(system, spec_path, out, launch)
    base = {"system": system, "key": row_key or system, "command": shlex.join(cmd)}
    rc, left = _run_job(cmd, launch, out / "log.txt")
    base["stragglers_stopped"] = left  # pids still alive when the system ended (normally none)
    wall = time.perf_counter() - t0
    base["wall_s"] = wall
    result_file = out / "result.json"
    if rc == 0 and result_file.exists():
        return {**base, **json.loads(result_file.read_text())}
    tail = (out / "log.txt").read_text(errors="replace")[-4000:]
    return {**base, **_failure(out, rc, tail, launch.timeout_s)}


def run_compute_only(system: str, spec: RunSpec, out: Path, launch: LaunchConfig, *, world_size: int,
                     gpus_per_node: int) -> dict[str, Any]:
    """``system``'s timed steps on ``world_size`` ranks of this machine under the fake process
    group (compare/limit.py [Note: a row's limit]), as ``run_system`` runs it with
    ``gpus_per_node`` ranks per logical node: ``{"status": "ok", "ranks": [...], "command",
    "wall_s"}`` or status + one-line reason. No lab: nothing crosses a link."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("error-rank*.json"), *out.glob("compute-rank*.json")]:
        stale.unlink(missing_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(spec.replace(gpus_per_node=gpus_per_node).to_json() + "\n")
    local = dataclasses.replace(launch, launcher="torchrun", nproc_per_node=world_size)
    cmd = on_ranks(["-m", "amsp_ext.compare.worker", "--spec", str(spec_path), "--system", system,
                    "--out", str(out), "--compute-only"], local)
    t0 = time.perf_counter()
    rc, _ = _run_job(cmd, local, out / "log.txt")
    base = {"command": shlex.join(cmd), "wall_s": time.perf_counter() - t0}
    files = sorted(out.glob("compute-rank*.json"))
    if rc == 0 and len(files) == world_size:
        return {**base, "status": "ok", "ranks": [json.loads(f.read_text()) for f in files]}
    tail = (out / "log.txt").read_text(errors="replace")[-4000:]
    return {**base, **_failure(out, rc, tail, launch.timeout_s)}
