"""Plan -> rank groups: every rank in exactly one group of each kind, sizes and locality as planned."""

import itertools

import pytest

from amsp_ext.planner.plan import Plan, check_plan, parse_plan
from amsp_ext.topology.groups import GROUP_KINDS, World, group_of, rank_groups


def legal_plans(R, N):
    div0 = [d for d in range(1, R + 1) if R % d == 0]
    div1 = [d for d in range(1, N + 1) if N % d == 0]
    for f in itertools.product(div0, div1, div0, div1, div0, div1):
        p = Plan(s0_p=f[0], s1_p=f[1], s0_g=f[2], s1_g=f[3], s0_os=f[4], s1_os=f[5])
        if not check_plan(p, gpus_per_node=R, num_nodes=N):
            yield p


def expected_sizes(p, R, N):
    return {
        "param_shard": p.sp,
        "param_replica": (R // p.s0_p) * (N // p.s1_p),
        "grad": (p.s0_g // p.s0_p) * (p.s1_g // p.s1_p),
        "optim": p.sos,
        "optim_bcast": (p.s0_os // p.s0_p) * (p.s1_os // p.s1_p),
    }


@pytest.mark.parametrize("R,N", [(2, 2), (4, 2), (8, 4), (2, 8)])
def test_partition_sizes_and_nesting(R, N):
    world = World(num_nodes=N, gpus_per_node=R)
    plans = list(legal_plans(R, N))
    assert plans
    for p in plans:
        groups = rank_groups(p, world)
        sizes = expected_sizes(p, R, N)
        for kind in GROUP_KINDS:
            flat = sorted(r for g in groups[kind] for r in g)
            assert flat == list(range(R * N)), (p, kind)  # a partition: each rank exactly once
            assert {len(g) for g in groups[kind]} == {sizes[kind]}, (p, kind)
        for r in range(R * N):
            shard = set(group_of(r, groups["param_shard"]))
            optim = set(group_of(r, groups["optim"]))
            replica = set(group_of(r, groups["param_replica"]))
            bcast = set(group_of(r, groups["optim_bcast"]))
            grad = set(group_of(r, groups["grad"]))
            assert shard <= optim  # dependency: a parameter shard group nests in its os group
            assert bcast <= optim and bcast <= replica and grad <= replica
            assert len(shard & replica) == 1 and len(optim & replica) == sizes["optim_bcast"]
            # locality: a group with s1 == 1 stays on one node, and its local ranks are contiguous
            if p.s1_p == 1:
                nodes = {x // R for x in shard}
                assert len(nodes) == 1
                locs = sorted(x % R for x in shard)
                assert locs == list(range(locs[0], locs[0] + p.s0_p))


def test_hand_worked_2x2():
    # ranks 0,1 on node 0; 2,3 on node 1. p = 2 GPUs in a node, os = whole world.
    g = rank_groups(parse_plan("p=2x1,g=2x1,os=2x2"), World(num_nodes=2, gpus_per_node=2))
    assert g["param_shard"] == [[0, 1], [2, 3]]
    assert g["param_replica"] == [[0, 2], [1, 3]]
    assert g["grad"] == [[0], [1], [2], [3]]
    assert g["optim"] == [[0, 1, 2, 3]]
    assert g["optim_bcast"] == [[0, 2], [1, 3]]


def test_leaf_aware_node_blocks():
    # 4 nodes, leaf switch ids interleaved: nodes 0,2 on leaf 0 and 1,3 on leaf 1.
    world = World(num_nodes=4, gpus_per_node=1, leaf_of_node=(0, 1, 0, 1))
    g = rank_groups(parse_plan("p=1x2,g=1x2,os=1x2"), world)
    assert g["param_shard"] == [[0, 2], [1, 3]]  # each cross-node shard group under one leaf
    naive = rank_groups(parse_plan("p=1x2,g=1x2,os=1x2"), World(num_nodes=4, gpus_per_node=1))
    assert naive["param_shard"] == [[0, 1], [2, 3]]
    w2 = World.with_leaves(num_nodes=4, gpus_per_node=2, nodes_per_leaf=2)
    assert w2.leaf_of_node == (0, 0, 1, 1)


def test_two_levels_of_an_all_reduce_group_by_hand():
    """groups.py [Note: the two levels of an all-reduce group] on 2 nodes x 4 GPUs."""
    from amsp_ext.topology.groups import groups_over, level_axes, mesh_ranks

    world = World(num_nodes=2, gpus_per_node=4)
    ddp = parse_plan("p=1x1,g=1x1,os=1x1")
    local, node = level_axes("param_replica")
    assert groups_over(mesh_ranks(ddp, world), local) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups_over(mesh_ranks(ddp, world), node) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # p=2x1: rank 0 holds the shard of local ranks {0,1}; its replicas are local ranks 0 and 2 of
    # both nodes ({0,2,4,6}): {0,2} on this node, {0,4} across
    plan = parse_plan("p=2x1,g=4x2,os=4x2")
    coords = mesh_ranks(plan, world)
    assert group_of(0, rank_groups(plan, world)["param_replica"]) == [0, 2, 4, 6]
    assert group_of(0, groups_over(coords, local)) == [0, 2]
    assert group_of(0, groups_over(coords, node)) == [0, 4]
    # the Tg group of g=4x2 over p=2x1: the same ranks (sg / sp = 2 x 2)
    g_local, g_node = level_axes("grad")
    assert group_of(5, groups_over(coords, g_local)) == [5, 7]
    assert group_of(5, groups_over(coords, g_node)) == [1, 5]


def test_a_two_level_all_reduce_is_counted_as_its_groups_all_reduce():
    """The consumers of groups.group_kind: the engine's trace kinds (comm_trace.kind_of) and the
    dry run's bytes (dryrun_report.bytes_per_kind, one bucket's v, not its three phases)."""
    from amsp_ext.runtime.measure.comm_trace import kind_of
    from amsp_ext.tools.dryrun_report import bytes_per_kind
    from amsp_ext.topology.groups import group_kind

    assert group_kind("param_replica_local[0,1]") == group_kind("param_replica[0,1,2,3]") == "param_replica"
    assert group_kind("grad_node[1,3]") == "grad" and group_kind("optim_bcast[0,1]") == "optim_bcast"
    assert [kind_of(op, name) for op, name in [
        ("all_reduce", "param_replica_local[0,1]"), ("all_reduce", "param_replica_node[0,2]"),
        ("all_gather", "grad_local[0,1]"), ("all_gather", "param_shard[0,1]"), ("all_reduce", "world")]] \
        == ["AR", "AR", "AR", "AG", "other"]
    rank = {"collectives": [
        {"kind": "all_reduce", "group": "param_replica_local", "bytes": 1000},
        {"kind": "all_reduce", "group": "param_replica_node", "bytes": 500},
        {"kind": "all_gather", "group": "param_replica_local", "bytes": 1000},
        {"kind": "all_reduce", "group": "grad", "bytes": 300},
        {"kind": "all_gather", "group": "param_shard", "bytes": 70},
        {"kind": "all_reduce", "group": "world", "bytes": 4}]}
    assert bytes_per_kind(rank) == {"all_gather": 70, "reduce_scatter": 0, "all_reduce": 1300, "broadcast": 0, "all_to_all": 0}


def test_process_groups_only_where_collectives_run_by_hand():
    # topology/mesh.py [Note: only the groups the plan issues collectives on]; 2 x 2 world
    from amsp_ext.topology.mesh import plan_groups

    w = World(num_nodes=2, gpus_per_node=2)
    ddp = parse_plan("p=1x1,g=1x1,os=1x1")
    assert plan_groups(ddp, w) == {"param_replica": [[0, 1, 2, 3]]}
    assert plan_groups(ddp, w, two_level=True) == {
        "param_replica": [[0, 1, 2, 3]], "param_replica_local": [[0, 1], [2, 3]],
        "param_replica_node": [[0, 2], [1, 3]]}
    assert plan_groups(parse_plan("p=2x1,g=2x1,os=2x2"), w) == {
        "param_shard": [[0, 1], [2, 3]], "param_replica": [[0, 2], [1, 3]],
        "optim_bcast": [[0, 2], [1, 3]]}
    # ZeRO-3 over the world: one shard group, nothing replicated, no level of one node
    assert plan_groups(parse_plan("p=2x2,g=2x2,os=2x2"), w, two_level=True) == {
        "param_shard": [[0, 1, 2, 3]]}
    assert plan_groups(parse_plan("p=1x1,g=2x1,os=2x2"), w) == {
        "param_replica": [[0, 1, 2, 3]], "grad": [[0, 1], [2, 3]], "optim_bcast": [[0, 1, 2, 3]]}
