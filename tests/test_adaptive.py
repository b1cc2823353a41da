"""Adaptive AMSP's monitor and decision (amsp_ext/planner/adaptive.py): pure logic, hand-worked
numbers, and a simulated run on the 2x2 lab profile (a steady link for 300 steps never
switches; a link cut to 1/20 at step 100 re-plans within the window and switches once)."""

from __future__ import annotations

import random

import pytest

from amsp_ext.planner.adaptive import (AdaptiveConfig, Monitor, crosses_nodes, decide, predicted_by_kind,
                                       refit_scales, replan, switch_move_s)
from amsp_ext.planner.plan import parse_plan

CFG = AdaptiveConfig(band=(0.67, 1.5), window=3, min_steps_between_switches=10, hysteresis=0.1)


def test_drift_needs_a_whole_window_on_one_side():
    m = Monitor(CFG)
    pred = {"grad": 2.0, "param_replica": 1.0, "optim_bcast": 0.0}
    for ratio in (1.0, 2.0, 2.0):
        m.observe({"grad": 2.0, "param_replica": ratio, "optim_bcast": 5.0}, pred)
    assert m.drift() == {}  # only two slow steps of three; optim_bcast predicted 0: not compared
    m.observe({"grad": 2.0, "param_replica": 4.0}, pred)
    assert m.drift() == {"param_replica": 2.0}  # median of 2, 2, 4
    m.observe({"grad": 2.0, "param_replica": 0.1}, pred)  # the other side: not one drift
    assert m.drift() == {}
    for _ in range(3):
        m.observe({"grad": 0.5, "param_replica": 1.0}, pred)  # 0.25 < 0.67, three times
    assert m.drift() == {"grad": 0.25}
    m.reset()
    assert m.drift() == {} and m.ratios == {}


def test_refit_scales_hand_worked():
    drift = {"param_replica": 4.0, "optim_bcast": 2.0, "param_shard": 2.0, "grad": 8.0}
    cross = {"param_replica": True, "optim_bcast": True, "param_shard": False}
    # intra: param_shard 2 and grad 8 (not listed = intra) -> median 5 -> x0.2; inter: 4, 2 -> 3
    assert refit_scales(drift, cross) == pytest.approx((0.2, 1 / 3))
    assert refit_scales({}, cross) == (1.0, 1.0)


@pytest.mark.parametrize("cost,since,cand,switch,why", [
    (10.0, 50, "B", True, "gain 20s > (1 + 0.1) x cost = 11s"),
    (19.0, 50, "B", False, "gain 20s <= (1 + 0.1) x cost = 20.9s"),
    (1.0, 9, "B", False, "9 steps since the last switch < 10"),
    (1.0, 50, "A", False, "the current plan is still the best"),
])
def test_decide_gain_against_cost_with_hysteresis(cost, since, cand, switch, why):
    # 1.0 s/step now, 0.8 s/step on B, 100 steps left: gain (1.0 - 0.8) x 100 = 20 s
    d = decide(step=7, current="A", candidate=cand, current_step_s=1.0,
               candidate_step_s=0.8 if cand == "B" else 1.0, remaining_steps=100,
               switch_cost_s=cost, steps_since_switch=since, config=CFG,
               drift={"param_replica": 20.0}, scales=(1.0, 0.05))
    assert d.switch is switch and why in d.reason
    line = d.line()
    assert "\n" not in line and f"cost {cost:.4g}s" in line and "param_replica x20.00" in line


def test_crosses_nodes_on_2x2():
    # p=2x1 inside a node; grad (sg/sp) = 1x2, replica (R/s0_p x N/s1_p) = 1x2 and
    # bcast (sos/sp) = 1x2 each pair the two nodes
    p = parse_plan("p=2x1,g=2x2,os=2x2")
    assert crosses_nodes(p, 2, 2) == {"param_shard": False, "grad": True, "param_replica": True,
                                      "optim_bcast": True}
    assert crosses_nodes(parse_plan("p=2x1,g=2x1,os=2x1"), 2, 2) == {
        "param_shard": False, "grad": False, "param_replica": True, "optim_bcast": False}


# a Llama big enough that the lab's 1 Gbit -> 50 Mbit cut changes the planner's choice (for
# tiny-llama the Eq. 1 optimum stays DDP-like on both links)
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def lab_problem():
    from amsp_ext.planner.search import make_problem
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

    from dist_utils import REPO

    return make_problem(MODEL,
                        ClusterSpec(num_nodes=2, gpus_per_node=2, gpu_memory_bytes=8 << 30),
                        TrainingSpec(seq_len=128, micro_batch_size=2, num_micro_batches=2),
                        REPO / "configs/clusters/lab-2x2.profile.json", missing="fit")


