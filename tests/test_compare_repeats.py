"""`amsp compare --repeats N`: the round order, one row from its rounds, per-round ratios, failed
rounds - by hand-computed values - and the harness end to end with two rounds (2 ranks)."""

from __future__ import annotations

import json
import statistics

import pytest

from amsp_ext.compare.config import RunSpec, SpecError
from amsp_ext.compare.report import format_table, ratios
from amsp_ext.compare.rounds import combine_rounds, paired_ratio, round_order, validate_repeats


def test_repeats_must_be_at_least_one():
    assert validate_repeats(1) == 1 and validate_repeats(4) == 4
    for bad in (0, -2, 1.5, True):
        with pytest.raises(SpecError) as e:
            validate_repeats(bad)
        assert "--repeats" in str(e.value) and "\n" not in str(e.value)


def test_round_order_alternates_and_balances_positions():
    # Written out by hand from the scheme: rotate left by r // 2, reverse odd rounds.
    assert [round_order("abc", r) for r in range(6)] == [
        list("abc"), list("cba"), list("bca"), list("acb"), list("cab"), list("bac")]
    # Two systems: x y | y x | x y ... pairwise reversed (ABBA over rounds 1-4, cancelling a
    # linear drift in load).
    assert [round_order(["x", "y"], r) for r in range(4)] == [["x", "y"], ["y", "x"], ["y", "x"], ["x", "y"]]
    # Over 2 x n rounds every system takes every position exactly twice.
    for n in (2, 3, 4, 5):
        items = list(range(n))
        orders = [round_order(items, r) for r in range(2 * n)]
        for s in items:
            positions = sorted(o.index(s) for o in orders)
            assert positions == sorted(list(range(n)) * 2), (n, s, positions)
    assert round_order([], 3) == []


def _round(rnd, tgs, *, status="ok", reason=None, step=None):
    if status != "ok":
        return {"key": "k", "label": "K", "status": status, "reason": reason, "round": rnd, "position": 1}
    return {"key": "k", "label": "K", "system": "ddp", "status": "ok", "round": rnd, "position": 1,
            "tokens_per_gpu_per_s": tgs, "median_step_s": step or 100.0 / tgs, "mfu": None,
            "loss": [5.0 + rnd, 4.0], "peak_rss_delta_bytes": [rnd], "live_tensor_delta_bytes": [rnd],
            "comm_s": None, "exposed_comm_s": None, "flops_per_token": 10.0}


def test_combine_rounds_median_range_and_failed_round():
    rounds = [_round(1, 100.0), _round(2, 0, status="failed", reason="timed out after 60 s"),
              _round(3, 400.0), _round(4, 250.0)]
    row = combine_rounds(rounds, mfu_of=lambda r, tgs: tgs * r["flops_per_token"] / 1e4)
    assert row["status"] == "ok" and row["num_rounds"] == 4 and row["num_ok_rounds"] == 3
    assert row["tokens_per_gpu_per_s"] == 250.0  # median of 100, 400, 250
    assert row["tokens_per_gpu_per_s_range"] == [100.0, 400.0]
    assert row["tokens_per_gpu_per_s_rounds"] == [100.0, None, 400.0, 250.0]
    assert row["median_step_s"] == pytest.approx(0.4)  # median of 1.0, 0.25, 0.4
    assert row["mfu"] == pytest.approx(0.25)
    assert row["loss"] == [6.0, 4.0]  # the first ok round's
    assert row["failed_rounds"] == [{"round": 2, "status": "failed", "reason": "timed out after 60 s"}]
    assert row["reason"] == "round 2 failed: timed out after 60 s"
    line = next(x for x in format_table([row]).splitlines() if x.startswith("| K |"))
    assert line.startswith("| K | 250 (100–400) |")
    assert line.endswith("| ok; round 2 failed: timed out after 60 s |")

    same = combine_rounds([_round(1, 0, status="failed", reason="x"), _round(2, 0, status="failed", reason="x"),
                           _round(3, 0, status="skipped", reason="CUDA only: y")])
    assert same["status"] == "failed" and same["num_ok_rounds"] == 0
    assert same["reason"] == "rounds 1,2 failed: x; round 3 skipped: CUDA only: y"
    same = combine_rounds([_round(1, 0, status="failed", reason="x"), _round(2, 0, status="failed", reason="x")])
    assert same["status"] == "failed" and same["reason"] == "x (all 2 rounds)"



