"""``amsp cluster run``: one torchrun per lab node, inside that node's namespace.

[Note: what each node gets]
Node ``i`` runs ``ip netns exec <name>-n<i> python -m amsp_ext.tools.rendezvous --nnodes N
--nproc-per-node R --node-rank i --master-addr <node 0's address> --master-port P ...``: torchrun
with its static rendezvous, node 0's store listening on that address only (tools/rendezvous.py,
[Note: a static rendezvous bound to the master address]; static rendezvous, so global rank = i * R + local rank, the order :mod:`amsp_ext.topology.groups`
assumes). Its environment names the lab interface for gloo and NCCL socket traffic, and sets
``NCCL_HOSTID`` per node: the namespaces share one host, and without it NCCL would see one host
and move "cross-node" bytes over shared memory/P2P, bypassing the shaped link.
``AMSP_CLUSTER_STATE`` (the lab's state file) and ``AMSP_CLUSTER_LINK`` (its link settings as
JSON) let a program such as ``amsp profile`` record the link it ran on.

[Note: output and failure]
torchrun tees every worker's stdout/stderr with a ``[node<i> rank<g>]:`` prefix (through
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``); lines of the agent itself get ``[node<i>]``. If any
node exits non-zero, the others are given a short grace period and then stopped, since their
ranks would otherwise wait in a collective until its timeout. The overall ``timeout`` stops
everything and returns 124, like coreutils' ``timeout``.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from amsp_ext.cluster.lab import Lab, LabError, LabSpec
from amsp_ext.reap import JOB_ENV, new_job_id, stop_job

__all__ = ["NodeLaunch", "node_launches", "run_on_lab"]

TIMEOUT_EXIT = 124
# `amsp cluster run`'s wall clock for a whole job (not a collective's timeout): a profile or a
# comparison on the 2x2 lab finishes well within it, a hung one is stopped and returns 124
JOB_TIMEOUT_S = 1800.0
# Not the reaper's grace (reap.GRACE_S): how long the other nodes may keep running after one
# failed, so that their own one-line errors reach the log before they are stopped.
FAIL_FAST_GRACE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class NodeLaunch:
    node: int
    argv: list[str]
    env: dict[str, str]  # added to the caller's environment


def torchrun_program(command: Sequence[str]) -> list[str]:
    """How torchrun should start ``command``: a script, ``-m module``, or any executable."""
    cmd = list(command)
    if not cmd:
        raise LabError("cluster run: give the command after '--', e.g. `amsp cluster run -- -m amsp_ext.cli profile --quick`")
    if os.path.basename(cmd[0]).startswith("python") and len(cmd) > 1:
        cmd = cmd[1:]  # torchrun starts workers with its own interpreter, the same one
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return cmd
    return ["--no-python", *cmd]


def node_launches(spec: LabSpec, command: Sequence[str], *, master_port: int, state_file: str,
                  log_dir: str, python: str = sys.executable) -> list[NodeLaunch]:
    lab = Lab(spec=spec)
    program = torchrun_program(command)
    link = json.dumps(lab.link_settings(), sort_keys=True)
    out = []
    for i in range(spec.num_nodes):
        argv = [
            "ip", "netns", "exec", lab.node_ns(i),
            python, "-m", "amsp_ext.tools.rendezvous",  # torchrun, node 0's store on the master address
            f"--nnodes={spec.num_nodes}", f"--nproc-per-node={spec.gpus_per_node}",
            f"--node-rank={i}", f"--master-addr={lab.master_address}", f"--master-port={master_port}",
            "--tee=3", f"--log-dir={Path(log_dir) / f'node{i}'}",
            *program,
        ]
        env = {
            "GLOO_SOCKET_IFNAME": lab.node_ifname,
            "NCCL_SOCKET_IFNAME": lab.node_ifname,
            "NCCL_HOSTID": lab.node_ns(i),
            "NCCL_IB_DISABLE": "1",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[node{i} rank${{rank}}]:",
            "PYTHONUNBUFFERED": "1",
            "AMSP_CLUSTER_STATE": state_file,
            "AMSP_CLUSTER_LINK": link,
            "AMSP_CLUSTER_NODE": str(i),
        }
        out.append(NodeLaunch(node=i, argv=argv, env=env))
    return out


def _pump(node: int, stream: TextIO, sink: TextIO, lock: threading.Lock) -> None:
    own = f"[node{node} rank"
    for line in stream:
        text = line if line.startswith(own) else f"[node{node}] {line}"
        with lock:
            sink.write(text)
            sink.flush()


def _stop(procs: list[subprocess.Popen], job_id: str) -> None:
    """Every node's torchrun and its ranks (in sessions of their own: amsp_ext/reap.py)."""
    running = [p for p in procs if p.poll() is None]
    for p in running[1:]:
        stop_job(p.pid, None)
    stop_job(running[0].pid if running else None, job_id)


