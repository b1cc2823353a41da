"""collectives.py against hand-made values, and `amsp profile` end to end on 4 gloo ranks (one
node). The multi-node version runs on the lab in test_cluster_netns.py."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.distributed


def test_collectives_values_and_named_timeout():
    proc = run_ranks(4, "tests.lab_worker", "collectives", timeout=120)
    assert proc.stdout.count("CHECK ok collectives") == 4, proc.stdout
    assert "CHECK timeout-named rank=0" in proc.stdout and "test_pair[0,1]" in proc.stdout


def test_profile_quick_on_one_node(tmp_path):
    out = tmp_path / "profile.json"
    proc = run_ranks(4, "amsp_ext.cli", "profile", "--quick", "--max-size", "4MiB", "--dtype", "float32",
                     "-o", str(out), "--inter-link", "none (one node)", timeout=180)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "amsp-profile/1"
    md = doc["metadata"]
    assert md["backend"] == "gloo" and md["world"] == {"nodes": 1, "gpus_per_node": 4}
    assert md["concurrency"] == "all_groups" and md["link"]["inter"] == "none (one node)"
    meshes = sorted((e["op"], e["p0"], e["p1"]) for e in doc["entries"])
    assert meshes == sorted((op, p0, 1) for op in ("allreduce", "allgather", "reducescatter", "broadcast")
                            for p0 in (2, 4))
    for e in doc["entries"]:
        assert [p["bytes"] for p in e["points"]] == [1 << 20, 4 << 20]
        assert all(p["GBps"] > 0 for p in e["points"])
    assert "alpha (us)" in proc.stdout  # the alpha-beta table
    assert "amsp profile" in proc.stderr  # rank 0's progress bar
    from amsp_ext.planner.profile import load_profile  # the planner's own loader accepts it

    assert load_profile(out).concurrency == "all_groups"
