"""The non-finite guard (amsp_ext/runtime/optim/nonfinite.py), 4 ranks (tests/nonfinite_worker.py): a NaN
loss on rank 2 at step 3 is skipped on every rank in fp32, bf16 and fp16, and on the replicate
plan, whose norm is not all-reduced, with a NaN that leaves the gradients finite (the weights
are exactly those before the step, and finite) and training goes on; three bad steps in a row (steps 6-8)
stop every rank at the same step with one line. The control with the guard off applies the NaN
step, so the checks can fail."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    proc = run_ranks(4, "tests.nonfinite_worker", timeout=300)
    out: dict[str, dict[int, dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out.setdefault(r["case"], {})[r["rank"]] = r
    return out


@pytest.mark.parametrize("case", ["fp32-clip", "bf16-noclip", "fp16-noclip", "fp32-replicate-clip"])
def test_nan_step_skipped_everywhere_then_three_stop_the_job(results, case):
    ranks = results[case]
    assert sorted(ranks) == [0, 1, 2, 3]
    for r in ranks.values():
        by_step = {row["step"]: row for row in r["rows"]}
        nan = by_step[3]
        assert not nan["applied"] and nan["unchanged"] and nan["finite"], (case, nan)
        assert all(by_step[s]["applied"] for s in (0, 1, 2, 4, 5)), (case, r["rows"])  # it goes on
        assert r["final_finite"], case
        err = r["error"]
        assert err is not None and err["step"] == 8, (case, err)  # the third bad step in a row
        assert "\n" not in err["message"] and "3 consecutive steps had a non-finite loss" in err["message"]
        assert "steps 6-8" in err["message"] and "rank(s) 2" in err["message"], err
    log = ranks[0]["log"]
    if case != "fp16-noclip":  # under fp16 the first NaN is a loss-scale overflow, not counted
        assert any("step 3 skipped on every rank: non-finite loss on rank(s) 2" in m for m in log), log
    assert any("step 6 skipped on every rank: non-finite loss on rank(s) 2" in m for m in log), log
    assert not ranks[1]["log"]  # rank 0 logs


def test_without_the_guard_the_nan_step_is_applied(results):
    for r in results["fp32-guard-off"].values():
        nan = next(row for row in r["rows"] if row["step"] == 3)
        assert nan["applied"] and not nan["finite"] and not r["final_finite"], nan
