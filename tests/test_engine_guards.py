"""Guard rails (bad plan before any collective, mismatched ranks, timeouts naming their group)
and the trace (amsp:: labels; broadcasts of step k waited inside step k+1's forward)."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.distributed


def _lines(proc):
    return [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]


@pytest.fixture(scope="module")
def launch():
    """ONE 4-rank launch for the trace, then the guards (which end the launch: the timeout case
    breaks a group on purpose)."""
    return _lines(run_ranks(4, "tests.engine_worker", "trace,guards", "2", timeout=300))


@pytest.fixture(scope="module")
def guards(launch):
    return [r for r in launch if r["case"] != "trace"]


def test_unfit_plan_refused_before_any_collective(guards):
    unfit = [r for r in guards if r["case"].startswith("unfit:")]
    assert len(unfit) == 16  # 4 cases x 4 ranks
    for r in unfit:
        assert r["error"] and "\n" not in r["error"], r
        assert r["collectives_issued"] == 0 and r["groups_created"] == 0, r
    msgs = {r["case"]: r["error"] for r in unfit if r["rank"] == 0}
    assert "s0_os=4 > R=2" in msgs["unfit:p=4x1,g=4x1,os=4x1:{}"]
    assert "gpus_per_node=3" in msgs["unfit:p=1x1,g=1x1,os=2x1:{'gpus_per_node': 3}"]


def test_only_the_groups_collectives_run_on_are_built(guards):
    # 2 x 2: DDP's plan all-reduces over the world (one group, or its two levels as well); MiCS's
    # p=2x1 adds the node's shard group and the broadcast group; no group of one rank, no optim
    want = {"p=1x1,g=1x1,os=1x1:{}": 1, "p=1x1,g=1x1,os=1x1:{'all_reduce': 'two_level'}": 3,
            "p=2x1,g=2x1,os=2x2:{}": 3}
    rows = [r for r in guards if r["case"].startswith("groups:")]
    assert len(rows) == 4 * len(want)
    for r in rows:
        assert r["groups_created"] == want[r["case"][len("groups:"):]], r


def test_mismatched_ranks_detected_at_init(guards):
    for what in ("plan", "config"):
        rows = [r for r in guards if r["case"] == f"mismatch:{what}"]
        assert len(rows) == 4 and all(r["error"] for r in rows), rows
        assert f"disagree on the {what}" in rows[0]["error"]
    plan_err = next(r for r in guards if r["case"] == "mismatch:plan")["error"]
    assert "p=1x1,g=1x1,os=2x2" in plan_err and "p=1x1,g=1x1,os=2x1" in plan_err


def test_config_mismatch_names_the_field(guards):
    err = next(r for r in guards if r["case"] == "mismatch:config")["error"]
    assert "field precision: 'fp32' on rank 0, 'bf16' on rank 1" in err and "\n" not in err, err


def test_initial_weights_agree(guards):
    rows = [r for r in guards if r["case"] == "init-weights"]
    assert len(rows) == 4
    for r in rows:
        assert r["keys"] == 21 and r["max_abs_diff_between_seeds"] > 0.01, r  # the seeds differ
        assert r["max_abs_diff_to_rank0_seed"] == 0.0, r  # every rank trains rank 0's model
        assert r["check_error_same_seed"] is None, r
        err = r["check_error_rank_seed"]
        assert err and "initial weights differ (rank(s) 1, 2, 3 vs rank 0)" in err and "\n" not in err, r


def test_auto_plan_is_the_planners_choice(guards):
    rows = [r for r in guards if r["case"] == "auto"]
    assert len(rows) == 4
    assert {r["plan"] for r in rows} == {rows[0]["planner_direct"]}
    assert all(r["losses"][-1] < r["losses"][0] for r in rows)  # it trains
    assert "config.auto=AutoPlanConfig" in rows[0]["missing_config_error"]


def test_timeout_names_its_group(guards):
    r0 = next(r for r in guards if r["case"] == "timeout" and r["rank"] == 0)
    assert "optim_bcast[0,1]" in r0["error"] and "did not complete within 3s" in r0["error"], r0
    assert 2.5 <= r0["seconds"] <= 30, r0
    others = [r for r in guards if r["case"] == "timeout" and r["rank"] in (2, 3)]
    assert all(r["error"] is None for r in others)  # the healthy group is unaffected


def test_trace_labels_and_broadcast_overlap(launch):
    (r,) = [r for r in launch if r["case"] == "trace"]
    on, off = r["True"], r["False"]
    for label in ("amsp::all_gather::param_shard", "amsp::reduce_scatter::param_shard",
                  "amsp::all_reduce::grad", "amsp::all_reduce::param_replica",
                  "amsp::broadcast::optim_bcast", "amsp::wait::broadcast::optim_bcast",
                  "amsp::grad_hook::param_replica", "amsp::select_and_drop"):
        assert label in on["labels"], label
    # overlap on: all of step k's broadcasts are issued before any is waited for, and every
    # wait happens inside a forward of step k+1 (module pre-hooks), none inside the step
    # (tiny-llama: 21 tensors, small enough that each owner's go out as one packed broadcast)
    n = on["num_items"]
    assert on["num_tensors"] == 21 and 2 <= n <= 21, on
    assert on["issued_before_first_wait"] == n
    assert on["bcast_waits"]["forward"] == 2 * n  # steps 1 and 2 wait for steps 0 and 1
    assert on["bcast_waits"]["step"] == 0 and on["bcast_waits"]["other"] == 0
    assert "amsp::pre_forward_wait::optim_bcast" in on["labels"]
    assert on["busy_before_after_state_dict"] == [True, False]  # state_dict waits for them
    # overlap off: the waits happen in the optimizer step
    assert off["bcast_waits"]["forward"] == 0 and off["bcast_waits"]["step"] == 3 * n
