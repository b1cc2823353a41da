"""`amsp compare`: the measurement formulas (against hand-computed values) and the harness end to
end on the smallest setting (2 ranks, 2 steps), checked against a single-process reference."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from amsp_ext.compare import trace
from amsp_ext.compare.config import RunSpec, SpecError
from amsp_ext.compare.report import format_table, ratios


def _ev(name, thread, start, end):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_exposed_comm_by_hand():
    events = [
        _ev("aten::mm", 1, 0, 100),            # compute 0-100
        _ev("c10d::allreduce_", 1, 100, 105),   # async launch (comm, not compute)
        _ev("gloo:all_reduce", 2, 100, 160),    # in flight 100-160
        _ev("aten::mm", 1, 105, 130),          # overlaps 105-130
        _ev("c10d::allgather_", 1, 200, 240),  # blocking call 200-240 ...
        _ev("aten::empty", 1, 210, 211),       # ... whose inner aten op is not compute
        _ev("gloo:allgather", 3, 201, 239),
    ]
    got = trace.comm_breakdown(events)
    # comm = 100-160 and 200-240 -> 100 us; exposed = 100-105, 130-160, 200-240 -> 75 us
    assert got["comm_s"] == pytest.approx(100e-6)
    assert got["exposed_comm_s"] == pytest.approx(75e-6)
    assert got["compute_s"] == pytest.approx(125e-6)


def test_spec_errors_are_one_line_and_name_the_field():
    for kwargs, field in [(dict(model="gpt9"), "model"), (dict(precision="fp8"), "precision"),
                          (dict(num_steps=2, num_warmup_steps=2), "num_warmup_steps"),
                          (dict(amsp_overlap="some"), "amsp_overlap"), (dict(seq_len=4096), "seq_len"),
                          (dict(amsp_granularity="linear"), "amsp_granularity")]:
        with pytest.raises(SpecError) as e:
            RunSpec(**kwargs)
        assert field in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError, match="unknown RunSpec field"):
        RunSpec.from_json(json.dumps({"modle": "tiny-llama"}))


def test_table_shows_reason_and_ratios():
    rows = [
        {"key": "amsp-plan", "system": "amsp-plan", "label": "AMSP (plan)", "status": "ok",
         "tokens_per_gpu_per_s": 300.0, "mfu": 0.3, "median_step_s": 1.0, "peak_rss_delta_bytes": [2**20],
         "live_tensor_delta_bytes": [2**20], "comm_s": None, "exposed_comm_s": None, "loss": [5.0, 4.0]},
        {"key": "zero3", "system": "zero3", "label": "ZeRO-3", "status": "ok",
         "tokens_per_gpu_per_s": 100.0, "mfu": 0.1, "median_step_s": 3.0, "peak_rss_delta_bytes": [None],
         "live_tensor_delta_bytes": [0], "comm_s": 0.5, "exposed_comm_s": 0.25, "loss": [5.0, 4.1]},
        {"key": "zeropp-q", "system": "zeropp-q", "label": "ZeRO++ q", "status": "skipped",
         "reason": "CUDA only: not implemented | on CPU"},
    ]
    table = format_table(rows)
    assert "skipped: CUDA only: not implemented \\| on CPU" in table
    assert "| ZeRO-3 | 100 | 10.00% | 3.000 | — | 0.0 | 500.0 | 250.0 | 5.0000 → 4.1000 | ok |" in table
    assert ratios(rows) == ["- AMSP (plan) / ZeRO-3: 3.00x (wire bytes not measured (no trace): not checked); "
                            "not a claim (? timed steps, 1 round; a claim needs >= 10 timed steps and >= 5 rounds)"]


def test_cpu_table_puts_the_cores_floor_under_each_step():
    """report.cpu_table: every rank runs on the host, so its cores bound the step from below by
    ranks x CPU per rank / cores (the 2 x 2 lab at 1 Gbit, the MiCS config's row of
    comparisons/results/limit_lab-1gbit_polled_2026-12-07.md: 4 x 0.852 / 2 = 1.704 s, 0.96 of
    its 1.773 s step)."""
    from amsp_ext.compare.report import cpu_table

    row = {"label": "AMSP (MiCS config)", "status": "ok", "median_step_s": 1.773, "world_size": 4,
           "cpu_s_per_step": {"main": 0.767, "other": 0.085}}
    assert cpu_table([row], 2)[2] == "| AMSP (MiCS config) | 1.773 | 0.767 | 0.085 | 0.852 | 1.704 | 0.96 |"
    assert cpu_table([row])[2].endswith("| 0.852 | — | — |")  # the host's cores not recorded


def test_failed_run_becomes_a_one_line_reason(tmp_path):
    from amsp_ext.compare.launch import _failure
    from amsp_ext.compare.systems.deepspeed_zero import _cpu_only

    assert _cpu_only(RuntimeError("This op had not been implemented on CPU backend.\nmore")) == \
        "CUDA only: This op had not been implemented on CPU backend."
    assert _cpu_only(RuntimeError("something else")) is None
    # The earliest rank error names the cause; later ones (timeouts in peers) are echoes.
    (tmp_path / "error-rank1.json").write_text(json.dumps(
        {"rank": 1, "status": "failed", "reason": "timeout in allgather", "time": 20.0}))
    (tmp_path / "error-rank0.json").write_text(json.dumps(
        {"rank": 0, "status": "skipped", "reason": "CUDA only: x", "time": 10.0}))
    assert _failure(tmp_path, 1, "", 60) == {"status": "skipped", "reason": "CUDA only: x", "failed_rank": 0}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _failure(empty, None, "", 60)["reason"].startswith("timed out after 60 s")
    assert _failure(empty, 3, "a\nlast words\n", 60)["reason"] == "exited 3 before any rank reported: last words"


# -- end to end ---------------------------------------------------------------------------------
def _reference_losses(spec: RunSpec, world: int, steps: int) -> list[float]:
    """Single process, plain PyTorch: the same global batch, the same AdamW, fp32."""
    import torch

    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.models import build_llama, causal_lm_loss

    model = build_llama(spec.model, seed=spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=spec.weight_decay)
    n = spec.num_micro_batches * world
    out = []
    for step in range(steps):
        losses = []
        for m in range(spec.num_micro_batches):
            for r in range(world):
                b = micro_batch(step, m, r, world_size=world, num_micro_batches=spec.num_micro_batches,
                                micro_batch_size=spec.micro_batch_size, seq_len=spec.seq_len)
                loss = causal_lm_loss(model, b)
                (loss / n).backward()
                losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad()
        out.append(sum(losses) / len(losses))
    return out


@pytest.mark.distributed
@pytest.mark.slow  # conftest.py [Note: test tiers]; test_compare_repeats.py launches the harness's DDP and
# AMSP rows in the default tier; DeepSpeed's own engine runs in the slow tier only (here and in
# test_integrations_scripts.py's "enabled": false routes)
def test_harness_end_to_end_two_ranks(tmp_path):
    """A DeepSpeed row end to end, traced, with the report's files. DDP and AMSP end to end
    (two rounds, the same checks against the reference) are test_compare_repeats.py's: one
    launch per system and round is the costliest part of the suite."""
    from amsp_ext.compare.harness import run_comparison
    from amsp_ext.compare.launch import LaunchConfig

    spec = RunSpec(model="tiny-llama", seq_len=32, micro_batch_size=1, num_micro_batches=2,
                   num_steps=2, num_warmup_steps=1, precision="fp32", amsp_plan="zero1",
                   limit_rounds=0, dist_timeout_s=120)
    launch = LaunchConfig(nproc_per_node=2, timeout_s=240)
    path, rows = run_comparison(mode="baselines", spec=spec, launch=launch, out_dir=tmp_path,
                                command="pytest", systems=["zero1"], progress=lambda s: None)
    by = {r["key"]: r for r in rows}
    row = by["zero1"]
    assert row["status"] == "ok", (row["status"], row.get("reason"))
    assert len(row["loss"]) == 2 and row["tokens_per_gpu_per_s"] > 0
    assert row["mfu"] > 0 and max(row["live_tensor_delta_bytes"]) > 0
    ref = _reference_losses(spec, world=2, steps=1)
    # Step 0 is a forward pass of the same initial weights on the same tokens.
    assert row["loss"][0] == pytest.approx(ref[0], rel=1e-5)
    text = path.read_text()
    assert "| DeepSpeed ZeRO-1 |" in text and "Megatron" in text
    folder = path.with_suffix("")
    for f in ("results.json", "throughput.png", "memory.png", "loss.png"):
        assert (folder / f).exists(), f


def test_auto_plan_comes_from_the_planner_or_says_why():
    from amsp_ext.compare.harness import PlannerInputs, _resolve_planned
    from amsp_ext.planner.plan import parse_plan, validate_plan

    spec = RunSpec(amsp_plan="auto")
    resolved, why, source = _resolve_planned(spec, "auto", num_nodes=2, gpus_per_node=2,
                                             planner=PlannerInputs(profile="paper-a800",
                                                                   gpu_memory_bytes=4 * 2**20,
                                                                   memory_reserve_bytes=0))
    assert why is None and source.startswith("planner (profile paper-a800")
    validate_plan(parse_plan(resolved.amsp_plan), gpus_per_node=2, num_nodes=2)
    _, why, _ = _resolve_planned(spec, "auto", num_nodes=2, gpus_per_node=2,
                                 planner=PlannerInputs(profile="paper-a800", gpu_memory_bytes=2**10,
                                                       memory_reserve_bytes=0))
    assert why.startswith("planner: no plan fits")
    given, why, source = _resolve_planned(spec.replace(amsp_plan="zero1"), "zero1", num_nodes=2,
                                          gpus_per_node=2, planner=PlannerInputs())
    assert why is None and given.amsp_plan == "zero1" and source == "given: zero1"


def test_committed_results_record_configs_the_engine_accepts():
    """Every ShardConfig a committed report records builds today: each recorded field still
    exists and each value is accepted (e.g. no ownership the engine has dropped). The repr is
    Python, evaluated with only the config classes in scope; fields added since take defaults."""
    import re
    from pathlib import Path

    from amsp_ext.runtime.config import AutoPlanConfig, FP16Config, OverlapConfig, ShardConfig

    names = {"ShardConfig": ShardConfig, "EngineConfig": ShardConfig, "OverlapConfig": OverlapConfig, "FP16Config": FP16Config,
             "AutoPlanConfig": AutoPlanConfig, "None": None, "True": True, "False": False}
    results = Path(__file__).resolve().parents[1] / "comparisons" / "results"
    found = 0
    for path in sorted(results.rglob("*")):
        if path.suffix not in (".json", ".md"):
            continue
        for text in re.findall(r'"shard_config": "((?:Shard|Engine)Config\(.*?\))"', path.read_text()):
            try:
                eval(text, {"__builtins__": {}}, names)  # noqa: S307 (our own reports)
            except (TypeError, ValueError) as e:
                raise AssertionError(f"{path.relative_to(results)}: {e}") from None
            found += 1
    assert found >= 100


def test_compare_flags_are_runspecs_and_keep_their_names_and_presets(monkeypatch):
    """`amsp compare`'s RunSpec flags are generated (schema.py); the user-visible names, the
    --quick / full presets (the values its help and docs/usage.md state) and the defaults stay."""
    import argparse

    from amsp_ext.cli import compare as cli
    from amsp_ext.runtime.measure import cpu_bf16

    monkeypatch.setenv(cpu_bf16.FORCE_ENV, "fast")  # bf16 stays the default on any CPU
    cpu_bf16.probe_cpu_bf16.cache_clear()
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    quick = cli.run_spec(p.parse_args(["--quick"]))
    assert (quick.model, quick.seq_len, quick.micro_batch_size, quick.num_micro_batches,
            quick.num_steps, quick.num_warmup_steps, quick.gpus_per_node) == ("tiny-llama", 128, 2, 2, 8, 3, 2)
    assert (quick.precision, quick.seed, quick.amsp_plan, quick.amsp_granularity, quick.trace,
            quick.dist_timeout_s) == ("bf16", 0, "auto", "layer", True, 300.0)
    full = cli.run_spec(p.parse_args(["--launcher", "cluster"]))
    assert (full.model, full.seq_len, full.num_micro_batches, full.num_steps, full.gpus_per_node) == (
        "small-llama", 256, 4, 20, None)  # the lab says its own gpus per node
    given = cli.run_spec(p.parse_args(
        ["--quick", "--model", "small-llama", "--seq-len", "64", "--micro-batch-size", "1",
         "--micro-batches", "3", "--steps", "6", "--warmup-steps", "2", "--seed", "5",
         "--precision", "fp32", "--gpus-per-node", "1", "--mics-shard-size", "2",
         "--hpz-partition-size", "2", "--amsp-plan", "zero3", "--amsp-granularity", "module",
         "--no-trace", "--timeout", "120"]))
    assert given == RunSpec(model="small-llama", seq_len=64, micro_batch_size=1, num_micro_batches=3,
                            num_steps=6, num_warmup_steps=2, seed=5, precision="fp32", gpus_per_node=1,
                            mics_shard_size=2, hpz_partition_size=2, amsp_plan="zero3",
                            amsp_granularity="module", trace=False, dist_timeout_s=120.0)
    with pytest.raises(SpecError, match="^--warmup-steps must be in 0..num_steps-1") as e:
        cli.run_spec(p.parse_args(["--quick", "--steps", "2", "--warmup-steps", "2"]))
    assert "\n" not in str(e.value)
    cpu_bf16.probe_cpu_bf16.cache_clear()