def _simulate(problem, *, steps, cut_at=None, seed=0):
    """Every step: measured = predicted under the *true* link x noise (+-20 %), monitor, and at
    drift re-plan and decide as the engine would; returns the decisions and switches."""
    from amsp_ext.planner.cost import comm_cost

    rng = random.Random(seed)
    truth_timer = problem.timer.scaled(inter=0.05) if cut_at is not None else problem.timer
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    plan = replan(problem, parse_plan("p=1x1,g=1x1,os=1x1"), (1.0, 1.0))[0]  # best on the fast link
    monitor, decisions, switches, since = Monitor(CFG), [], [], 10**9
    base = problem

    def predicted(p, timer):
        return predicted_by_kind(comm_cost(p, problem.spec, problem.training, timer, gpus_per_node=R,
                                           num_nodes=N, num_micro_batches=problem.num_micro_batches))

    for step in range(steps):
        true = truth_timer if cut_at is not None and step >= cut_at else base.timer
        truth = predicted(plan, true)
        measured = {k: v * rng.uniform(0.8, 1.2) for k, v in truth.items()}
        monitor.observe(measured, predicted(plan, problem.timer))
        drift = monitor.drift()
        since += 1
        if not drift:
            continue
        scales = refit_scales(drift, crosses_nodes(plan, R, N))
        best, t_cur, t_best = replan(problem, plan, scales)
        d = decide(step=step, current=str(plan), candidate=str(best), current_step_s=t_cur,
                   candidate_step_s=t_best, remaining_steps=steps - step, switch_cost_s=0.3,
                   steps_since_switch=since, config=CFG, drift=drift, scales=scales)
        decisions.append(d)
        # the re-fit profile is the new prediction, whether the plan changes or not
        monitor.reset()
        problem = problem.with_timer(problem.timer.scaled(intra=scales[0], inter=scales[1]))
        if d.switch:
            switches.append((step, str(plan), str(best)))
            plan, since = best, 0
    return decisions, switches


def test_a_steady_link_never_switches(lab_problem):
    decisions, switches = _simulate(lab_problem, steps=300)
    assert decisions == [] and switches == []  # +-20 % noise stays inside (0.67, 1.5)


def test_a_cut_link_switches_once_within_the_window(lab_problem):
    decisions, switches = _simulate(lab_problem, steps=300, cut_at=100)
    # one decision: after it the re-fit profile predicts the cut link within the band
    assert len(decisions) == 1 and len(switches) == 1, [d.line() for d in decisions]
    step, before, after = switches[0]
    assert 100 + CFG.window - 1 == step and before != after
    # the profile was re-fit to the cut link: the new plan is what the planner picks there
    truth = lab_problem.with_timer(lab_problem.timer.scaled(inter=0.05))
    assert after == str(replan(truth, parse_plan(after), (1.0, 1.0))[0])


def test_trace_kinds_cross_nodes_follow_the_plans_meshes():
    from amsp_ext.planner.adaptive import trace_kinds_cross_nodes
    from amsp_ext.planner.plan import parse_plan

    # ZeRO-3 over 2 x 2: gathers and reduce-scatters span nodes; no all-reduce, no broadcast
    assert trace_kinds_cross_nodes(parse_plan("p=2x2,g=2x2,os=2x2"), 2, 2, 2) == {
        "AG": True, "RS": True, "AR": False, "BC": False}
    # shards inside a node: only the replicas' all-reduce crosses (the last micro-batch's)
    assert trace_kinds_cross_nodes(parse_plan("p=2x1,g=2x1,os=2x1"), 2, 2, 1) == {
        "AG": False, "RS": False, "AR": True, "BC": False}


def test_slow_fault_parses_and_bad_ones_are_one_line():
    from amsp_ext.common.faults import faults, slow_factor

    fs = faults("slow:rank=1:step=5-9:x=100;nan:rank=0:step=2")
    assert slow_factor(fs, rank=1, step=5) == 100.0 and slow_factor(fs, rank=1, step=10) == 1.0
    assert slow_factor(fs, rank=0, step=6) == 1.0
    for bad in ("slow:rank=1:step=5", "slow:rank=1:step=5:x=0", "slow:rank=1:step=5:x=abc"):
        with pytest.raises(ValueError, match="AMSP_FAULTS") as err:
            faults(bad)
        assert "\n" not in str(err.value)


def test_switch_move_s_is_one_world_broadcast_of_the_state(lab_problem):
    """Before the first switch its cost includes moving the state ([Note: the first switch's
    cost]): here by hand, MODEL's parameters x 12 B (fp32 master, AdamW m and v) at the lab
    profile's 2x2 broadcast bandwidth (beyond its largest measured size: bytes / GBps)."""
    import json

    from dist_utils import REPO

    # embeddings and lm_head 2 x 32000 x 256; per layer q,k,v,o 4 x 256^2, MLP 3 x 256 x 688,
    # 2 norms x 256; final norm 256
    num_params = 2 * 32000 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) + 256
    assert lab_problem.spec.num_params == num_params
    doc = json.loads((REPO / "configs/clusters/lab-2x2.profile.json").read_text())
    (entry,) = [e for e in doc["entries"] if (e["op"], e["p0"], e["p1"]) == ("broadcast", 2, 2)]
    last = entry["points"][-1]
    assert num_params * 12 > last["bytes"]
    expected = num_params * 12 / (last["GBps"] * 1e9)
    assert switch_move_s(lab_problem) == pytest.approx(expected, rel=1e-9)
    # a cross-node link re-fit to a quarter of its bandwidth: four times as long
    assert switch_move_s(lab_problem, (1.0, 0.25)) == pytest.approx(4 * expected, rel=1e-9)
    # fp32 training keeps no separate master (the parameter is it): 4 + 8 B, the same 12 B
    import dataclasses

    fp32 = dataclasses.replace(lab_problem, training=dataclasses.replace(lab_problem.training, precision="fp32"))
    assert switch_move_s(fp32) == pytest.approx(expected, rel=1e-9)
