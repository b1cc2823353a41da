"""The plan rules (planner/plan.py) are stated once; the vectorised pre-filter, the scalar
``check_plan`` and ``legal_plans`` must agree on every plan, and with hand-checked cases."""

import itertools

import pytest

from amsp_ext.planner.plan import Plan, check_plan, named_plan
from amsp_ext.planner.prefilter import divisors, legal_plans, prefilter

# 34 worlds, 41,000+ plans, with non-powers of two (3, 6, 12) where divisibility bites
WORLDS = [*itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 6, 12]), *itertools.product([8], [1, 2, 4, 8])]


def all_plans(R, N):
    for f in itertools.product(divisors(R), divisors(N), repeat=3):
        yield Plan(s0_p=f[0], s1_p=f[1], s0_g=f[2], s1_g=f[3], s0_os=f[4], s1_os=f[5])


def test_prefilter_agrees_with_the_scalar_rules_on_every_plan_of_many_worlds():
    total = 0
    for R, N in WORLDS:
        pf = prefilter(R, N)
        verdicts = {plan: set(rules) for plan, rules in pf.rejected()}
        verdicts |= {plan: set() for plan in pf.accepted}
        plans = list(all_plans(R, N))
        assert len(verdicts) == len(plans) == pf.num_considered
        for plan in plans:
            scalar = {v.rule for v in check_plan(plan, gpus_per_node=R, num_nodes=N)}
            assert verdicts[plan] == scalar, (R, N, plan)
        assert sorted(legal_plans(R, N)) == list(pf.accepted), (R, N)
        total += len(plans)
    assert total > 40_000


@pytest.mark.parametrize("R,N,expected", [
    # one node of 2: exactly DDP and ZeRO-1/2/3 (counted by hand: p, os in {1x1, 2x1}, p | os,
    # g in {p, os})
    (2, 1, ["ddp", "zero1", "zero2", "zero3"]),
    # 2 x 2: meshes 1x1, 2x1, 2x2; (p, os) pairs that nest: 6; g = os != p: 3 more
    (2, 2, ["ddp", "zero1", "zero2", "zero3", "mics:2",
            "p=1x1,g=1x1,os=2x1", "p=1x1,g=2x1,os=2x1",
            "p=2x1,g=2x1,os=2x2", "p=2x1,g=2x2,os=2x2"]),
])
def test_accepted_plans_by_hand(R, N, expected):
    from amsp_ext.planner.plan import resolve_plan

    want = {resolve_plan(e, gpus_per_node=R, num_nodes=N) for e in expected}
    assert len(want) == len(expected)
    assert set(prefilter(R, N).accepted) == want == set(legal_plans(R, N))
    assert named_plan("zero3", gpus_per_node=R, num_nodes=N) in want


@pytest.mark.parametrize("R,N,plan,rules", [
    (2, 1, "p=2x1,g=1x1,os=2x1", {"dependency", "sg_choice"}),  # s0_p=2 > s0_g=1
    (6, 1, "p=2x1,g=2x1,os=3x1", {"divisibility"}),  # 2 does not divide 3
    (4, 2, "p=2x2,g=2x2,os=4x2", {"cross_node"}),  # spans nodes with half a node
    (4, 2, "p=1x1,g=2x1,os=4x1", {"sg_choice"}),  # g is neither p nor os
    (4, 2, "p=4x1,g=4x1,os=2x2", {"dependency", "cross_node"}),  # os shrinks inside the node
    (4, 2, "p=1x1,g=1x1,os=4x2", set()),  # ZeRO-1 over the cluster
])
def test_rejections_by_hand(R, N, plan, rules):
    from amsp_ext.planner.plan import parse_plan

    p = parse_plan(plan)
    assert {v.rule for v in check_plan(p, gpus_per_node=R, num_nodes=N)} == rules
    verdict = dict(prefilter(R, N).rejected()).get(p, ())
    assert set(verdict) == rules
    assert (p in set(legal_plans(R, N))) == (not rules)
