"""`amsp train`, the main job, end to end: it launches its own ranks, trains on real text and
reports what the README promises. The first loss is checked against a single-process run of the
same model on the same global batch (an independent reference)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import REPO

from amsp_ext.common.data import global_batch
from amsp_ext.common.models import build_llama, causal_lm_loss


def amsp(*args, timeout=300, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "amsp_ext.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def reference_first_loss(*, num_sequences, seq_len):
    model = build_llama("tiny-llama", seed=0)
    with torch.no_grad():
        return causal_lm_loss(model, global_batch(0, num_sequences=num_sequences, seq_len=seq_len)).item()


@pytest.mark.distributed
def test_train_json_default_plan_matches_reference():
    proc = amsp("train", "--steps", "3", "--seq-len", "64", "--micro-batches", "2", "--micro-batch-size", "2",
                "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plan_str"] == "p=1x1,g=1x1,os=2x1" and out["world"] == {"num_nodes": 2, "gpus_per_node": 2}
    # 4 ranks x M=2 x 2 sequences: the step-0 global batch is 16 sequences
    ref = reference_first_loss(num_sequences=16, seq_len=64)
    assert out["loss"][0] == pytest.approx(ref, rel=1e-5)
    assert out["loss"][-1] < out["loss"][0]
    assert out["tokens_per_gpu_per_s"] > 0 and 0 < out["mfu"] < 1 and out["peak_flops_per_gpu"] > 0
    assert len(out["peak_memory_bytes"]) == 4
    predicted = out["model_state_bytes"]["predicted"]["total"]
    for measured in out["model_state_bytes"]["measured"]:
        assert abs(measured["total"] - predicted) <= 0.1 * predicted


@pytest.mark.distributed
def test_train_auto_plan_shards_when_memory_binds():
    # 1.5 MiB per rank cannot hold tiny-llama's replicated fp32 states (2 MB), so the planner
    # must shard; whatever it picks must be legal and train.
    proc = amsp("train", "--steps", "2", "--seq-len", "32", "--micro-batch-size", "1",
                "--plan", "auto", "--profile", "configs/clusters/lab-2x2.profile.json",
                "--gpu-memory", "1536KiB", "--memory-reserve", "0B", "--json",
                # the units and bucket these budgets were worked out for (not the engine's defaults)
                "--granularity", "module", "--grad-bucket-bytes", "1MiB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    p = out["plan"]
    assert p["s0_os"] * p["s1_os"] > 1
    assert out["model_state_bytes"]["predicted"]["total"] <= 1536 * 1024


def test_train_refuses_a_plan_that_does_not_fit_before_launching():
    proc = amsp("train", "--plan", "p=4x1,g=4x1,os=4x1", "--nproc-per-node", "4", "--gpus-per-node", "2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "plan" in lines[0] and "s0_os=4 > R=2" in lines[0]
    proc = amsp("train", "--steps", "0")
    assert proc.returncode == 2 and "--steps must be an integer >= 1, got 0" in proc.stderr
    proc = amsp("train", "--precision", "bf16", "--reduce-dtype", "fp16")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--reduce-dtype (with --precision bf16) must be one of fp32, bf16, got 'fp16'" in lines[0], lines
