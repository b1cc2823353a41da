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
                    "hidden_fraction": None, "last_backward_s": None, "reason": None}


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


def test_a_missing_part_says_why_in_the_row_and_the_report():
    failed = {"status": "failed", "reason": "exited 1: RuntimeError: boom"}
    why = limit.why_missing(failed, compute_only_s=None, comm_only_s=0.2, traced=True)
    assert why == "compute only: the job failed: exited 1: RuntimeError: boom"
    assert limit.why_missing({"status": "ok"}, compute_only_s=0.1, comm_only_s=None, traced=False) == \
        "comm only: not measured (trace off: the replay follows the profiled steps)"
    # a round that ran no compute-only job was not asked for the limit: nothing to explain
    assert limit.why_missing(None, compute_only_s=None, comm_only_s=None, traced=False) is None
    rounds = [{"limit": limit.limit_of(step_s=1.0, compute_only_s=None, comm_only_s=0.2, exposed_comm_s=0.1,
                                       reason=why)},
              {"limit": {"compute_only_s": None, "comm_only_s": 0.4, "reason": None}}]
    got = limit.combine(rounds, step_s=1.0, exposed_comm_s=0.1)
    assert got["compute_only_s"] is None and got["reason"] == why
    # another round's figure fills the part: its reason is moot
    rounds.append({"limit": {"compute_only_s": 0.5, "comm_only_s": 0.3, "reason": None}})
    assert limit.combine(rounds, step_s=1.0, exposed_comm_s=0.1)["reason"] is None
    table = limit.limit_table([{"status": "ok", "label": "ZeRO-3", "median_step_s": 1.0, "exposed_comm_s": 0.1,
                                "limit": got}])
    assert table[-1] == f"- ZeRO-3: {why}" and table[2].startswith("| ZeRO-3 | 1000.0 | — | 300.0 | — |")


@pytest.mark.distributed
@pytest.mark.slow  # six 4-rank DeepSpeed launches, ~2.5 min (conftest.py [Note: test tiers]); the
# default tier reaches the limit's fields through the arithmetic above
def test_deepspeed_rows_reach_their_limit(tmp_path):
    """DeepSpeed ZeRO-1, ZeRO-3 and MiCS (a real shard group: 2 logical nodes of 2) each get every
    limit field: their steps ran again on the fake group (systems/deepspeed_zero.py [Note:
    DeepSpeed's steps under the fake group]) and their step's collectives were replayed."""
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.harness import run_comparison
    from amsp_ext.compare.launch import LaunchConfig

    spec = RunSpec(model="tiny-llama", seq_len=16, micro_batch_size=1, num_micro_batches=2, num_steps=2,
                   num_warmup_steps=1, precision="fp32", gpus_per_node=2, limit_rounds=1, dist_timeout_s=120)
    systems = ["zero1", "zero3", "mics"]
    path, rows = run_comparison(mode="baselines", spec=spec, launch=LaunchConfig(nproc_per_node=4, timeout_s=300),
                                out_dir=tmp_path, command="pytest", systems=systems, progress=lambda s: None)
    by = {r["key"]: r for r in rows}
    for key in systems:
        row = by[key]
        assert row["status"] == "ok", (key, row.get("reason"))
        lim, run = row["limit"], row["compute_only_run"]
        assert run["status"] == "ok" and run["backends"] == ["fake"], (key, run)
        assert all(lim[f] is not None for f in limit.LIMIT_FIELDS) and lim["reason"] is None, (key, lim)
        assert lim["compute_only_s"] > 0 and lim["comm_only_s"] > 0, (key, lim)
        assert lim["bound_s"] == max(lim["compute_only_s"], lim["comm_only_s"]), (key, lim)
    text = path.read_text()
    assert all(f"| {by[k]['label']} | " in text.split("### Each row against its limit")[1] for k in systems)


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
