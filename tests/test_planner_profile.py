"""Profile loading/validation, interpolation, the alpha-beta fit, contention, paper-a800."""

import copy
import json
import math

import pytest

from amsp_ext.planner.profile import (
    BandwidthProfile, CommTimer, ProfileError, bundled_profiles, load_profile,
)
from planner_helpers import ab_profile, constant_profile

GOOD = {
    "schema": "amsp-profile/1", "name": "t",
    "metadata": {"concurrency": "all_groups", "world": {"nodes": 2, "gpus_per_node": 4}},
    "entries": [{"op": "allgather", "p0": 4, "p1": 1,
                 "points": [{"bytes": 1000, "GBps": 1.0}, {"bytes": 3000, "GBps": 3.0}]}],
}


def with_change(path, value):
    doc = copy.deepcopy(GOOD)
    obj = doc
    for k in path[:-1]:
        obj = obj[k]
    if value is KeyError:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,match", [
    (("schema",), "amsp-profile/0", "schema must be 'amsp-profile/1'"),
    (("name",), "", "'name' must be a non-empty string"),
    (("metadata",), KeyError, "'metadata' must be an object"),
    (("metadata", "concurrency"), KeyError, "metadata.concurrency must be one of all_groups"),
    (("metadata", "concurrency"), "some", "metadata.concurrency must be one of"),
    (("entries",), [], "'entries' must be a non-empty list"),
    (("entries", 0, "op"), "alltoall", r"entries\[0\].op must be one of allreduce"),
    (("entries", 0, "p1"), 0, r"entries\[0\].p1 must be an integer >= 1"),
    (("entries", 0, "p0"), 1, r"mesh 1x1 has one GPU"),
    (("entries", 0, "points"), [], r"entries\[0\].points must be a non-empty list"),
    (("entries", 0, "points", 1, "GBps"), -1, r"entries\[0\].points\[1\].GBps must be a positive"),
    (("entries", 0, "points", 1, "GBps"), float("nan"), r"points\[1\].GBps must be a positive"),
    (("entries", 0, "points", 1, "bytes"), 500, r"points\[1\].bytes=500 must be larger"),
    (("entries", 0, "points", 0), KeyError, r"points\[0\].bytes must be an integer"),
])
def test_malformed_profiles_one_line(path, value, match):
    doc = with_change(path, value)
    if path == ("entries", 0, "points", 0):
        doc["entries"][0]["points"] = [{"GBps": 1.0}]
    with pytest.raises(ProfileError, match=match) as e:
        BandwidthProfile.from_dict(doc)
    assert "\n" not in str(e.value)


def test_duplicate_entry_and_not_json(tmp_path):
    doc = copy.deepcopy(GOOD)
    doc["entries"].append(copy.deepcopy(doc["entries"][0]))
    with pytest.raises(ProfileError, match=r"entries\[1\] repeats op=allgather mesh 4x1"):
        BandwidthProfile.from_dict(doc)
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(p)
    with pytest.raises(ProfileError, match="bundled name .*paper-a800"):
        load_profile("no-such-profile")


def test_interpolation_and_range_rules():
    t = CommTimer(BandwidthProfile.from_dict(GOOD), gpus_per_node=4)
    # at a measured size: v / w
    assert t.time("allgather", 1000, 4, 1) == pytest.approx(1000 / 1e9)
    # halfway: w = 2 GB/s (linear in bytes), t = 2000 / 2e9
    assert t.time("allgather", 2000, 4, 1) == pytest.approx(1e-6)
    # below the smallest size: the smallest size's time (latency floor)
    assert t.time("allgather", 10, 4, 1) == pytest.approx(1e-6)
    # above the largest: the largest size's bandwidth
    assert t.time("allgather", 6000, 4, 1) == pytest.approx(6000 / 3e9)
    assert t.time("allgather", 1000, 1, 1) == 0.0  # one GPU: no communication


def test_missing_mesh_refused_or_fitted():
    prof = ab_profile(8, 16)
    drop = {(op, p0, p1) for op, p0, p1 in prof.curves if (p0, p1) == (2, 8)}
    partial = BandwidthProfile(name="partial", concurrency=prof.concurrency,
                               metadata=prof.metadata,
                               curves={k: v for k, v in prof.curves.items() if k not in drop})
    strict = CommTimer(partial, gpus_per_node=8)
    with pytest.raises(ProfileError, match="no allreduce entry for mesh 2x8") as e:
        strict.time("allreduce", 2**24, 2, 8)
    assert "\n" not in str(e.value) and "--missing-mesh fit" in str(e.value)
    fit = CommTimer(partial, gpus_per_node=8, missing="fit")
    # ab_profile is exactly t = 20us + 3us (p-1) + traffic v / B, so the fit recovers the mesh
    for op in ("allreduce", "broadcast", "allgather"):
        for v in (2**22, 2**26):  # measured sizes: interpolation is exact there
            want = CommTimer(prof, gpus_per_node=8).time(op, v, 2, 8)
            assert fit.time(op, v, 2, 8) == pytest.approx(want, rel=1e-6)
    assert ("allreduce", 2, 8) in fit.extrapolated
    # a mesh beyond the table (32 nodes) is estimated too
    assert fit.time("allgather", 2**26, 8, 32) > fit.time("allgather", 2**26, 8, 16)


def test_fit_needs_two_meshes():
    doc = copy.deepcopy(GOOD)
    t = CommTimer(BandwidthProfile.from_dict(doc), gpus_per_node=4, missing="fit")
    with pytest.raises(ProfileError, match="fit needs at least 2 measured intra-node meshes"):
        t.time("allgather", 1000, 2, 1)


