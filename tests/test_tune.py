"""amsp tune without a cluster: the candidate rule, the statistics of the report (against hand
values), the collective trace's busy/exposed arithmetic, the report files from a synthetic
result, and the flags' one-line errors."""

import json
import subprocess
import sys

import math

import pytest

from amsp_ext import schema
from amsp_ext.planner.search import search
from amsp_ext.runtime.measure.comm_trace import CommTrace, kind_of, union_length
from amsp_ext.tune.analysis import aggregate, compute_drift, ranks, regret, reliability, spearman
from amsp_ext.tune.candidates import choose_plans, make_problems
from amsp_ext.tune.report import build_result, write_report
from amsp_ext.tune.spec import TuneConfig
from dist_utils import REPO

LAB_PROFILE = str(REPO / "configs" / "clusters" / "lab-2x2.profile.json")


def config(**tune) -> TuneConfig:
    return schema.from_dict(TuneConfig, {
        "model": "tiny-llama", "planner": {"profile": LAB_PROFILE, "memory_reserve": "0B"},
        "batch": {"seq_len": 64, "micro_batch_size": 2, "num_micro_batches": 1, "steps": 3},
        "engine": {"granularity": "layer"}, "tune": tune})


def test_spearman_and_ranks_by_hand():
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # d = rank differences (0, 0, 1, -1): rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)
    assert spearman([1, 2], [2, 1]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_measurement_reliability_by_hand():
    # two rounds: the split is round 1 vs round 2
    same = reliability({"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]})
    assert same["split_half"] == pytest.approx(1.0) and same["ceiling"] == pytest.approx(1.0)
    swapped = reliability({"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 2.5], "d": [4.0, 1.5]})
    # round ranks (1,2,3,4) vs (1,3,4,2): rho 0.4; Spearman-Brown 0.8 / 1.4; ceiling its root
    assert swapped["split_half"] == pytest.approx(0.4)
    assert swapped["full"] == pytest.approx(0.8 / 1.4)
    assert swapped["ceiling"] == pytest.approx(math.sqrt(0.8 / 1.4))
    # four rounds: 3 distinct balanced splits ({0,1}, {0,2}, {0,3}); plan c's rounds make the
    # splits (1,2,3 vs 1,2,3), (1,3,2 vs 1,3,2)...: hand-checked medians below
    four = reliability({"a": [1, 1, 1, 1], "b": [2, 2, 3.5, 3.5], "c": [3, 3, 3, 3]})
    assert four["num_splits"] == 3
    # {0,1} vs {2,3}: (1,2,3) vs (1,3.5,3) -> rho 0.5; {0,2}/{1,3} and {0,3}/{1,2}: medians
    # b = 2.75 both halves, c = 3: rho 1.0 -> median over splits 1.0
    assert four["split_half"] == pytest.approx(1.0)
    assert reliability({"a": [1, 2], "b": [2, 1]}) is None  # fewer than 3 plans
    assert reliability({"a": [1], "b": [2], "c": [3]}) is None  # one round


def test_compute_drift_by_hand():
    # forward FLOPs of one micro-batch: 3 / 3 per token x 10 x 2 tokens = 20; probe medians 0.25 s
    # forward (80 FLOP/s) and 0.5 s backward (2 x 20 / 0.5 = 80 FLOP/s) against 100 and 50
    result = {"meta": {"calibration": {"forward_flops_per_s": 100.0, "backward_flops_per_s": 50.0},
                       "flops_per_token": 3.0,
                       "job": {"seq_len": 10, "micro_batch_size": 2, "recompute": False}},
              "probes": [{"forward_s": f, "backward_s": b} for f, b in ((0.2, 0.4), (0.25, 0.5),
                                                                        (0.3, 0.9))]}
    drift = compute_drift(result)
    assert drift["forward"] == pytest.approx(-0.2) and drift["backward"] == pytest.approx(0.6)
    result["meta"]["calibration"] = None
    assert compute_drift(result) is None


def test_regret_by_hand():
    measured = {"a": 0.50, "b": 0.55, "c": 0.40}
    assert regret("c", measured) == pytest.approx(0.0)
    assert regret("a", measured) == pytest.approx(0.25)
    assert regret("zz", measured) is None


def test_candidates_every_fitting_legal_plan_then_top_k():
    probs = make_problems(config(), num_nodes=2, gpus_per_node=2, gpu_memory_bytes=2**30)
    every = choose_plans(config(), probs)
    assert len(every) == 9 and len({c.key for c in every}) == 9  # all legal plans of 2 x 2 fit
    labels = {c.key: c.label for c in every}
    assert labels["p=1x1,g=1x1,os=1x1"].startswith("DDP") and labels["p=2x2,g=2x2,os=2x2"].startswith("ZeRO-3")
    top = choose_plans(config(top=1), probs)
    picks = {str(search(probs.uncalibrated[o]).best.plan) for o in ("comm", "step")}
    assert picks <= {c.key for c in top}  # both objectives' picks are measured
    assert {"p=1x1,g=1x1,os=1x1", "p=1x1,g=1x1,os=2x2", "p=2x2,g=2x2,os=2x2"} <= {c.key for c in top}
    assert len(top) < 9
    # a memory limit that only ZeRO-3-like plans meet leaves fewer candidates
    tight = make_problems(config(), num_nodes=2, gpus_per_node=2, gpu_memory_bytes=3 * 2**20)
    assert 0 < len(choose_plans(config(), tight)) < 9
    explicit = choose_plans(config(plans="ddp; p=2x1,g=2x1,os=2x2;ddp"), probs)
    assert [c.key for c in explicit] == ["p=1x1,g=1x1,os=1x1", "p=2x1,g=2x1,os=2x2"]


class _Future:
    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, fn):
        self.callbacks.append(fn)


class _Work:
    def __init__(self):
        self.future = _Future()

    def get_future(self):
        return self.future


class _Pending:
    def __init__(self, nbytes, work=None):
        self.nbytes, self.work = nbytes, work


def test_comm_trace_busy_and_exposed_by_hand(monkeypatch):
    # Two all-reduces over param_replica: [0, 4] and [2, 5] (busy = union = 5 s, sum = 7 s),
    # a wait for the second from 4.5 to 5 (exposed 0.5 s); a broadcast completed at issue.
    clock = iter([0.0, 2.0, 4.0, 4.5, 5.0, 5.0, 6.0]).__next__
    monkeypatch.setattr("amsp_ext.runtime.measure.comm_trace.time.perf_counter", clock)
    w1, w2 = _Work(), _Work()
    p1, p2 = _Pending(100, w1), _Pending(200, w2)
    from amsp_ext.runtime import collectives as C

    ctx = C.CollectiveContext(timeout=1.0)
    with CommTrace(ctx) as trace:
        ctx.notify("issued", "all_reduce", "param_replica[0,2]", p1)  # t=0
        ctx.notify("issued", "all_reduce", "param_replica[0,2]", p2)  # t=2
        w1.future.callbacks[0](None)  # completes at t=4
        ctx.notify("wait_begin", "all_reduce", "param_replica[0,2]", p2)  # 4.5
        w2.future.callbacks[0](None)  # 5.0
        ctx.notify("wait_end", "all_reduce", "param_replica[0,2]", p2)  # 5.0
        ctx.notify("issued", "broadcast", "optim_bcast[0,1]", _Pending(8))  # 6.0, no work
    assert ctx.observers == []  # the trace left the context as it found it
    s = trace.summary()
    assert s["AR"] == {"count": 2, "bytes": 300, "busy_s": 5.0, "sum_s": 7.0, "exposed_s": 0.5,
                       "incomplete": 0}
    assert s["BC"]["count"] == 1 and s["BC"]["busy_s"] == 0.0
    assert s["AG"]["count"] == 0
    assert kind_of("all_reduce", "world") == "other" and kind_of("all_reduce", "grad[0,1]") == "AR"
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)


def _fake_records(keys, step_of):
    """Two ranks, two rounds: per step the ranks' times (the slowest counts)."""
    records = []
    for rank in range(2):
        runs = []
        for rnd in (1, 2):
            for key in keys:
                steps = [{"step_s": step_of(key, rnd) + 0.01 * rank + 0.001 * i,
                          "phases": {ph: {"wall_s": 0.1, "blocked_s": 0.01}
                                     for ph in ("forward", "backward", "optimizer", "loss_sync")},
                          "comm": {k: {"busy_s": 0.05, "sum_s": 0.05, "exposed_s": 0.01,
                                       "count": 2, "bytes": 10, "incomplete": 0}
                                   for k in ("AG", "RS", "AR", "BC", "other")}}
                         for i in range(3)]
                runs.append({"plan": key, "round": rnd, "steps": steps, "setup_s": 0.1,
                             "model_state_bytes": {"total": 1000 + rank}, "peak_memory_bytes": 5000,
                             "load": [1.0, 1.0, 1.0],
                             "cpu": {"wall_s": 1.0, "host_busy_s": 2.5, "own_s": 1.0,
                                     "host": "h", "cores": 2}})
        records.append({"rank": rank, "runs": runs,
                        "probes": [{"round": 1, "forward_s": 0.01, "backward_s": 0.02,
                                    "optimizer_s": 0.001}]})
    return records


def test_aggregate_and_report_from_a_synthetic_run(tmp_path):
    cfg = config()
    probs = make_problems(cfg, num_nodes=2, gpus_per_node=2, gpu_memory_bytes=2**30,
                          peak_flops=3e10)
    cands = choose_plans(cfg, probs)
    keys = [c.key for c in cands]
    base = {k: 0.1 + 0.01 * i for i, k in enumerate(keys)}
    records = _fake_records(keys, lambda k, rnd: base[k] * (1.0 if rnd == 1 else 1.2))
    measured = aggregate(records, cands)
    m = measured[keys[3]]
    # per step the slower rank (+0.01), per round the median step (i = 1: +0.001)
    assert m["step_s_rounds"] == pytest.approx([base[keys[3]] + 0.011, base[keys[3]] * 1.2 + 0.011])
    assert m["step_s"]["median"] == pytest.approx(sum(m["step_s_rounds"]) / 2)
    assert m["model_state_bytes"] == 1001 and m["peak_memory_bytes"] == 5000
    # other CPU: host busy 2.5 s - own 2 x 1.0 s over 1 s of wall time
    assert m["foreign_cores"] == pytest.approx([0.5, 0.5])
    meta = {"command": "amsp tune", "date": "2026-12-01", "world": {"num_nodes": 2, "gpus_per_node": 2},
            "backend": "gloo", "device": "cpu", "gpu_memory_bytes": 2**30,
            "peak": {"peak_flops_per_gpu": 3e10, "peak_flops_source": "test", "peak_flops_measured": True},
            "load": {"start": [1, 1, 1], "end": [1, 1, 1]}, "cluster_link": None, "torch": "x"}
    result = build_result(cfg, probs, cands, records, meta)
    assert result["winner"] == keys[0]
    # the synthetic measurement ranks the plans in candidate order (base grows with i), in both
    # rounds: rho is the rank correlation of the planner's predictions with 0, 1, 2, ...
    median = {k: (base[k] + 0.011 + base[k] * 1.2 + 0.011) / 2 for k in keys}
    pred = {r["key"]: r["predicted"]["uncalibrated"] for r in result["plans"]}
    for obj, field in (("comm", "comm_total_s"), ("step", "step_s")):
        s = result["summary"]["uncalibrated"][obj]
        rho = spearman([pred[k][field] for k in keys], list(range(len(keys))))
        assert s["spearman"] == pytest.approx(rho)
        assert [r["spearman"] for r in s["per_round"]] == pytest.approx([rho, rho])
        # regret of the planner's pick against the measured best (keys[0]), by hand
        assert s["regret"] == pytest.approx((median[s["pick"]] - median[keys[0]]) / median[keys[0]])
    path = write_report(result, tmp_path)
    text = path.read_text()
    assert "uncalibrated" in text and keys[0] in text and "Spearman" in text
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 1000
    assert json.loads((tmp_path / "tune.json").read_text())["winner"] == keys[0]


def test_tune_flags_fail_in_one_line_before_any_rank():
    def amsp(*args):
        return subprocess.run([sys.executable, "-m", "amsp_ext.cli", "tune", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    for args, match in ((["--repeats", "0"], "--repeats must be an integer >= 1"),
                        (["--profile", "nope.json"], "profile nope.json: cannot read"),
                        (["--seq-len", "5000"], "--seq-len must be <= 512"),
                        ([], "amsp tune runs on every rank")):
        proc = amsp(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], proc.stderr


@pytest.mark.distributed
def test_tune_end_to_end_two_ranks(tmp_path):
    """``amsp tune`` for real on 2 gloo ranks (2 plans, 1 round): the files, a validated
    calibration that ``amsp plan`` then uses, MFU within (0, 1], and the measured model-state
    bytes against the planner's memory model (an independent count: planner/memory.py)."""
    from amsp_ext.planner.profile import BandwidthProfile
    from dist_utils import run_ranks

    out, cal = tmp_path / "out", tmp_path / "cal.json"
    plans = "p=1x1,g=1x1,os=1x1;p=2x1,g=2x1,os=2x1"
    proc = run_ranks(2, "amsp_ext.cli", "tune", "--model", "tiny-llama", "--seq-len", "32",
                     "--micro-batch-size", "1", "--profile", LAB_PROFILE, "--gpus-per-node", "2",
                     "--memory-reserve", "0B", "--steps", "1", "--warmup-steps", "1",
                     "--repeats", "1", "--probe-steps", "2", "--plans", plans,
                     "--out", str(out), "--calibrate-out", str(cal), timeout=240)
    d = json.loads((out / "tune.json").read_text())
    assert (out / "tune.md").is_file() and (out / "predicted_vs_measured.png").stat().st_size > 0
    assert [r["key"] for r in d["plans"]] == plans.split(";")
    for r in d["plans"]:
        m = r["measured"]
        assert m["step_s"]["median"] > 0
        assert 0 < m["mfu"] <= 1, (r["key"], m["mfu"])
        # the engine's sharded states vs the planner's count: equal up to small non-parameter extras
        pred = r["predicted"]["uncalibrated"]["model_state_bytes"]
        assert abs(m["model_state_bytes"] - pred) <= 0.001 * pred, (r["key"], m["model_state_bytes"], pred)
    assert d["winner"] in plans.split(";")
    assert f"amsp train --plan {d['winner']}" in proc.stdout and '"amsp": {"enabled": true' in proc.stdout
    prof = BandwidthProfile.from_dict(json.loads(cal.read_text()), source=str(cal))
    assert prof.calibration is not None
    doc = json.loads(cal.read_text())["calibration"]
    assert doc["source"].startswith("amsp tune, tiny-llama") and doc["date"] == d["meta"]["date"]
    planned = subprocess.run(
        [sys.executable, "-m", "amsp_ext.cli", "plan", "--profile", str(cal), "--model", "tiny-llama",
         "--seq-len", "32", "--micro-batch-size", "1", "--objective", "step", "--nodes", "1",
         "--gpus-per-node", "2", "--gpu-memory", "8GiB", "--micro-batches", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "uncalibrated" not in planned.stdout and "calibrated" in planned.stdout, planned.stdout[-2000:]


def test_plans_are_checked_before_any_rank_starts(capsys, monkeypatch):
    """A misspelt --plans entry fails where the config is built, in one line naming the flag and
    what it takes, not on the ranks; one that the world cannot lay out names the sizes it can."""
    from amsp_ext.cli.main import main
    from amsp_ext.cli.tune import _check_plans_fit_the_world

    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)  # outside a launcher: the check comes first anyway
    assert main(["tune", "--plans", "foo;bar"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("amsp tune: error: --plans: 'foo' is not a plan to measure; give factors "
                   "'p=S0xS1,g=S0xS1,os=S0xS1' or a baseline name (ddp, zero1, zero2, zero3, mics:K)")
    config = schema.from_namespace(TuneConfig, _tune_args(plans="zero3;mics:3"))
    with pytest.raises(ValueError, match=r"^--plans mics:3: group size 3 .*; allowed: 1, 2, 4$"):
        _check_plans_fit_the_world(config, world=4, local_world=2)


def _tune_args(**given):
    import argparse

    p = argparse.ArgumentParser()
    schema.add_arguments(p, TuneConfig)
    ns = p.parse_args([])
    for k, v in given.items():
        setattr(ns, k, v)
    return ns
