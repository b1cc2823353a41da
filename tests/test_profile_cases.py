"""What `amsp profile` measures (meshes, layouts, sizes), its fit and its JSON, against hand-worked
values; plus one tiny real run on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest

from amsp_ext.runtime.measure.profile_cases import (
    MiB,
    Measurement,
    ProfileConfig,
    ProfileError,
    alpha_beta_fit,
    buffer_numel,
    cases,
    message_sizes,
    profile_document,
)
from amsp_ext.topology.groups import World


def by_case(world, **cfg):
    return {(c.op, c.p0, c.p1): [list(g) for g in c.groups] for c in cases(world, ProfileConfig(**cfg))}


def test_meshes_and_layouts_2x2_hand_worked():
    got = by_case(World(num_nodes=2, gpus_per_node=2))
    assert got == {
        # replica layout: allreduce / broadcast on every a x b (a | R, b | N, a*b > 1)
        ("allreduce", 2, 1): [[0, 1], [2, 3]],
        ("allreduce", 1, 2): [[0, 2], [1, 3]],
        ("allreduce", 2, 2): [[0, 1, 2, 3]],
        ("broadcast", 2, 1): [[0, 1], [2, 3]],
        ("broadcast", 1, 2): [[0, 2], [1, 3]],
        ("broadcast", 2, 2): [[0, 1, 2, 3]],
        # shard layout: Eq. 7 drops 1x2 (cross-node with part of a node)
        ("allgather", 2, 1): [[0, 1], [2, 3]],
        ("allgather", 2, 2): [[0, 1, 2, 3]],
        ("reducescatter", 2, 1): [[0, 1], [2, 3]],
        ("reducescatter", 2, 2): [[0, 1, 2, 3]],
    }
    assert ("allgather", 1, 2) in by_case(World(num_nodes=2, gpus_per_node=2), all_meshes=True)


def test_layouts_4x2_shard_contiguous_replica_strided():
    got = by_case(World(num_nodes=2, gpus_per_node=4), ops=("allgather", "allreduce"))
    assert got[("allgather", 2, 1)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ("allgather", 2, 2) not in got and ("allgather", 4, 2) in got  # Eq. 7
    # replica of a 2x1 shard group: local ranks {0,2} / {1,3} of both nodes
    assert got[("allreduce", 2, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert got[("allreduce", 1, 2)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert got[("allreduce", 4, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_layouts_follow_leaf_switches():
    world = World.with_leaves(num_nodes=4, gpus_per_node=1, nodes_per_leaf=2)
    got = by_case(world, ops=("allgather", "allreduce"))
    assert got[("allgather", 1, 2)] == [[0, 1], [2, 3]]  # a shard group stays under one leaf
    assert got[("allreduce", 1, 2)] == [[0, 2], [1, 3]]  # its replicas cross the spine


@pytest.mark.parametrize("R,N", [(2, 2), (4, 2), (8, 4), (2, 8), (6, 1)])
def test_every_case_is_a_partition_of_p0_per_node_on_p1_nodes(R, N):
    world = World(num_nodes=N, gpus_per_node=R)
    for c in cases(world, ProfileConfig(all_meshes=True)):
        flat = sorted(r for g in c.groups for r in g)
        assert flat == list(range(R * N)), c.label
        for g in c.groups:
            nodes = {r // R for r in g}
            assert len(nodes) == c.p1, c.label
            assert all(sum(1 for r in g if r // R == n) == c.p0 for n in nodes), c.label


def test_message_sizes():
    assert message_sizes(ProfileConfig.quick()) == [MiB, 4 * MiB, 16 * MiB]
    assert message_sizes(ProfileConfig()) == [MiB << k for k in range(7)]
    assert message_sizes(ProfileConfig(max_bytes=3 * MiB)) == [MiB, 2 * MiB, 3 * MiB]


def test_buffer_sizes_follow_paper_convention_and_divide():
    # allgather: v = gathered output; 1 MiB bf16 over a group of 3 -> 524286 elements
    assert buffer_numel("allgather", MiB, 3, 2) == (524286, 1048572)
    assert buffer_numel("reducescatter", MiB, 4, 4) == (262144, MiB)
    assert buffer_numel("allreduce", MiB, 3, 2) == (524288, MiB)


@pytest.mark.parametrize("kw,field", [
    (dict(ops=("allreduce", "alltoall")), "ops"), (dict(max_bytes=1024 * 1024 - 1), "max_bytes"),
    (dict(num_reps=0), "num_reps"), (dict(dtype="int8"), "dtype"), (dict(size_factor=1), "size_factor"),
])
def test_config_errors(kw, field):
    with pytest.raises(ProfileError, match=field):
        ProfileConfig(**kw)


def test_alpha_beta_fit_recovers_known_line():
    alpha, bw = 50e-6, 2e9
    pts = [(v, alpha + v / bw) for v in (MiB, 4 * MiB, 16 * MiB, 64 * MiB)]
    a, b = alpha_beta_fit(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    a, b = alpha_beta_fit([(MiB, 1e-3), (2 * MiB, 2e-3)])  # through the origin
    assert a == pytest.approx(0.0, abs=1e-12) and b == pytest.approx(MiB / 1e-3)


def test_profile_document_schema():
    m = Measurement(op="allgather", p0=2, p1=1, points=[(4 * MiB, 0.002), (MiB, 0.001)])
    doc = profile_document([m], name="t", backend="gloo", torch_version="2.13.0",
                           world=World(num_nodes=2, gpus_per_node=2), link={"intra": "a", "inter": "b"},
                           config=ProfileConfig.quick(), date="2026-11-30")
    assert doc["schema"] == "amsp-profile/1" and doc["name"] == "t"
    md = doc["metadata"]
    assert {k: md[k] for k in ("source", "backend", "date", "torch", "world", "link", "concurrency")} == {
        "source": "measured", "backend": "gloo", "date": "2026-11-30", "torch": "2.13.0",
        "world": {"nodes": 2, "gpus_per_node": 2}, "link": {"intra": "a", "inter": "b"},
        "concurrency": "all_groups"}
    assert doc["entries"] == [{"op": "allgather", "p0": 2, "p1": 1, "points": [
        {"bytes": MiB, "GBps": 1.04858}, {"bytes": 4 * MiB, "GBps": 2.09715}]}]
    json.dumps(doc)


def test_profile_cli_refuses_outside_torchrun(capsys, monkeypatch):
    from amsp_ext.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    assert main(["profile", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert "torchrun" in err and "\n" not in err
    assert main(["profile", "--ops", "alltoall"]) == 2
    assert "ops" in capsys.readouterr().err
