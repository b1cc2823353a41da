"""The GPU scripts stay runnable between the rare sessions that are lent a GPU: their CPU dry
runs (``--device cpu --quick``) finish with every check answered and no check's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "comparisons" / script), "--device", "cpu", "--quick",
           "--out", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s: the same script's dry-run path reaches the default tier through test_gpu_scale_profile_dry_run_times_both_systems
def test_gpu_check_dry_run_answers_every_check(tmp_path):
    _run("gpu_check.py", out=tmp_path)
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    keys = ("nccl", "peak", "engine", "scale", "compute", "calibration", "engine_large", "big_start")
    assert [k for k in keys if k not in r or "error" in r[k]] == [], {k: r.get(k) for k in keys}
    assert all(r["nccl"][k] is True for k in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"))
    for k in ("engine", "engine_large"):  # the engine against plain PyTorch (bf16 autocast)
        assert r[k]["max_loss_rel_diff"] < 1e-3, r[k]
    big = r["big_start"]  # built on meta, started by shard(), one step: below the step's peak
    assert big["world"] == 64 and 0 < big["startup_peak_bytes"] <= big["memtracker_peak_bytes"], big
    for plan, v in r["scale"].items():  # one rank of 32 with real tensors: the ordinary path
        assert "error" not in v and v["real"]["steps_skipped"] == 0 and v["real"]["fake_fills_outputs"], plan


@pytest.mark.distributed
def test_gpu_scale_profile_dry_run_times_both_systems(tmp_path):
    _run("gpu_scale_profile.py", "--no-profile", "--cases", "amsp:zero3;fsdp2:zero3", out=tmp_path)
    r = json.loads((tmp_path / "gpu_scale_profile.json").read_text())
    assert set(r) == {"amsp:zero3", "fsdp2:zero3"}
    for case, v in r.items():
        assert "error" not in v and v["step_s"] > 0 and v["world"] == 32, (case, v)
    assert r["amsp:zero3"]["fake_backend_cpu_s"] > 0  # the observer saw the engine's collectives
