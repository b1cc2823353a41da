"""A single-machine `amsp train` listens on loopback only (tools/rendezvous.py, [Note: no server
on every interface]): while a 2-rank run trains, every LISTEN socket of its process tree (the
launcher, torchrun's agent, the ranks), read from /proc/net/tcp{,6} and /proc/<pid>/fd, is bound
to 127.0.0.1 (or ::1). The reference is the kernel's socket table, not the code's own account."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import REPO

pytestmark = pytest.mark.distributed


def _descendants(root: int) -> set[int]:
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = {root}, [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        todo.extend(kids)
    return out


def _socket_inodes(pids) -> set[str]:
    out = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    out.add(link[8:-1])
        except OSError:
            continue
    return out


def _listening() -> dict[str, str]:
    """inode -> local address (hex as in /proc) of every LISTEN TCP socket."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                out[f[9]] = f[1]
    return out


def _loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:  # IPv4, little-endian: 127.x.x.x ends with 7F
        return ip[-2:] == "7F"
    # IPv6: four little-endian 32-bit words; ::1, or ::ffff:127.x.x.x
    return ip == "00000000000000000000000001000000" or (ip[:24] == "0000000000000000FFFF0000"
                                                        and ip[-2:] == "7F")


def test_loopback_parser_can_fail():
    assert _loopback("0100007F:1F90") and not _loopback("00000000:1F90")
    assert not _loopback("00000000000000000000000000000000:A77B")  # '::', what torch binds by default
    assert _loopback("00000000000000000000000001000000:A77B")  # ::1
    assert _loopback("0000000000000000FFFF00000100007F:A77B") and not _loopback("0000000000000000FFFF00000A00000A:1")


def test_single_machine_train_listens_on_loopback_only(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "amsp_ext.cli", "train", "--nproc-per-node", "2",
                             "--steps", "6", "--seq-len", "32", "--micro-batch-size", "2", "--json"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, str] = {}  # inode -> address of a LISTEN socket the run owned
    num_pids = 0
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        pids = _descendants(proc.pid)
        num_pids = max(num_pids, len(pids))
        mine = _socket_inodes(pids)
        seen.update({i: a for i, a in _listening().items() if i in mine})
        time.sleep(0.1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert num_pids >= 4, num_pids  # launcher, agent, 2 ranks: the scan saw the whole tree
    assert len(seen) >= 2, seen  # the rendezvous store and rank 0's store at least
    outside = sorted(a for a in seen.values() if not _loopback(a))
    assert not outside, (outside, seen)