def test_communication_is_the_median_over_the_profiled_rounds():
    """Each round profiles a step; comm, exposed comm and the breakdown's totals are the median
    over rounds of each round's median over ranks (here 3 ok rounds, one without a trace)."""
    def bd(comm, exposed):
        return {"rows": [], "totals": {"step_s": 1.0, "compute_s": 0.5, "comm_s": comm, "exposed_s": exposed,
                                        "count": 1, "bytes": 0},
                "median_over_ranks": {"total": {"comm_s": comm, "exposed_s": exposed},
                                      "AR": {"busy_s": comm, "exposed_s": exposed}}}
    rounds = [_round(1, 100.0), _round(2, 300.0), _round(3, 200.0), _round(4, 0, status="failed", reason="x")]
    for r, (c, e) in zip(rounds, ((0.30, 0.20), (0.10, 0.05), (0.20, 0.15))):
        r.update(comm_s=c, exposed_comm_s=e, breakdown=bd(c, e))
    rounds[2].update(comm_s=None, exposed_comm_s=None, breakdown=None)  # round 3 not profiled
    row = combine_rounds(rounds)
    assert row["comm_s"] == pytest.approx(0.20) and row["exposed_comm_s"] == pytest.approx(0.125)
    assert row["num_profiled_rounds"] == 2
    med = row["breakdown"]["median_over_rounds"]
    assert med["total"] == {"comm_s": pytest.approx(0.20), "exposed_s": pytest.approx(0.125)}
    assert med["AR"]["exposed_s"] == pytest.approx(0.125)
    assert row["breakdown"]["totals"]["comm_s"] == 0.30  # the per-phase detail: round 1's


def test_the_row_keeps_one_timeline_not_one_per_round():
    rounds = [_round(1, 100.0), _round(2, 300.0)]
    for r in rounds:
        r["breakdown"] = {"totals": {"comm_s": 0.1}, "timeline": {"collectives": {"0": [{"issued": 0.0}]}}}
    row = combine_rounds(rounds)
    assert row["breakdown"]["timeline"] == {"collectives": {"0": [{"issued": 0.0}]}}  # round 1's, for the figure
    assert [set(rd["breakdown"]) for rd in row["rounds"]] == [{"totals"}, {"totals"}]
    assert all("timeline" in r["breakdown"] for r in rounds)  # the caller's rounds are not changed

def test_ratios_are_medians_of_per_round_ratios():
    a = {"key": "amsp-plan", "system": "amsp-plan", "label": "AMSP", "status": "ok",
         "tokens_per_gpu_per_s": 300.0, "num_rounds": 3,
         "tokens_per_gpu_per_s_rounds": [300.0, 200.0, 600.0]}
    b = {"key": "ddp", "system": "ddp", "label": "DDP", "status": "ok",
         "tokens_per_gpu_per_s": 200.0, "num_rounds": 3, "tokens_per_gpu_per_s_rounds": [100.0, 400.0, None]}
    rec = paired_ratio(a, b)
    # Round 3 has no DDP number: ratios 3.0 and 0.5 -> median 1.75 (not 300/200 = 1.5).
    assert rec["per_round"] == [3.0, 0.5, None]
    assert rec["median"] == 1.75 and (rec["min"], rec["max"]) == (0.5, 3.0)
    # quartiles of (0.5, 3.0), inclusive: 0.5 + 2.5/4 and 0.5 + 3 x 2.5/4
    assert (rec["q1"], rec["q3"], rec["rounds_above_target"]) == (1.125, 2.375, 1)
    assert ratios([a, b]) == ["- AMSP / DDP: 1.75x (median of 2 per-round ratios (3 rounds), IQR 1.12–2.38x, "
                              "range 0.50–3.00x, 1 of 2 above 1.0x; wire bytes not measured (no trace): not "
                              "checked); not a claim (? timed steps, 2 rounds; a claim needs >= 10 timed "
                              "steps and >= 5 rounds)"]




