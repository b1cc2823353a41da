"""`amsp simulate`: hand-checkable properties of the paper-scale predictions (fast, torch-free)."""

from __future__ import annotations

import json
import re

import pytest

from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import parse_plan
from amsp_ext.planner.search import GiB, make_problem
from amsp_ext.planner.simulate import (
    DEEPSPEED_SYSTEMS, ENGINES, PAPER_GPU_COUNTS, PAPER_MFU, PAPER_MODELS, SYSTEMS, SimSettings,
    side_by_side, simulate, table_iv_plan,
)
from amsp_ext.planner.simulate_report import format_markdown
from amsp_ext.planner.specs import ClusterSpec, paper_job
from amsp_ext.planner.step import OverlapRules, step_estimate


@pytest.fixture(scope="module")
def cells():
    return simulate()  # the paper's grid: 3 models x 8 scales x 3 engines x 10 systems, ~4 s


def _by(cells):
    return {(c.model, c.gpus, c.system, c.engine): c for c in cells}


def test_every_system_scale_engine_cell_exists_once(cells):
    keys = [(c.model, c.gpus, c.system, c.engine) for c in cells]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(m, g, s, e) for m in PAPER_MODELS for g in PAPER_GPU_COUNTS
                         for s in SYSTEMS for e in ENGINES}


def test_micro_batches_follow_the_4m_token_batch(cells):
    # 4 * 2**20 tokens / 4096 per sequence = 1024 sequences; one per GPU per micro-batch.
    for c in cells:
        assert c.num_micro_batches == 1024 // c.gpus
    by = _by(cells)
    assert by[("llama-7b", 8, "zero1", "ideal")].num_micro_batches == 128
    assert by[("llama-7b", 1024, "zero1", "ideal")].num_micro_batches == 1


def test_oom_where_model_states_alone_exceed_the_gpu(cells):
    # 78 GiB usable (80 GiB less the 2 GiB reserve). DDP keeps 16 bytes per parameter
    # (2 param + 2 grad + 12 AdamW); ZeRO-1 keeps at least 4 (param + grad), so 30B (32.5e9 params,
    # 130 GB) never fits; neither does DDP for any of the three models (7B: 108 GB).
    for c in cells:
        if c.system == "ddp" or (c.system == "zero1" and c.model == "llama-30b"):
            assert not c.feasible and c.mfu is None and c.memory_gib > 78, c
    # ... and the OOM shows in the markdown with the memory needed
    md = format_markdown(cells, side_by_side(cells), SimSettings(), command="x", plot=None)
    assert "| DDP | OOM (126 GiB) |" in md


def _llama7b_flops_per_token(seq: int = 4096) -> float:
    # LLaMA-7B: h=4096, L=32, MLP 11008, vocab 32000. Matmul weights per layer: 4h^2 + 3hi.
    h, L, i, V = 4096, 32, 11008, 32000
    fwd = 2 * (L * (4 * h * h + 3 * h * i) + h * V) + 4 * seq * h * L  # attention not halved
    return 3 * fwd


def test_compute_time_by_hand_and_linear_in_micro_batches(cells):
    by = _by(cells)
    per_mb = _llama7b_flops_per_token() * 4096 / (312e12 * 0.65)  # 0.931 s
    for g in PAPER_GPU_COUNTS:
        c = by[("llama-7b", g, "amsp-table-iv", "ideal")]
        assert c.compute_s == pytest.approx(per_mb * 1024 / g, rel=1e-9)
        # MFU and tokens/GPU/s describe the same step: MFU = tgs * FLOPs/token / peak
        assert c.mfu == pytest.approx(c.tokens_per_gpu_per_s * _llama7b_flops_per_token() / 312e12)
    # recomputation (30B) adds one forward of the layers to the time: compute > 3 x forward / ...
    c30 = by[("llama-30b", 1024, "zero3", "ideal")]
    assert c30.mfu < 0.65 * 3 / 4 + 1e-3  # at most 3 of every 4 forward-equivalents are useful


def test_bounds_between_engines(cells):
    by = _by(cells)
    for (m, g, s, e), c in by.items():
        if e != "ideal" or not c.feasible:
            continue
        serial, ds = by[(m, g, s, "serial")], by[(m, g, s, "deepspeed")]
        assert c.step_s >= c.compute_s  # nothing runs faster than its compute
        assert c.mfu <= 0.65 + 1e-9
        assert serial.step_s >= c.step_s - 1e-9, (m, g, s)  # serial is the floor
        if s in ("zero3", "zero++", "mics"):
            assert ds.step_s >= c.step_s - 1e-9  # blocking reduce-scatters cannot help
        if not s in DEEPSPEED_SYSTEMS:
            assert ds.step_s == c.step_s  # AMSP and DDP never get DeepSpeed's assumptions


def test_deepspeed_zero1_redistributes_with_one_allgather(cells):
    by = _by(cells)
    ideal = by[("llama-7b", 1024, "zero1", "ideal")]
    ds = by[("llama-7b", 1024, "zero1", "deepspeed")]
    assert ideal.comm_terms["t1_os"] > 0 and ds.comm_terms["t1_os"] == 0
    t_ag = ds.comm_terms["t_allgather"]
    assert t_ag > 0
    assert ds.step_s >= ds.compute_s + t_ag  # blocking: not hidden behind anything
    # 2 * 6.74e9 bytes come into every node through 4 x HDR (100 GB/s): at least 0.13 s
    assert t_ag >= 2 * 6.74e9 * 127 / 128 / 100e9 * 0.99


