"""`amsp simulate --tensor-parallel` (planner/simulate_tp.py): the rows' global batches and TP
time by hand on a tiny model, a row over the cap or with a degree the node cannot take keeps its
line and says why, and bad flags are one line (fast, torch-free)."""

from __future__ import annotations

import json

import pytest

from amsp_ext.cli.main import main
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.simulate import SimSettings
from amsp_ext.planner.specs import StepShape
from amsp_ext.planner.simulate_tp import simulate_tp
from tests.planner_helpers import constant_profile

# 8 heads and 8 KV heads of dim 2 (h = 16), MLP 32: every degree 1, 2, 4, 8 divides it.
TOY8 = ModelSpec(name="toy8", hidden_size=16, intermediate_size=32, num_layers=2, num_heads=8,
                 num_kv_heads=8, head_dim=2, vocab_size=16)
W = 10.0  # GB/s, every op and mesh
SEQ = 64


def _rows(**kw):
    prof = constant_profile(8, 2, dict.fromkeys(("allreduce", "allgather", "reducescatter", "broadcast"), W))
    settings = SimSettings(models=(TOY8,), gpu_counts=(16,), shape=StepShape(seq_len=SEQ), **kw)
    return {r.system: r for r in simulate_tp(settings, profile=prof)}


def test_rows_global_batch_by_hand_and_over_the_cap_says_so():
    # M = 1 per data-parallel rank: (8 / T) x 2 nodes x 1 x 1 x 64 tokens; the cap is 256.
    rows = _rows(tensor_parallel=None, micro_batches=1, max_global_batch_tokens=256)
    assert list(rows) == ["joint", "tp1", "tp2", "tp4", "tp8", "tp8-zero3"]
    for t, tokens in ((1, 1024), (2, 512)):
        r = rows[f"tp{t}"]
        assert r.global_batch_tokens == tokens and r.mfu is None and r.plan is None
        assert r.reason == f"global batch of {tokens} tokens exceeds --max-global-batch-tokens 256"
    for t, tokens in ((4, 256), (8, 128)):
        r = rows[f"tp{t}"]
        assert not r.reason and r.global_batch_tokens == tokens and r.num_micro_batches == 1
        assert r.data_parallel_world == f"2 x {8 // t}" and 0 < r.mfu < 1
    joint = rows["joint"]
    assert joint.tensor_parallel in (4, 8) and joint.label.endswith(f"T = {joint.tensor_parallel}")
    same = rows[f"tp{joint.tensor_parallel}"]
    assert (joint.plan, joint.step_s, joint.global_batch_tokens) == (same.plan, same.step_s,
                                                                     same.global_batch_tokens)


def test_torchtitan_row_is_zero3_over_the_data_parallel_world_with_tp_time_by_hand():
    z = _rows(tensor_parallel=None, micro_batches=1)["tp8-zero3"]
    assert z.plan == "p=1x2,g=1x2,os=1x2" and z.data_parallel_world == "2 x 1" and not z.recompute
    # one activation all-reduce: s x h x 2 B; a layer: 2 forward + 2 backward (no recompute)
    assert z.tp_allreduce_bytes == SEQ * 16 * 2 and z.tp_layer_bytes == 4 * SEQ * 16 * 2
    # per micro-batch: 4 per layer, none outside (embedding, lm_head and loss whole per TP rank)
    per_mb = 4 * 2 * SEQ * 16 * 2 / (W * 1e9)
    assert z.tp_comm_s == pytest.approx(per_mb, rel=1e-12)
    assert z.tp_share == pytest.approx(per_mb / z.step_s, rel=1e-12)


def test_a_fixed_batch_grows_m_with_t_and_too_few_sequences_say_so():
    # 1,024 tokens = 16 sequences: M = 16 / (16 / T) = T; the data-parallel ranks at T = 1 get one each
    rows = _rows(tensor_parallel=2, global_batch_tokens=1024)
    assert rows["joint"].tensor_parallel == 2 and rows["joint"].plan == rows["tp2"].plan
    for t in (1, 2, 4, 8):
        assert rows[f"tp{t}"].num_micro_batches == t and rows[f"tp{t}"].global_batch_tokens == 1024
    few = _rows(global_batch_tokens=512, max_global_batch_tokens=4096)["tp1"]  # 8 sequences, 16 ranks
    assert "multiple of micro_batch_size x world size = 1 x 16" in few.reason


def test_cli_tp_rows_written_and_bad_flags_one_line(tmp_path, capsys):
    argv = ["simulate", "--models", "llama-7b", "--gpus", "64", "--micro-batches", "1",
            "--tensor-parallel", "auto", "--max-global-batch-tokens", "131072", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TP 1: today's AMSP (planner)       out: global batch of 262144 tokens exceeds " \
           "--max-global-batch-tokens 131072" in out
    doc = json.loads((tmp_path / "simulate_tp_paper-a800.json").read_text())
    rows = {r["system"]: r for r in doc["rows"]}
    assert rows["tp2"]["global_batch_tokens"] == 64 // 2 * 4096 and rows["tp2"]["mfu"] > 0
    md = (tmp_path / "simulate_tp_paper-a800.md").read_text()
    assert "not measurements" in md and f"--out {tmp_path}" in md
    for bad, words in ((["--tensor-parallel", "3"], "argument --tensor-parallel: invalid choice: '3'"),
                       (["--models", "llama-30b", "--gpus", "8", "--tensor-parallel", "8"],
                        "tensor_parallel=8 must divide the model llama-30b's num_attention_heads=52"),
                       (["--max-global-batch-tokens", "0"], "--max-global-batch-tokens")):
        try:
            rc = main(["simulate", "--no-write", *bad])
        except SystemExit as e:  # argparse's own choices check exits
            rc = e.code
        assert rc == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and words in err, err