def test_amsp_mics_config_is_compared_with_hsdp_round_by_round():
    """Issue 23's engine target, the MiCS config against FSDP2 HSDP (same sharding): the median
    of the per-round ratios 1.5, 0.5 and 1.2 is 1.2."""
    mk = lambda key, label, rounds: {"key": key, "system": key, "label": label, "status": "ok",  # noqa: E731
                                     "tokens_per_gpu_per_s": rounds[0], "num_rounds": 3,
                                     "tokens_per_gpu_per_s_rounds": rounds}
    rows = [mk("hsdp", "FSDP2 HSDP", [100.0, 400.0, 250.0]), mk("amsp-mics", "AMSP MiCS", [150.0, 200.0, 300.0])]
    assert ratios(rows)[0].startswith("- AMSP (MiCS config) / FSDP2 HSDP: 1.20x (median of 3 per-round ratios, "
                                      "IQR 0.85–1.35x, range 0.50–1.50x, 2 of 3 above 1.0x; engine only: the "
                                      "same sharding on torch's engine;")

def test_an_all_amsp_mode_does_not_say_its_rows_did_not_run():
    """Ablation rows are all AMSP, so there is no AMSP/baseline ratio; the ratios section used to
    say "AMSP rows did not run" of four rows that all ran."""
    from amsp_ext.compare.report import _no_ratio_line, ablation_table

    rows = [{"key": f"amsp-plan[M=4,{o}]", "system": "amsp-plan", "label": f"AMSP {o}", "status": "ok",
             "tokens_per_gpu_per_s": t, "spec": {"num_micro_batches": 4, "amsp_overlap": o}}
            for o, t in (("all", 200.0), ("none", 150.0))]
    assert ratios(rows) == []
    assert _no_ratio_line(rows, {"mode": "ablation"}) == (
        "- ablation mode: every row is AMSP; the comparison is the ablation table below.")
    assert "did not run" not in _no_ratio_line(rows, {"mode": "ablation"})
    assert ablation_table(rows)[-1].startswith("| 4 | 200 |") and "150 (-25.0%)" in ablation_table(rows)[-1]


def test_an_ablation_can_time_peers_beside_its_rows():
    """`--mode ablation --systems hsdp`: the four overlap settings of the AMSP row, then HSDP, all in
    the same rounds; without --systems the ablation is the AMSP rows alone, as before."""
    from amsp_ext.compare.harness import plan_runs
    from amsp_ext.compare.report import _no_ratio_line, ratio_records

    spec = RunSpec(amsp_plan="mics:2", num_micro_batches=2)
    keys = [i.key for i in plan_runs("ablation", spec, ["hsdp"])]
    assert keys == ["amsp-plan[M=2,all]", "amsp-plan[M=2,no_bc]", "amsp-plan[M=2,no_bc_ar]",
                    "amsp-plan[M=2,none]", "hsdp"]
    assert [i.key for i in plan_runs("ablation", spec)] == keys[:4]
    with pytest.raises(SpecError, match=r"systems: unknown \['hsdpx'\]"):
        plan_runs("ablation", spec, ["hsdpx"])
    # each setting against the peer, paired by round: all on 1.2x, 1.0x, 1.1x HSDP
    rows = [{"key": f"amsp-plan[M=2,{o}]", "system": "amsp-plan", "label": f"AMSP {o}", "status": "ok",
             "tokens_per_gpu_per_s": t[0], "num_rounds": 3, "tokens_per_gpu_per_s_rounds": t,
             "spec": {"num_micro_batches": 2, "amsp_overlap": o, "amsp_plan": "mics:2"}}
            for o, t in (("all", [120.0, 100.0, 110.0]), ("none", [90.0, 80.0, 100.0]))]
    rows.append({"key": "hsdp", "system": "hsdp", "label": "FSDP2 HSDP", "status": "ok", "num_rounds": 3,
                 "tokens_per_gpu_per_s": 100.0, "tokens_per_gpu_per_s_rounds": [100.0, 100.0, 100.0]})
    got = {(r["numerator"], r["denominator"]): r["median"] for r in ratio_records(rows)}
    assert got == pytest.approx({("amsp-plan[M=2,all]", "hsdp"): 1.1, ("amsp-plan[M=2,none]", "hsdp"): 0.9})
    rows[-1]["status"] = "failed"
    assert ratio_records(rows) == [] and _no_ratio_line(rows, {"mode": "ablation"}) == (
        "- ablation mode: the AMSP rows are compared in the ablation table below; no peer timed "
        "beside them ran.")

