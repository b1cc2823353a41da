"""Plan rules (Eq. 3-7), text form and named baselines, against hand-worked cases."""

import re

import pytest

from amsp_ext.planner.plan import (
    Plan, PlanError, check_plan, named_plan, parse_plan, resolve_plan, validate_plan,
)


def rules(plan, R, N, **kw):
    return sorted({v.rule for v in check_plan(plan, gpus_per_node=R, num_nodes=N, **kw)})


def test_parse_roundtrip_and_default_g():
    p = parse_plan("p=2x1,g=2x1,os=2x2")
    assert p.as_tuple() == (2, 1, 2, 1, 2, 2)
    assert str(p) == "p=2x1,g=2x1,os=2x2"
    assert parse_plan("os=8x4, p=8x1").as_tuple() == (8, 1, 8, 1, 8, 4)
    assert (p.sp, p.sg, p.sos) == (2, 2, 4)


@pytest.mark.parametrize("text", ["", "p=2", "p=2x1", "p=2x1,os=2", "q=1x1,os=1x1", "p=1x1,p=1x1,os=1x1"])
def test_parse_rejects_with_one_line(text):
    with pytest.raises(PlanError) as e:
        parse_plan(text)
    assert "\n" not in str(e.value) and "plan" in str(e.value)


def test_factor_must_be_positive_and_named():
    with pytest.raises(PlanError, match="plan.s0_os"):
        Plan(s0_os=0)
    with pytest.raises(PlanError, match="plan.s1_p"):
        Plan(s1_p=-2)


def test_paper_table_iv_plans_pass_all_rules():
    # Table IV at 128 nodes x 8 GPUs.
    for text in ("p=1x1,g=1x1,os=8x1", "p=4x1,g=4x1,os=8x1", "p=8x1,g=8x1,os=8x4"):
        assert check_plan(parse_plan(text), gpus_per_node=8, num_nodes=128) == []


def test_each_rule_is_named():
    assert rules(parse_plan("p=2x1,g=1x1,os=2x1"), 8, 4) == ["dependency", "sg_choice"]
    assert rules(parse_plan("p=1x1,g=1x1,os=1x8"), 8, 4) == ["cross_node", "dependency"]
    assert rules(parse_plan("p=2x1,g=2x1,os=3x1"), 6, 1) == ["divisibility"]
    assert rules(parse_plan("p=1x1,g=1x1,os=4x2"), 8, 4) == ["cross_node"]
    assert rules(parse_plan("p=1x1,g=2x1,os=4x1"), 8, 4) == ["sg_choice"]
    # structural_only drops the search heuristics
    assert rules(parse_plan("p=1x1,g=2x1,os=4x2"), 8, 4, structural_only=True) == []


def test_named_baselines_as_factors():
    R, N = 8, 128
    assert named_plan("ddp", gpus_per_node=R, num_nodes=N).as_tuple() == (1, 1, 1, 1, 1, 1)
    assert named_plan("zero1", gpus_per_node=R, num_nodes=N).as_tuple() == (1, 1, 1, 1, 8, 128)
    assert named_plan("zero2", gpus_per_node=R, num_nodes=N).as_tuple() == (1, 1, 8, 128, 8, 128)
    assert named_plan("zero3", gpus_per_node=R, num_nodes=N).as_tuple() == (8, 128) * 3
    assert named_plan("mics:8", gpus_per_node=R, num_nodes=N).as_tuple() == (8, 1) * 3
    assert named_plan("mics:4", gpus_per_node=R, num_nodes=N).as_tuple() == (4, 1) * 3
    assert named_plan("mics:32", gpus_per_node=R, num_nodes=N).as_tuple() == (8, 4) * 3
    for bad in ("mics", "mics:3", "mics:12", "zero4"):
        with pytest.raises(PlanError):
            named_plan(bad, gpus_per_node=R, num_nodes=N)


def test_resolve_and_validate():
    assert resolve_plan("zero1", gpus_per_node=2, num_nodes=2).as_tuple() == (1, 1, 1, 1, 2, 2)
    with pytest.raises(PlanError, match="auto"):
        resolve_plan("auto", gpus_per_node=2, num_nodes=2)
    with pytest.raises(PlanError, match="does not fit 2 node"):
        validate_plan(parse_plan("p=4x1,g=4x1,os=4x1"), gpus_per_node=2, num_nodes=2)


def test_fingerprint_differs_between_plans():
    a, b = parse_plan("p=1x1,os=2x1"), parse_plan("p=1x1,os=2x2")
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == parse_plan("p=1x1,g=1x1,os=2x1").fingerprint()


@pytest.mark.parametrize("text", ["auto", "ddp", "ZeRO3", " zero1 ", "mics:4", "p=2x1,g=2x1,os=2x2"])
def test_plan_text_every_route_accepts(text):
    """`amsp compare --amsp-plan ddp` was once refused: its check read factors only."""
    from amsp_ext.planner.plan import check_plan_text

    check_plan_text(text, "--amsp-plan")


@pytest.mark.parametrize("text, needle", [
    ("zero9", "--amsp-plan must be 'auto', a baseline name (ddp, zero1, zero2, zero3, mics:K)"),
    ("mics", "--amsp-plan: 'mics' needs a shard group size"),
    ("mics:0", "--amsp-plan: 'mics' needs a shard group size"),
    ("p=2x1", "--amsp-plan: both 'p=' and 'os=' are required"),
])
def test_plan_text_refused_naming_the_field(text, needle):
    from amsp_ext.planner.plan import PlanError, check_plan_text

    with pytest.raises(PlanError, match=re.escape(needle)):
        check_plan_text(text, "--amsp-plan")