def test_contention_single_group():
    # constant 10 GB/s; single_group: cross-node meshes are shared by R/p0 groups per node
    gb = {op: 10.0 for op in ("allreduce", "allgather", "reducescatter", "broadcast")}
    single = CommTimer(constant_profile(8, 4, gb, concurrency="single_group"), gpus_per_node=8)
    allg = CommTimer(constant_profile(8, 4, gb), gpus_per_node=8)
    v = 10**9  # 0.1 s at 10 GB/s
    assert allg.time("allreduce", v, 1, 4) == pytest.approx(0.1)
    assert single.time("allreduce", v, 1, 4) == pytest.approx(0.8)  # 8 groups share the NICs
    assert single.time("allreduce", v, 2, 4) == pytest.approx(0.4)
    assert single.time("allreduce", v, 8, 4) == pytest.approx(0.1)  # one group per node
    assert single.time("allreduce", v, 2, 1) == pytest.approx(0.1)  # intra-node: not scaled
    # bandwidth scaling for the sensitivity analysis
    assert single.scaled(inter=2.0).time("allreduce", v, 2, 4) == pytest.approx(0.2)
    assert single.scaled(intra=0.5).time("allreduce", v, 2, 1) == pytest.approx(0.2)


def test_paper_a800_bundled_and_anchored():
    assert "paper-a800" in bundled_profiles()
    prof = load_profile("paper-a800")
    meta = prof.metadata
    assert prof.concurrency == "single_group"
    assert meta["world"] == {"nodes": 128, "gpus_per_node": 8}
    assert "Fig. 3" in meta["notes"] and "4 x" in meta["notes"]
    # every mesh the planner can query at 128 x 8, every op, sizes 1 MiB .. 1 GiB
    for op in ("allreduce", "allgather", "reducescatter", "broadcast"):
        for p0 in (1, 2, 4, 8):
            for p1 in (1, 2, 4, 8, 16, 32, 64, 128):
                if p0 * p1 > 1:
                    c = prof.curves[(op, p0, p1)]
                    assert c.nbytes[0] == 2**20 and c.nbytes[-1] == 2**30
    t = CommTimer(prof, gpus_per_node=8)
    gbit = lambda op, v, p0, p1: v / t.time(op, v, p0, p1) * 8 / 1e9
    assert gbit("allgather", 2**26, 8, 1) == pytest.approx(1200, rel=0.01)  # paper Fig. 3
    assert gbit("allgather", 2**26, 8, 64) == pytest.approx(300, rel=0.01)  # paper Fig. 3
    # broadcast at 512 GPUs: close to the 4 x HDR line rate (800 Gb/s) for large messages
    assert 700 < gbit("broadcast", 2**30, 8, 64) <= 800
    # cross-node allreduce never beats the node's 100 GB/s links: 2v / 100 GB/s
    assert t.time("allreduce", 2**30, 8, 128) >= 2 * 2**30 / 100e9


def test_paper_a800_is_what_the_script_builds():
    from amsp_ext.planner.profiles import build_paper_a800

    on_disk = json.loads((build_paper_a800.OUT).read_text())
    assert on_disk == json.loads(json.dumps(build_paper_a800.build()))
    assert math.isclose(build_paper_a800.IB_NODE_BPS, 100e9)


def _mesh_profile(concurrency):
    """R = 4, N = 2; one constant bandwidth per (op, mesh), GB/s."""
    gbps = {("allreduce", 4, 2): 1.0, ("allreduce", 1, 2): 2.0, ("allreduce", 4, 1): 50.0,
            ("reducescatter", 4, 1): 10.0, ("allgather", 4, 1): 20.0}
    return BandwidthProfile.from_dict({
        "schema": "amsp-profile/1", "name": "levels",
        "metadata": {"concurrency": concurrency, "world": {"nodes": 2, "gpus_per_node": 4}},
        "entries": [{"op": op, "p0": p0, "p1": p1,
                     "points": [{"bytes": 1, "GBps": g}, {"bytes": 2**40, "GBps": g}]}
                    for (op, p0, p1), g in gbps.items()]})


def test_two_level_all_reduce_time_is_the_sum_of_its_phases():
    """profile.py [Note: a two-level all-reduce's time], by hand: 8 GB on 4 x 2."""
    flat = CommTimer(_mesh_profile("all_groups"), gpus_per_node=4)
    two = CommTimer(_mesh_profile("all_groups"), gpus_per_node=4, all_reduce="two_level")
    assert flat.time("allreduce", 8e9, 4, 2) == pytest.approx(8.0)  # 8 GB at 1 GB/s
    # RS 8 GB at 10 GB/s + AR of the 2 GB shard at 2 GB/s + AG 8 GB at 20 GB/s
    assert two.time("allreduce", 8e9, 4, 2) == pytest.approx(0.8 + 1.0 + 0.4)
    # one level only: nothing to split, the flat collective
    assert two.time("allreduce", 8e9, 1, 2) == pytest.approx(4.0)
    assert two.time("allreduce", 8e9, 4, 1) == pytest.approx(0.16)
    # a single-group table: the middle phase's 1 x 2 groups are R = 4 to a node's links
    single = CommTimer(_mesh_profile("single_group"), gpus_per_node=4, all_reduce="two_level")
    assert single.time("allreduce", 8e9, 4, 2) == pytest.approx(0.8 + 4 * 1.0 + 0.4)
    # the setting survives the sensitivity analysis' scaled copies
    assert two.scaled(inter=2.0).time("allreduce", 8e9, 4, 2) == pytest.approx(0.8 + 0.5 + 0.4)
    with pytest.raises(ProfileError, match="all_reduce must be one of flat, two_level, got 'tree'"):
        CommTimer(_mesh_profile("all_groups"), gpus_per_node=4, all_reduce="tree")
