"""`auto` plans for the cluster it runs on (issue 40): the profile is measured in the job once,
cached per cluster fingerprint, reused, re-measured when the cache entry is damaged, stale or of
another cluster, and every run says which cluster planned it."""

import json
import time

import pytest

from amsp_ext.planner.profile import load_profile
from amsp_ext.topology import profile_cache as pc

from test_train_cli import amsp

# tiny-llama's job, small: the memory is given so the launcher and `amsp plan` plan the same job
JOB = ("--steps", "1", "--seq-len", "32", "--micro-batch-size", "1", "--micro-batches", "2",
       "--gpu-memory", "64MiB", "--memory-reserve", "0B")


def _train(tmp_path, nproc: int):
    proc = amsp("train", "--plan", "auto", "--json", "--nproc-per-node", str(nproc),
                "--gpus-per-node", "2", *JOB,
                env={"XDG_CACHE_HOME": str(tmp_path), "AMSP_PROFILE_CACHE": ""})  # the XDG route
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _planned_by_amsp_plan(capsys, profile: str, *, nodes: int) -> str:
    """`amsp plan --json` (in this process: no ranks, no cache) for the job JOB describes."""
    from amsp_ext.cli.main import main

    capsys.readouterr()
    assert main(["plan", "--model", "tiny-llama", "--nodes", str(nodes), "--gpus-per-node", "2",
                 "--profile", profile, "--seq-len", "32", "--micro-batch-size", "1",
                 "--micro-batches", "2", "--gpu-memory", "64MiB", "--memory-reserve", "0B",
                 "--missing-mesh", "fit", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"]["source"] == "file" and report["profile"]["fingerprint"]["world_size"] == 2 * nodes
    return report["plan_text"]


def _planted_damaged(tmp_path, nproc: int):
    """A bad-JSON cache entry under the name the ``nproc``-rank job's fingerprint gives it."""
    fp = pc.merge_facts([pc.host_facts()] * nproc, ranks_per_node=2, backend="gloo", device="cpu")
    path = tmp_path / "amsp_ext" / "profiles" / f"{fp.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    return path


def _measured_again(out: dict, err: str, path) -> None:
    assert out["profile"]["source"] == "measured" and out["profile"]["path"] == str(path)
    assert out["profile_collectives"] > 0
    why = [line for line in err.splitlines() if "not used" in line]
    assert len(why) == 1 and str(path) in why[0] and "measuring this cluster again" in why[0], err[-2000:]
    assert "amsp: profile measured now in" in err and out["profile"]["fingerprint_key"] in err
    load_profile(path)  # the damaged file was replaced by a valid profile


@pytest.mark.distributed
def test_auto_measures_once_caches_and_says_which_cluster(tmp_path, capsys):
    # the cache holds a damaged entry of this very cluster: never trusted, measured again
    damaged = _planted_damaged(tmp_path, 4)
    first, err = _train(tmp_path, 4)
    _measured_again(first, err, damaged)
    files = sorted((tmp_path / "amsp_ext" / "profiles").glob("*"))
    assert files == [damaged]  # one profile, JSON, the one the run names
    fingerprint = json.loads(damaged.read_text())["metadata"]["cluster_fingerprint"]
    assert (fingerprint["world_size"], fingerprint["ranks_per_node"], fingerprint["backend"]) == (4, 2, "gloo")
    # the plan chosen equals the off-cluster planner's with that file
    assert first["plan_str"] == _planned_by_amsp_plan(capsys, str(damaged), nodes=2)

    second, err = _train(tmp_path, 4)
    assert second["profile"]["source"] == "cache" and second["profile"]["path"] == str(damaged)
    assert second["profile_collectives"] == 0 and second["plan_str"] == first["plan_str"]
    assert f"amsp: profile cache {damaged}" in err


@pytest.mark.slow  # the default tier's test_auto_measures_once_caches_and_says_which_cluster runs this path
@pytest.mark.distributed
def test_another_world_size_is_another_cluster(tmp_path):
    four = _planted_damaged(tmp_path, 4)
    four.write_text(json.dumps({"kept": True}))  # must stay untouched: not this job's entry
    two = _planted_damaged(tmp_path, 2)
    out, err = _train(tmp_path, 2)
    _measured_again(out, err, two)
    assert json.loads(four.read_text()) == {"kept": True}


def _fingerprint(**over):
    base = dict(world_size=4, ranks_per_node=2, backend="gloo", device="cpu", nodes=("a", "b"),
                links=("a eth0:1000Mb/s",), lab=None)
    return pc.ClusterFingerprint(**{**base, **over})


def _stored(tmp_path, fp, now=None):
    doc = json.loads(open(load_profile("configs/clusters/lab-2x2.profile.json").source).read())
    return pc.store(doc, fp, directory=tmp_path, now=now)


def test_cache_hit_and_every_reason_to_measure_again(tmp_path):
    from pathlib import Path

    assert pc.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/amsp_ext/profiles")
    assert pc.cache_dir({}) == Path.home() / ".cache" / "amsp_ext" / "profiles"
    assert pc.cache_dir({"XDG_CACHE_HOME": "/x", "AMSP_PROFILE_CACHE": "/shared"}) == Path("/shared")
    fp = _fingerprint()
    assert pc.lookup(fp, directory=tmp_path).doc is None  # empty: no reason, just nothing
    path = _stored(tmp_path, fp)
    hit = pc.lookup(fp, directory=tmp_path)
    assert hit.doc is not None and hit.path == path and not hit.why
    # too old
    _stored(tmp_path, fp, now=time.time() - pc.MAX_AGE_S - 60)
    assert "limit is 7.0 d" in pc.lookup(fp, directory=tmp_path).why
    # a fingerprint field of the wrong type, a different fingerprint under this name, bad JSON,
    # a wrong profile field: each is refused with one line naming what is wrong
    doc = json.loads(_stored(tmp_path, fp).read_text())
    for meta, expect in ((dict(cluster_fingerprint="4 ranks"), "must be an object"),
                         (dict(cluster_fingerprint={**fp.as_dict(), "world_size": "4"}), "world_size"),
                         (dict(measured_at="yesterday"), "measured_at")):
        path.write_text(json.dumps({**doc, "metadata": {**doc["metadata"], **meta}}))
        found = pc.lookup(fp, directory=tmp_path)
        assert found.doc is None and expect in found.why and "\n" not in found.why
    path.write_text(json.dumps({**doc, "entries": [{"op": "allreduce", "p0": "2", "p1": 1, "points": []}]}))
    assert "p0 must be an integer" in pc.lookup(fp, directory=tmp_path).why
    path.write_text("{not json")
    assert "not used" in pc.lookup(fp, directory=tmp_path).why


def test_fingerprint_tells_lab_rates_apart_and_reads_link_speeds(tmp_path):
    lab = lambda rate: pc.host_facts({"NCCL_HOSTID": "lab-n0", "AMSP_CLUSTER_LINK": json.dumps({"rate": rate})})
    slow, fast = (pc.merge_facts([lab(r)] * 4, ranks_per_node=2, backend="gloo", device="cpu")
                  for r in ("100mbit", "1gbit"))
    assert slow.key != fast.key and slow.links == () and "100mbit" in slow.lab
    net = tmp_path / "class" / "net"
    for dev, speed in (("lo", "0"), ("eth0", "1000"), ("eth1", "-1")):
        (net / dev).mkdir(parents=True)
        (net / dev / "speed").write_text(speed + "\n")
    facts = pc.host_facts({"NCCL_HOSTID": "n0"}, sys_root=str(tmp_path))
    assert facts == {"node": "n0", "links": ["eth0:1000Mb/s"], "lab": None}


def test_measuring_at_1024_ranks_stays_under_a_minute():
    """runtime/measure/cluster.py [Note: the cost of measuring], by arithmetic: every collective
    the measurement issues at 128 nodes x 8, priced by the paper's cluster's table."""
    from amsp_ext.planner.profile import CommTimer
    from amsp_ext.runtime.measure.cluster import AUTO_PROFILE_CONFIG as cfg
    from amsp_ext.runtime.measure.profile_cases import buffer_numel, cases, message_sizes
    from amsp_ext.topology.groups import World

    world = World.with_leaves(num_nodes=128, gpus_per_node=8, nodes_per_leaf=None)
    todo = cases(world, cfg)
    assert len(todo) == 82
    timer = CommTimer(profile=load_profile("paper-a800"), gpus_per_node=8, missing="fit")
    reps = cfg.num_warmup + cfg.num_reps
    total = 0.0
    for case in todo:
        for nbytes in message_sizes(cfg):
            _, moved = buffer_numel(case.op, nbytes, case.size, cfg.element_size)
            total += reps * (timer.time(case.op, moved, case.p0, case.p1)  # the collective
                             + timer.time("allreduce", 4, 8, 128))  # its barrier
        total += len(message_sizes(cfg)) * timer.time("allreduce", 8 * cfg.num_reps, 8, 128)  # MAX
    assert total < 60, total


def test_compare_plans_with_the_profile_its_launcher_found(monkeypatch, tmp_path):
    """amsp compare asks its launcher's ranks (amsp profile --cache, compare/launch.py) only when
    a row plans, and plans with the file they name."""
    from amsp_ext.compare import harness
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.launch import LaunchConfig

    asked, said = [], []

    def fake_find(launch, *, gpus_per_node, out):
        asked.append(gpus_per_node)
        return {"source": "cache", "path": "/cache/abc.json", "fingerprint_key": "abc"}

    monkeypatch.setattr(harness, "find_cluster_profile", fake_find)
    items = harness.plan_runs("baselines", RunSpec(amsp_plan="auto"), ["ddp", "amsp-plan"], None)
    got = harness._planner_profile(harness.PlannerInputs(), items, RunSpec(amsp_plan="auto"),
                                   LaunchConfig(), 2, tmp_path, said.append)
    assert got.profile == "/cache/abc.json" and asked == [2] and said == [
        "amsp compare: profile cache /cache/abc.json (cluster abc)"]
    ddp_only = harness.plan_runs("baselines", RunSpec(amsp_plan="auto"), ["ddp"], None)
    named = harness.PlannerInputs(profile="paper-a800")
    assert harness._planner_profile(harness.PlannerInputs(), ddp_only, RunSpec(amsp_plan="auto"),
                                    LaunchConfig(), 2, tmp_path, said.append).profile == "cluster"
    assert harness._planner_profile(named, items, RunSpec(amsp_plan="auto"), LaunchConfig(), 2,
                                    tmp_path, said.append) is named
    assert asked == [2]