def free_port(namespace: str) -> int:
    """A port the kernel calls free in ``namespace`` (node 0's: where the rendezvous listens)."""
    probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        raise LabError(f"cluster run: could not find a free port in {namespace}: {out.stderr.strip()[:200]}")
    return int(out.stdout.strip())


class _Stopped(Exception):
    """SIGTERM/SIGHUP while the job ran: the nodes are stopped on the way out."""


def _raise_stopped(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Stopped(signal.Signals(signum).name)


def run_on_lab(spec: LabSpec, command: Sequence[str], *, state_file: str, master_port: int = 29500,
               timeout_s: float = JOB_TIMEOUT_S, log_dir: str | None = None, sink: TextIO = sys.stdout) -> int:
    """Start the nodes, stream their prefixed output to ``sink``, return the job's exit status."""
    if timeout_s <= 0:
        raise LabError(f"cluster run: --timeout must be > 0 seconds, got {timeout_s}")
    # [Note: the run's log folder]
    # torchrun's --log-dir keeps each rank's output; it matters only when something failed. A
    # folder this function made is removed after a run where every node exited 0, and kept
    # (its path printed) after a failure or a timeout. A folder the caller named is its own.
    made_log_dir = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix="amsp-cluster-run-")
    if master_port == 0:
        master_port = free_port(Lab(spec=spec).node_ns(0))
    launches = node_launches(spec, command, master_port=master_port, state_file=state_file, log_dir=log_dir)
    # every rank of every node carries the id, so a straggler is found wherever it runs
    job_id = os.environ.get(JOB_ENV) or new_job_id()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_stopped)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for launch in launches:
            p = subprocess.Popen(
                launch.argv, env={**os.environ, **launch.env, JOB_ENV: job_id}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
            )
            procs.append(p)
            t = threading.Thread(target=_pump, args=(launch.node, p.stdout, sink, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                _stop(procs, job_id)
                with lock:
                    sink.write(f"[cluster] timed out after {timeout_s:g}s; stopped all nodes (logs: {log_dir})\n")
                return TIMEOUT_EXIT
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > FAIL_FAST_GRACE_S:
                with lock:
                    sink.write("[cluster] a node failed; stopping the others\n")
                break  # the finally below stops them
            time.sleep(0.1)
    except _Stopped as e:
        with lock:
            sink.write(f"[cluster] {e}: stopping all nodes (logs: {log_dir})\n")
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        _stop(procs, job_id)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
    codes = [p.returncode for p in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    with lock:
        if bad:
            sink.write("[cluster] failed: " + ", ".join(f"node{i} exit {c}" for i, c in bad)
                       + f" (logs: {log_dir})\n")
        else:
            sink.write(f"[cluster] all {len(procs)} node(s) exited 0\n")
    if not bad:
        if made_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    first = bad[0][1]
    return first if first > 0 else 128 - first  # killed by a signal -> 128 + signum
