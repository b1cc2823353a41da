"""Across machines, node 0's rendezvous store listens on the master address the user gave, not on
every interface (tools/rendezvous.py, [Note: a static rendezvous bound to the master address]).
On one machine: the ``amsp-static`` handler for master address 127.0.0.2 (a loopback alias, so a
"master address" that is not the usual 127.0.0.1) is checked in the kernel's socket table
(/proc/net/tcp{,6}); torch's own static handler, given the same address, is the negative control
(it listens on every interface)."""

from __future__ import annotations

import os
import socket

import pytest
from test_loopback import _listening, _socket_inodes


def _free_port(host="127.0.0.2") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bound_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc) of this process's LISTEN sockets on ``port``."""
    mine = _socket_inodes([os.getpid()])
    return {addr.split(":")[0] for inode, addr in _listening().items()
            if inode in mine and int(addr.split(":")[1], 16) == port}


def _params(port, backend):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend=backend, endpoint=f"127.0.0.2:{port}", run_id="t", min_nodes=1,
                                max_nodes=1, rank=0, timeout=30)


def test_amsp_static_store_listens_on_the_master_address_only():
    from amsp_ext.tools.rendezvous import BOUND_BACKEND, bound_static_handler

    port = _free_port()
    h = bound_static_handler(_params(port, BOUND_BACKEND))
    info = h.next_rendezvous()
    info.store.set("k", "v")
    assert info.rank == 0 and info.world_size == 1 and info.bootstrap_store_info.master_port == port
    assert _bound_addresses(port) == {"0200007F"}  # 127.0.0.2, little-endian
    h.shutdown()


def test_torch_static_store_listens_everywhere_negative_control():
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    port = _free_port()
    h = create_rdzv_handler(_params(port, "static"))
    h.next_rendezvous()
    got = _bound_addresses(port)
    assert got and got != {"0200007F"} and all(set(a) == {"0"} for a in got), got  # 0.0.0.0 / ::


def test_torchrun_flags_become_the_bound_backend():
    from amsp_ext.tools.rendezvous import bound_torchrun_args

    got = bound_torchrun_args(["--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=10.9.0.1",
                               "--master-port=29555", "--tee=3", "-m", "amsp_ext.cli", "profile", "--node-rank=7"])
    assert got == ["--rdzv-backend=amsp-static", "--rdzv-endpoint=10.9.0.1:29555", "--rdzv-conf=rank=1",
                   "--nnodes=2", "--nproc-per-node=4", "--tee=3", "-m", "amsp_ext.cli", "profile", "--node-rank=7"]
    with pytest.raises(ValueError, match="--master-addr"):
        bound_torchrun_args(["--nnodes=2", "--node-rank=0", "--master-port=1", "x.py"])


def test_single_machine_launchers_use_the_static_rendezvous(tmp_path):
    """No launcher uses torchrun's c10d rendezvous, whose agents unpickle the store's state
    ([Note: no pickle in a launch]): amsp train's agent and amsp compare's systems run torchrun
    as node 0 of 1 of amsp-static, the store on 127.0.0.1."""
    from amsp_ext.compare.launch import LaunchConfig, worker_command
    from amsp_ext.tools.rendezvous import bound_torchrun_args, loopback_torchrun_args

    args = loopback_torchrun_args()
    got = bound_torchrun_args([*args, "--nproc-per-node=2", "-m", "amsp_ext.train"])
    port = int(args[-1].split("=")[1])
    assert got == ["--rdzv-backend=amsp-static", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=rank=0",
                   "--nnodes=1", "--nproc-per-node=2", "-m", "amsp_ext.train"] and 0 < port < 65536
    cmd = worker_command("ddp", tmp_path / "spec.json", tmp_path, LaunchConfig(launcher="torchrun", nproc_per_node=2))
    assert cmd[1:3] == ["-m", "amsp_ext.tools.rendezvous"] and "--master-addr=127.0.0.1" in cmd, cmd
    assert not [a for a in cmd if "c10d" in a or a == "--standalone"], cmd


def test_cluster_nodes_launch_through_the_bound_torchrun(tmp_path):
    from amsp_ext.cluster.lab import LabSpec
    from amsp_ext.cluster.launch import node_launches

    spec = LabSpec(name="amspt", num_nodes=2, gpus_per_node=1, inter_node_bandwidth="1gbit")
    for n in node_launches(spec, ["-m", "x"], master_port=29555, state_file=str(tmp_path / "s"),
                           log_dir=str(tmp_path)):
        i = n.argv.index("-m")
        assert n.argv[i + 1] == "amsp_ext.tools.rendezvous", n.argv
        assert "--master-port=29555" in n.argv


@pytest.mark.distributed
def test_two_ranks_meet_through_the_bound_store(tmp_path):
    """2 ranks (CPU lock) launched by ``python -m amsp_ext.tools.rendezvous`` with master address
    127.0.0.2: they all-reduce, and the only socket listening on the master port is on 127.0.0.2."""
    import json
    import subprocess
    import sys

    from dist_utils import REPO

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    p = subprocess.run([sys.executable, "-m", "amsp_ext.tools.rendezvous", "--nnodes=1", "--nproc-per-node=2",
                        "--node-rank=0", "--master-addr=127.0.0.2", f"--master-port={port}",
                        str(REPO / "tests" / "bound_rdzv_worker.py")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert r["sum"] == 3.0 and r["master"] == "127.0.0.2" and r["agent_store"] == "True", r
    assert r["addrs"] == ["0200007F"], r
