"""`amsp compare --ddp-buckets`: DDP's bucket sweep as systems, the flag and its one-line error,
the best DDP row picked by median step over the rounds (hand-made rows, hand-computed ratios),
and the DDP module built with each bucket_cap_mb (a 1-rank gloo group, seconds)."""

from __future__ import annotations

import argparse

import pytest

from amsp_ext.compare.peers import at_best, parse_ddp_buckets, sweeps, with_ddp_sweep
from amsp_ext.compare.report import ratio_records, ratios, sweep_lines
from amsp_ext.compare.systems import DEFAULT_SYSTEMS, SYSTEMS

TOKENS = 100.0  # tokens per rank per step of every hand-made row
SPEC = {"num_steps": 13, "num_warmup_steps": 3}  # 10 timed steps: enough for a claim


def _row(key, steps, *, status="ok", label=None):
    """A combined row as rounds.combine_rounds leaves it, from its per-round median steps; the
    row's median step is written by hand in each test's table, not computed here."""
    row = {"key": key, "system": key, "label": label or key, "status": status, "spec": SPEC,
           "num_rounds": len(steps)}
    if status == "ok":
        row["tokens_per_gpu_per_s_rounds"] = [TOKENS / s for s in steps]
    return row


def test_bucket_flag_parses_and_refuses_in_one_line():
    assert parse_ddp_buckets("1,5,25") == (1, 5, 25)
    assert parse_ddp_buckets(" 25 , 1,25") == (25, 1)  # order kept, repeats dropped
    for bad in ("3", "", "1,x", "-1", "5.0", "1,,100"):
        with pytest.raises(ValueError) as e:
            parse_ddp_buckets(bad)
        assert str(e.value) == (f"--ddp-buckets must be comma-separated bucket_cap_mb sizes from 1, 5, 25, "
                                f"got {bad!r}")


def test_sweep_rows_take_ddps_place_and_stay_out_of_the_default_table():
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.harness import plan_runs

    assert with_ddp_sweep(["ddp", "amsp-plan"], (1, 5, 25)) == ["ddp-b1", "ddp-b5", "ddp-b25", "amsp-plan"]
    # without 25 the plain ddp row (torch's default, 25) stays beside the swept sizes
    assert with_ddp_sweep(["zero1", "ddp"], (1, 5)) == ["zero1", "ddp-b1", "ddp-b5", "ddp"]
    assert with_ddp_sweep(["amsp-plan", "ddp-b5"], (5, 1)) == ["ddp-b5", "ddp-b1", "amsp-plan"]
    spec = RunSpec()
    assert [i.key for i in plan_runs("baselines", spec)] == list(DEFAULT_SYSTEMS)
    assert not any(k.startswith("ddp-b") and k != "ddp-bf16" for k in DEFAULT_SYSTEMS)
    items = plan_runs("baselines", spec, ["ddp-b1", "ddp-b25", "amsp-plan"])
    assert [(i.system, i.label) for i in items[:2]] == [("ddp-b1", "DDP, bucket_cap_mb 1"),
                                                        ("ddp-b25", "DDP, bucket_cap_mb 25")]
    assert [SYSTEMS[f"ddp-b{mb}"].bucket_cap_mb for mb in (1, 5, 25)] == [1, 5, 25]


def test_the_cli_builds_the_sweep_from_the_modes_rows():
    from amsp_ext.cli import compare as cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--systems", "ddp,hsdp,amsp-plan", "--ddp-buckets", "1,5,25"])
    assert cli._systems(args) == ["ddp-b1", "ddp-b5", "ddp-b25", "hsdp", "amsp-plan"]
    dis = p.parse_args(["--mode", "dissociation", "--ddp-buckets", "5"])
    assert cli._systems(dis) == ["ddp-b5", "mics", "amsp-mics", "amsp-plan"]
    assert cli._systems(p.parse_args(["--systems", "ddp"])) == ["ddp"]


