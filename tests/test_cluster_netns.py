"""The real lab (root + iproute2): a 2x2 cluster of network namespaces, a collective across it,
failure and timeout handling, a quick profile, and a teardown that leaves nothing behind.

Runtime about a minute on 2 cores. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAB = "amspt"  # a name of its own, so a user's `amsp` lab is never touched
pytestmark = [pytest.mark.netns, pytest.mark.distributed]


def _why_no_netns() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{LAB}-n99"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _why_no_netns()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=_REASON))


def leftovers(name: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.split("\n")
    found = [line.split()[0] for line in ns if line.startswith(f"{name}-")]
    found += [line.split(":")[1].strip() for line in links if line.count(":") > 1
              and line.split(":")[1].strip().startswith(f"{name}-")]
    return found


def amsp(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amsp_ext.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def lab_env(tmp_path_factory):
    state = tmp_path_factory.mktemp("lab-state")
    env = {**os.environ, "AMSP_CLUSTER_STATE_DIR": str(state), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return env


@pytest.fixture(scope="module")
def lab(lab_env):
    assert not leftovers(LAB), f"lab {LAB} exists before the test; run `amsp cluster down --name {LAB}`"
    up = amsp("cluster", "up", "--name", LAB, "--nodes", "2", "--gpus-per-node", "2",
              "--inter-node-bandwidth", "1gbit", "--subnet", "10.77.250.0/24", env=lab_env, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        yield lab_env
    finally:
        down = amsp("cluster", "down", "--name", LAB, env=lab_env, timeout=60)
        assert down.returncode == 0, down.stderr
        assert leftovers(LAB) == []
        assert not (Path(lab_env["AMSP_CLUSTER_STATE_DIR"]) / f"{LAB}.json").exists()


def test_lab_is_shaped_and_isolated(lab):
    qd = subprocess.run(["tc", "-n", f"{LAB}-n1", "qdisc", "show", "dev", f"{LAB}-eth0"],
                        capture_output=True, text=True).stdout
    assert "tbf" in qd and "rate 1Gbit" in qd
    host_links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"{LAB}-" not in host_links  # nothing in the host's own namespace
    addr = subprocess.run(["ip", "-n", f"{LAB}-n1", "-4", "-o", "addr", "show", f"{LAB}-eth0"],
                          capture_output=True, text=True).stdout
    assert "10.77.250.2/24" in addr


def test_collective_across_the_lab(lab, tmp_path):
    proc = amsp("cluster", "run", "--name", LAB, "--master-port", "29541", "--timeout", "120",
                "--", "tests/lab_worker.py", "lab", env={**lab, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"[node{node} rank{rank}]:CHECK ok lab rank={rank} node={node} sum=10" in proc.stdout
    assert not list(tmp_path.glob("amsp-cluster-run-*"))  # a run that succeeded keeps no logs


def test_a_failing_rank_fails_the_job_fast(lab, tmp_path):
    t0 = time.monotonic()
    proc = amsp("cluster", "run", "--name", LAB, "--master-port", "29542", "--timeout", "120",
                "--", "tests/lab_worker.py", "fail", "3", env={**lab, "TMPDIR": str(tmp_path)})
    took = time.monotonic() - t0
    assert proc.returncode != 0 and "[node1 rank3]:CHECK failing on purpose" in proc.stdout
    assert "failed: " in proc.stdout and took < 60, (took, proc.stdout[-2000:])
    logs = list(tmp_path.glob("amsp-cluster-run-*"))  # a failed run keeps its logs, and says where
    assert len(logs) == 1 and f"(logs: {logs[0]})" in proc.stdout, (logs, proc.stdout[-2000:])
    for i in range(2):
        pids = subprocess.run(["ip", "netns", "pids", f"{LAB}-n{i}"], capture_output=True, text=True).stdout
        assert pids.strip() == "", f"processes left in {LAB}-n{i}: {pids}"


def test_a_hung_job_times_out(lab, tmp_path):
    proc = amsp("cluster", "run", "--name", LAB, "--master-port", "0", "--timeout", "8",  # 0: a free port
                "--", "tests/lab_worker.py", "hang", "3", env={**lab, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 124 and "timed out after 8s" in proc.stdout
    logs = list(tmp_path.glob("amsp-cluster-run-*"))  # kept after a timeout, and named
    assert len(logs) == 1 and f"(logs: {logs[0]})" in proc.stdout, (logs, proc.stdout[-2000:])
    for i in range(2):
        pids = subprocess.run(["ip", "netns", "pids", f"{LAB}-n{i}"], capture_output=True, text=True).stdout
        assert pids.strip() == "", f"processes left in {LAB}-n{i}: {pids}"


@pytest.mark.slow  # ~20 s: measuring over the lab reaches the default tier through test_collective_across_the_lab
def test_quick_profile_on_the_lab(lab, tmp_path):
    out = tmp_path / "lab-2x2.json"
    t0 = time.monotonic()
    proc = amsp("cluster", "run", "--name", LAB, "--master-port", "29544", "--timeout", "170",
                "--", "-m", "amsp_ext.cli", "profile", "--quick", "-o", str(out), env=lab)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert took < 120, f"--quick took {took:.0f}s on the 2x2 lab"
    doc = json.loads(out.read_text())
    md = doc["metadata"]
    assert md["world"] == {"nodes": 2, "gpus_per_node": 2} and md["concurrency"] == "all_groups"
    assert md["link"]["inter_node_bandwidth_bits"] == 10**9 and md["link"]["lab"] == LAB
    w = {(e["op"], e["p0"], e["p1"]): {p["bytes"]: p["GBps"] for p in e["points"]} for e in doc["entries"]}
    assert set(w) == {(op, 2, 1) for op in ("allreduce", "allgather", "reducescatter", "broadcast")} | \
        {(op, 2, 2) for op in ("allreduce", "allgather", "reducescatter", "broadcast")} | \
        {("allreduce", 1, 2), ("broadcast", 1, 2)}
    big = 16 << 20
    # Physics, not code: in the 1x2 all-reduce both groups cross at once; each rank sends v over
    # its node's 1 Gbit/s link, shared by 2 ranks, so algbw <= 125e6 / 2 B/s (+ tbf burst slack).
    assert w[("allreduce", 1, 2)][big] <= 0.0625 * 1.15
    assert w[("allreduce", 2, 1)][big] > 2 * w[("allreduce", 1, 2)][big]  # inside a node is faster
    assert "alpha (us)" in proc.stdout
    check_with_planner_loader(out)


def test_set_changes_a_running_labs_links(lab):
    def rates():
        node = subprocess.run(["tc", "-n", f"{LAB}-n1", "qdisc", "show", "dev", f"{LAB}-eth0"],
                              capture_output=True, text=True).stdout
        fab = subprocess.run(["tc", "-n", f"{LAB}-fab", "qdisc", "show", "dev", f"{LAB}-v1"],
                             capture_output=True, text=True).stdout
        return node, fab

    try:
        proc = amsp("cluster", "set", "--name", LAB, "--inter-node-bandwidth", "50mbit", env=lab, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert all("rate 50Mbit" in r for r in rates()), rates()
        status = json.loads(amsp("cluster", "status", "--name", LAB, env=lab, timeout=60).stdout)
        assert status["state"]["link"]["inter_node_bandwidth_bits"] == 50_000_000
    finally:
        back = amsp("cluster", "set", "--name", LAB, "--inter-node-bandwidth", "1gbit", env=lab, timeout=60)
        assert back.returncode == 0, back.stderr
    assert all("rate 1Gbit" in r for r in rates())
    bad = amsp("cluster", "set", "--name", "amspnone", "--inter-node-bandwidth", "50mbit", env=lab, timeout=60)
    assert bad.returncode == 2 and "lab 'amspnone' is not up" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def check_with_planner_loader(path: Path) -> None:
    """The planner's loader accepts the profile and `amsp plan` uses it."""
    from amsp_ext.planner.profile import load_profile

    assert load_profile(path).concurrency == "all_groups"
    from test_profile_to_plan import PLAN_ARGS, assert_shards_stay_inside_a_node

    proc = subprocess.run([sys.executable, "-m", "amsp_ext.cli", *PLAN_ARGS, "--gpu-memory", "40GiB",
                           "--profile", str(path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_shards_stay_inside_a_node(json.loads(proc.stdout))


def test_down_clears_a_crashed_lab(lab_env):
    name = "amspu"
    up = amsp("cluster", "up", "--name", name, "--nodes", "2", "--gpus-per-node", "1",
              "--inter-node-bandwidth", "100mbit", "--nodes-per-leaf", "1", "--spine-bandwidth", "50mbit",
              env=lab_env, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        assert len(leftovers(name)) == 3  # fab, n0, n1
        (Path(lab_env["AMSP_CLUSTER_STATE_DIR"]) / f"{name}.json").unlink()  # the "crash"
        again = amsp("cluster", "up", "--name", name, "--nodes", "2", "--gpus-per-node", "1",
                     "--inter-node-bandwidth", "100mbit", env=lab_env, timeout=60)
        assert again.returncode == 2 and "leftovers" in again.stderr
    finally:
        down = amsp("cluster", "down", "--name", name, env=lab_env, timeout=60)
    assert down.returncode == 0 and "netns amspu-fab" in down.stdout
    assert leftovers(name) == []
    twice = amsp("cluster", "down", "--name", name, env=lab_env, timeout=60)
    assert twice.returncode == 0 and "nothing" in twice.stdout