def test_mics_config_on_amsp_engine_is_the_ideal_mics(cells):
    by = _by(cells)
    for m in PAPER_MODELS:
        for g in PAPER_GPU_COUNTS:
            a, b = by[(m, g, "amsp-mics", "ideal")], by[(m, g, "mics", "ideal")]
            assert a.plan == b.plan == "p=8x1,g=8x1,os=8x1"
            assert a.step_s == pytest.approx(b.step_s)


def test_table_iv_plan_is_uniform_and_capped_below_four_nodes():
    assert table_iv_plan("llama-7b", 8, 128) == (parse_plan("p=1x1,g=1x1,os=8x1"), "")
    assert table_iv_plan("llama-30b", 8, 4) == (parse_plan("p=8x1,g=8x1,os=8x4"), "")
    plan, note = table_iv_plan("llama-30b", 8, 2)
    assert plan == parse_plan("p=8x1,g=8x1,os=8x2") and "capped" in note


def test_side_by_side_carries_the_papers_numbers(cells):
    rows = side_by_side(cells)
    assert len(rows) == len(PAPER_MFU)
    at = {(r["system"], r["model"], r["gpus"]): r for r in rows}
    assert [at[("amsp-table-iv", m, 1024)]["paper_mfu_pct"] for m in PAPER_MODELS] == [51, 52, 42]
    assert [at[("mics", m, 1024)]["paper_mfu_pct"] for m in PAPER_MODELS] == [35, 33, 29]
    assert at[("zero1", "llama-7b", 1024)]["paper_mfu_pct"] == 36
    assert at[("zero++", "llama-30b", 32)]["paper_mfu_pct"] is None
    # implied step: the paper's MFU on the model's FLOPs. 51% of 312 TFLOP/s for 4096 tokens.
    r = at[("amsp-table-iv", "llama-7b", 1024)]
    assert r["implied_step_s"] == pytest.approx(_llama7b_flops_per_token() * 4096 / (0.51 * 312e12))
    assert all(r["verdict"] for r in rows)


def test_fig16_ratios_paper_and_model(cells):
    from amsp_ext.planner.simulate_report import dissociation

    lines = dissociation(cells)
    assert len(lines) == 2 + 3
    # paper: engine only 42/35, strategy only 51/42 (7B); model: the cells' own MFU ratios
    by = _by(cells)
    eng = by[("llama-7b", 1024, "amsp-mics", "ideal")].mfu / by[("llama-7b", 1024, "mics", "deepspeed")].mfu
    assert lines[2].startswith(f"| llama-7b | 1.20x | {eng:.2f}x | 1.21x |")


def test_rs_rule_blocks_only_the_reduce_scatter():
    spec = ModelSpec.preset("llama-7b")
    cluster = ClusterSpec(num_nodes=2, gpus_per_node=8, gpu_memory_bytes=80 * GiB)
    training = paper_job(seq_len=4096, num_micro_batches=2)
    problem = make_problem(spec, cluster, training, "paper-a800")
    plan = parse_plan("p=8x1,g=8x1,os=8x1")
    from amsp_ext.planner.search import evaluate
    comm = evaluate(problem, plan).comm
    est = {name: step_estimate(plan, spec, training, cluster, problem.timer, comm,
                               num_micro_batches=2, overlap=rules)
           for name, rules in (("ideal", OverlapRules()), ("rs", OverlapRules(rs=False)),
                               ("ag_rs", OverlapRules(ag_rs=False)))}
    rs_total = sum(problem.timer.time("reducescatter", 2 * n, 8, 1)
                   for _, n in [*(spec.layer_units("module") * spec.num_layers),
                                *spec.outside_params()])
    # blocking reduce-scatters sit on the compute chain of both micro-batches
    assert est["rs"].step_s >= est["ideal"].compute_s + 2 * rs_total
    assert est["ideal"].step_s < est["rs"].step_s <= est["ag_rs"].step_s
    # plans without parameter sharding have no reduce-scatter to block
    flat = parse_plan("p=1x1,g=1x1,os=8x1")
    c2 = evaluate(problem, flat).comm
    a, b = (step_estimate(flat, spec, training, cluster, problem.timer, c2, num_micro_batches=2,
                          overlap=r) for r in (OverlapRules(), OverlapRules(rs=False)))
    assert a.step_s == b.step_s


def test_cli_writes_report_json_and_plot(tmp_path, capsys):
    from amsp_ext.cli.main import main

    assert main(["simulate", "--models", "llama-7b", "--gpus", "8,1024",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"llama-7b\s+1024\s+ZeRO-1\s+36", out)
    md = (tmp_path / "simulate_paper-a800.md").read_text()
    assert f"`amsp simulate --models llama-7b --gpus 8,1024 --out {tmp_path}`" in md
    assert "| ZeRO-1 | 65.0 / 64.9 |" in md and "![MFU vs GPUs](simulate_paper-a800.png)" in md
    doc = json.loads((tmp_path / "simulate_paper-a800.json").read_text())
    assert len(doc["cells"]) == 2 * len(ENGINES) * len(SYSTEMS)
    assert (tmp_path / "simulate_paper-a800.png").stat().st_size > 10_000
    assert main(["simulate", "--gpus", "12"]) == 2  # not a multiple of 8 GPUs per node
    assert "gpu_counts" in capsys.readouterr().err