def test_the_ratio_is_against_ddps_best_bucket_by_median_step():
    """Per-round steps (s), by hand:
        ddp-b1   0.30 0.60 0.60 0.60 0.30   median 0.60 (its best round, 0.30, is the fastest of all)
        ddp-b5   0.40 0.40 0.40 0.40 0.40   median 0.40  <- best
        ddp-b25  0.50 0.50 0.50 0.50 0.50   median 0.50
    AMSP's tokens/GPU/s 300 300 200 300 300 over ddp-b5's 250: 1.2 1.2 0.8 1.2 1.2, median 1.2,
    4 of 5 above 1.0 (met). Against ddp-b25 (200) it would read 1.5, against ddp-b1 2.0."""
    rows = [_row("ddp-b1", [0.3, 0.6, 0.6, 0.6, 0.3]) | {"median_step_s": 0.6},
            _row("ddp-b5", [0.4] * 5, label="DDP, bucket_cap_mb 5") | {"median_step_s": 0.4},
            _row("ddp-b25", [0.5] * 5) | {"median_step_s": 0.5},
            _row("hsdp", [0.5] * 5, label="HSDP") | {"median_step_s": 0.5},
            _row("amsp-plan", [1 / 3, 1 / 3, 0.5, 1 / 3, 1 / 3], label="AMSP") | {"median_step_s": 1 / 3}]
    assert sweeps(rows)["ddp"]["best"] == "ddp-b5"
    assert [r["key"] for r in at_best(rows)] == ["ddp-b5", "hsdp"]
    recs = ratio_records(rows)
    assert [(r["numerator"], r["denominator"]) for r in recs] == [("amsp-plan", "ddp-b5"), ("amsp-plan", "hsdp")]
    ddp = recs[0]
    assert ddp["per_round"] == pytest.approx([1.2, 1.2, 0.8, 1.2, 1.2])
    assert ddp["median"] == pytest.approx(1.2) and ddp["rounds_above_target"] == 4
    assert ddp["verdict"]["claim"] and ddp["verdict"]["met"]  # the claim rule, unchanged
    assert "DDP at its best: bucket_cap_mb 5 of 1, 5, 25 (lowest median step)" in ddp["note"]
    assert ratios(rows)[0].startswith("- AMSP / DDP, bucket_cap_mb 5: 1.20x (median of 5 per-round ratios")
    table = sweep_lines(rows)
    assert "**bucket_cap_mb 5** (DDP, bucket_cap_mb 5) had the lowest median step" in table[0]
    assert table[4:7] == ["| ddp-b1 | 1 | 0.600 |  |", "| DDP, bucket_cap_mb 5 | 5 | 0.400 | best |",
                          "| ddp-b25 | 25 | 0.500 |  |"]


def test_a_failed_setting_is_shown_but_never_the_best():
    rows = [_row("ddp", [0.5] * 5) | {"median_step_s": 0.5},
            _row("ddp-b1", [], status="failed") | {"reason": "boom"},
            _row("ddp-b5", [0.45] * 5) | {"median_step_s": 0.45},
            _row("amsp-plan", [0.5] * 5) | {"median_step_s": 0.5}]
    swept = sweeps(rows)["ddp"]
    assert swept["best"] == "ddp-b5"
    assert [(m["key"], m["bucket_cap_mb"], m["status"]) for m in swept["rows"]] == [
        ("ddp", 25, "ok"), ("ddp-b1", 1, "failed"), ("ddp-b5", 5, "ok")]
    assert "| ddp-b1 | 1 | — | failed |" in sweep_lines(rows)
    # one DDP row, no sweep: as before, no note
    assert ratio_records([rows[0], rows[3]])[0]["note"].startswith("wire bytes not measured")


def test_each_ddp_system_builds_its_module_with_its_bucket_cap():
    """bucket_cap_mb reaches DistributedDataParallel (its bucket_bytes_cap, read back into the
    row's settings). One rank, gloo, in this process; a Linear, not a Llama: seconds."""
    import torch
    import torch.distributed as dist

    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.systems import ddp
    from amsp_ext.compare.systems.base import Context

    ctx = Context(spec=RunSpec(precision="fp32"), rank=0, world_size=1, num_nodes=1, gpus_per_node=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, mb in (("ddp", 25), ("ddp-b1", 1), ("ddp-b5", 5), ("ddp-b25", 25)):
            run = ddp.setup(name, torch.nn.Linear(8, 8), ctx)
            assert run.settings["bucket_cap_mb"] == mb, name
    finally:
        dist.destroy_process_group()
