"""A row's limit (compare/limit.py [Note: a row's limit]): the arithmetic by hand, and the
replay of a step's collectives against what they carry."""

from __future__ import annotations

import pytest

from amsp_ext.compare import limit


def test_limit_fields_by_hand():
    got = limit.limit_of(step_s=0.5, compute_only_s=0.3, comm_only_s=0.4, exposed_comm_s=0.1)
    assert got["bound_s"] == 0.4  # max(0.3, 0.4)
    assert got["efficiency"] == pytest.approx(0.8)  # 0.4 / 0.5
    assert got["hidden_fraction"] == pytest.approx(0.75)  # 1 - 0.1 / 0.4
    # exposing more than the collectives need alone reads below zero, not clipped
    assert limit.limit_of(step_s=1.0, compute_only_s=0.2, comm_only_s=0.1,
                          exposed_comm_s=0.3)["hidden_fraction"] == pytest.approx(-2.0)
    # a missing part leaves what depends on it unset, never a guess
    none = limit.limit_of(step_s=1.0, compute_only_s=None, comm_only_s=0.2, exposed_comm_s=None)
    assert none == {"compute_only_s": None, "comm_only_s": 0.2, "bound_s": None, "efficiency": None,
                    "hidden_fraction": None, "last_backward_s": None}


def test_parts_from_a_hand_made_timeline():
    # two ranks, four steps, one of warm-up: per step the slower rank, then the median
    ranks = [{"step_s": [9.0, 0.30, 0.20, 0.50]}, {"step_s": [8.0, 0.10, 0.40, 0.45]}]
    assert limit.compute_only_of(ranks, num_warmup=1) == pytest.approx(0.40)  # median(0.3, 0.4, 0.5)
    backward = [{"last_backward_s": [1.0, 0.1, 0.2, 0.3]}, {"last_backward_s": [1.0, 0.2, 0.1, 0.1]}]
    assert limit.compute_only_of(backward, 1, "last_backward_s") == pytest.approx(0.2)  # (0.2, 0.2, 0.3)
    # three replays: per replay the slower rank (0.2, 0.3, 0.9), then the median
    alone = [{"comm_alone": [{"s": 0.2}, {"s": 0.1}, {"s": 0.9}]},
             {"comm_alone": [{"s": 0.1}, {"s": 0.3}, {"s": 0.4}]}]
    assert limit.comm_only_of(alone) == pytest.approx(0.3)
    assert limit.comm_only_of([alone[0], {"comm_alone": None}]) is None


def test_rounds_combine_each_part_then_the_ratios():
    rounds = [{"limit": {"compute_only_s": 0.3, "comm_only_s": 0.5, "last_backward_s": 0.1}},
              {"limit": {"compute_only_s": None, "comm_only_s": 0.7}},
              {"limit": {"compute_only_s": None, "comm_only_s": 0.6}}]
    got = limit.combine(rounds, step_s=0.8, exposed_comm_s=0.3)
    assert got["compute_only_s"] == 0.3 and got["comm_only_s"] == 0.6
    assert got["bound_s"] == 0.6 and got["efficiency"] == pytest.approx(0.75)
    assert got["hidden_fraction"] == pytest.approx(0.5)
    table = limit.limit_table([{"status": "ok", "label": "X", "median_step_s": 0.8, "exposed_comm_s": 0.3,
                                "limit": got}])
    assert table[-1] == "| X | 800.0 | 300.0 | 600.0 | 600.0 | 0.75 | 300.0 | 0.50 | 100.0 |"


@pytest.mark.distributed
def test_a_recorded_step_replays_every_collective_it_issued():
    """DDP's reducer (from C++), an all-gather and a broadcast on a subgroup: every one recorded,
    in order, and the replay moves the bytes computed by hand."""
    import json

    from tests.dist_utils import run_ranks

    proc = run_ranks(2, "tests.replay_worker", timeout=120)
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPLAY "))[7:])
    # DDP fills a bucket until it holds at least its cap (5,000 B): a layer's 4,224 B and the
    # next layer's bias, then its weight closes it - two buckets of two layers
    assert got["ops"] == ["c10d::allreduce_"] * 2 + ["c10d::_allgather_base_", "c10d::broadcast_"], got
    layer = (32 * 32 + 32) * 4
    # every gradient once; the all-gather's output (400 B) and input (200 B); 7 doubles
    assert got["bytes"] == 4 * layer + 400 + 200 + 56, got
    assert got["count"] == 4 and got["s"] > 0