def _fake_rank(rank, step_s):
    return {"rank": rank, "step_s": step_s, "loss": [5.0, 4.5], "peak_rss_delta_bytes": 2**20,
            "live_tensor_delta_bytes": 2**19, "setup_s": 0.1, "peak_flops": 1e9}


def test_harness_rounds_order_and_failed_round_without_launching(tmp_path, monkeypatch):
    """Round bookkeeping of run_comparison with run_system replaced by a fake: the calls happen
    in the recorded order, a round that fails is kept and named, medians come from the rounds."""
    from amsp_ext.compare import harness
    from amsp_ext.compare.launch import LaunchConfig

    calls = []
    # tokens/GPU/s per (system, round) = 64 / step time; zero1 fails in round 2.
    step = {("ddp", 1): 0.5, ("ddp", 2): 0.25, ("ddp", 3): 1.0,
            ("zero1", 1): 1.0, ("zero1", 3): 0.5, ("zero3", 1): 2.0, ("zero3", 2): 1.0, ("zero3", 3): 0.5}

    def fake_run_system(system, spec, out, launch, *, row_key=None):
        calls.append((system, spec.trace, out.parent.name))
        rnd = int(out.parent.name.removeprefix("round"))
        if (system, rnd) not in step:
            return {"system": system, "status": "failed", "reason": "exited 1: boom", "wall_s": 1.0}
        t = step[(system, rnd)]
        return {"system": system, "status": "ok", "wall_s": 1.0, "world_size": 2, "num_nodes": 1,
                "gpus_per_node": 2, "ranks": [_fake_rank(0, [9.0, t]), _fake_rank(1, [9.0, t / 2])]}

    monkeypatch.setattr(harness, "run_system", fake_run_system)
    spec = RunSpec(model="tiny-llama", seq_len=32, micro_batch_size=1, num_micro_batches=2,
                   num_steps=2, num_warmup_steps=1, precision="fp32", limit_rounds=0)
    path, rows = harness.run_comparison(mode="baselines", spec=spec, launch=LaunchConfig(nproc_per_node=2),
                                        out_dir=tmp_path, command="pytest", systems=["ddp", "zero1", "zero3"],
                                        repeats=3, progress=lambda s: None)
    assert [(s, rd) for s, _, rd in calls] == [
        ("ddp", "round1"), ("zero1", "round1"), ("zero3", "round1"),
        ("zero3", "round2"), ("zero1", "round2"), ("ddp", "round2"),
        ("zero1", "round3"), ("zero3", "round3"), ("ddp", "round3")]
    assert [trace for _, trace, _ in calls] == [True] * 9  # every round profiles a step
    data = json.loads((path.with_suffix("") / "results.json").read_text())
    assert data["meta"]["round_orders"] == [["ddp", "zero1", "zero3"], ["zero3", "zero1", "ddp"],
                                            ["zero1", "zero3", "ddp"]]
    by = {r["key"]: r for r in data["rows"]}
    assert by["ddp"]["tokens_per_gpu_per_s"] == 128.0  # 64/0.5, 64/0.25, 64/1.0 -> median 128
    assert by["ddp"]["tokens_per_gpu_per_s_range"] == [64.0, 256.0]
    assert by["zero1"]["status"] == "ok" and by["zero1"]["tokens_per_gpu_per_s"] == 96.0  # (64+128)/2
    assert by["zero1"]["failed_rounds"] == [{"round": 2, "status": "failed", "reason": "exited 1: boom"}]
    assert [r["position"] for r in by["zero1"]["rounds"]] == [2, 2, 1]
    assert "ok; round 2 failed: exited 1: boom" in path.read_text()
    assert path.name.endswith("_repeats3.md")


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow  # four launches, ~30 s: rounds and medians reach the default tier through the stand-in runs above, launches through test_compare_harness.py::test_harness_end_to_end_two_ranks
def test_harness_two_rounds_two_ranks(tmp_path):
    from amsp_ext.compare.harness import run_comparison
    from amsp_ext.compare.launch import LaunchConfig

    spec = RunSpec(model="tiny-llama", seq_len=32, micro_batch_size=1, num_micro_batches=2,
                   num_steps=2, num_warmup_steps=1, precision="fp32", amsp_plan="zero1",
                   trace=False, limit_rounds=0, dist_timeout_s=120)
    path, _ = run_comparison(mode="baselines", spec=spec, launch=LaunchConfig(nproc_per_node=2, timeout_s=240),
                             out_dir=tmp_path, command="pytest", systems=["ddp", "amsp-plan"],
                             repeats=2, progress=lambda s: None)
    data = json.loads((path.with_suffix("") / "results.json").read_text())
    assert data["meta"]["repeats"] == 2
    assert data["meta"]["round_orders"] == [["ddp", "amsp-plan"], ["amsp-plan", "ddp"]]
    by = {r["key"]: r for r in data["rows"]}
    tokens = spec.micro_batch_size * spec.seq_len * spec.num_micro_batches
    per_round = {}
    from test_compare_harness import _reference_losses

    ref = _reference_losses(spec, world=2, steps=1)
    for key in ("ddp", "amsp-plan"):
        row = by[key]
        assert row["status"] == "ok", row.get("reason")
        # step 0: a forward pass of the same initial weights on the same tokens, both rounds
        assert all(rd["loss"][0] == pytest.approx(ref[0], rel=1e-5) for rd in row["rounds"]), key
        assert len(row["loss"]) == 2 and row["mfu"] > 0 and max(row["live_tensor_delta_bytes"]) > 0
        assert [rd["round"] for rd in row["rounds"]] == [1, 2]
        assert all(rd["status"] == "ok" for rd in row["rounds"]), [rd.get("reason") for rd in row["rounds"]]
        # One timed step after one warm-up step: tokens/GPU/s of a round = tokens / step_s[1].
        per_round[key] = [tokens / rd["step_s"][1] for rd in row["rounds"]]
        for rd, tgs in zip(row["rounds"], per_round[key]):
            assert rd["tokens_per_gpu_per_s"] == pytest.approx(tgs)
        t1, t2 = per_round[key]
        assert row["tokens_per_gpu_per_s"] == pytest.approx((t1 + t2) / 2)
        assert row["tokens_per_gpu_per_s_range"] == pytest.approx([min(t1, t2), max(t1, t2)])
    # The order really ran: round 1 DDP before AMSP, round 2 the reverse, round 2 after round 1.
    d, a = by["ddp"]["rounds"], by["amsp-plan"]["rounds"]
    assert d[0]["started_at"] < a[0]["started_at"] < a[1]["started_at"] < d[1]["started_at"]
    assert [d[0]["position"], a[0]["position"], a[1]["position"], d[1]["position"]] == [1, 2, 1, 2]
    r1, r2 = (x / y for x, y in zip(per_round["amsp-plan"], per_round["ddp"]))
    rec = next(r for r in data["ratios"] if r["numerator"] == "amsp-plan" and r["denominator"] == "ddp")
    assert rec["per_round"] == pytest.approx([r1, r2])
    assert rec["median"] == pytest.approx(statistics.fmean([r1, r2]))
    assert (rec["min"], rec["max"]) == pytest.approx((min(r1, r2), max(r1, r2)))
    text = path.read_text()
    assert f"AMSP (plan zero1) / DDP: {(r1 + r2) / 2:.2f}x (median of 2 per-round ratios" in text
    assert "### Rounds (2)" in text and "| DDP |" in text and "| AMSP (plan zero1) |" in text
    assert (path.with_suffix("") / "runs" / "round2" / "ddp" / "log.txt").exists()
