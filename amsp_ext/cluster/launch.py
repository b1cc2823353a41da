"""``amsp cluster run``: one torchrun per lab node, inside that node's namespace.

[Note: what each node gets]
Node ``i`` runs ``ip netns exec <name>-n<i> python -m torch.distributed.run --nnodes N
--nproc-per-node R --node-rank i --master-addr <node 0's address> --master-port P ...`` (static
rendezvous, so global rank = i * R + local rank, the order :mod:`amsp_ext.topology.groups`
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

__all__ = ["NodeLaunch", "node_launches", "run_on_lab"]

TIMEOUT_EXIT = 124
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
            python, "-m", "torch.distributed.run",
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


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        if all(p.poll() is not None for p in procs):
            return


def run_on_lab(spec: LabSpec, command: Sequence[str], *, state_file: str, master_port: int = 29500,
               timeout_s: float = 1800.0, log_dir: str | None = None, sink: TextIO = sys.stdout) -> int:
    """Start the nodes, stream their prefixed output to ``sink``, return the job's exit status."""
    if timeout_s <= 0:
        raise LabError(f"cluster run: --timeout must be > 0 seconds, got {timeout_s}")
    # [Note: the run's log folder]
    # torchrun's --log-dir keeps each rank's output; it matters only when something failed. A
    # folder this function made is removed after a run where every node exited 0, and kept
    # (its path printed) after a failure or a timeout. A folder the caller named is its own.
    made_log_dir = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix="amsp-cluster-run-")
    launches = node_launches(spec, command, master_port=master_port, state_file=state_file, log_dir=log_dir)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for launch in launches:
            p = subprocess.Popen(
                launch.argv, env={**os.environ, **launch.env}, stdout=subprocess.PIPE,
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
                _stop(procs)
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
    finally:
        _stop(procs)
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
