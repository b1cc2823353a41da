"""`amsp train` as a resumable job, end to end through the launcher (tiny-llama, fp32, global
batch 16 sequences):

- A: 4 ranks, 8 steps, async saves every 2 steps, --keep 2: the reference run;
- B: 2 ranks (M = 4 instead of 2, the same global batch) resumed from A's step-6 checkpoint:
  continues at sample 96 and matches A's steps 6-7 (1e-6 relative, the fp32 parity bound);
- C: A again with --max-restarts 1, rank 1 SIGKILLed at the start of step 5: torchrun replaces
  the ranks, they resume from step-4 by themselves, and every step's loss equals A's (1e-6)
  with every sample seen exactly once;
- D: NaN on rank 1 at steps 1-3 (2 ranks): the guard skips them and the third stops the job,
  exit 1, one error line.
Faults come from AMSP_FAULTS (amsp_ext/common/faults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO

# Slow tier (conftest.py [Note: test tiers]): test_checkpoint.py covers saving and resharding
# loads on forked ranks, test_nonfinite.py the NaN guard; what only this file runs is the
# resume and the elastic restart through `amsp train`.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["--steps", "8", "--seq-len", "32", "--micro-batch-size", "2", "--json"]
TOL = 1e-6


def amsp_train(*args, faults="", timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AMSP_FAULTS": faults,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "amsp_ext.cli", "train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    a = _result(amsp_train(*COMMON, "--nproc-per-node", "4", "--micro-batches", "2",
                           "--save-dir", str(root / "A"), "--save-every", "2", "--keep", "2", "--async-save"))
    b = _result(amsp_train(*COMMON, "--nproc-per-node", "2", "--micro-batches", "4",
                           "--resume", str(root / "A" / "step-00000006")))
    c = _result(amsp_train(*COMMON, "--nproc-per-node", "4", "--micro-batches", "2",
                           "--save-dir", str(root / "C"), "--save-every", "2", "--max-restarts", "1",
                           faults="kill:rank=1:step=5"))
    d = amsp_train("--steps", "6", "--seq-len", "32", "--nproc-per-node", "2",
                   faults="nan:rank=1:step=1-3")
    return {"root": root, "A": a, "B": b, "C": c, "D": d}


def _rel(x, y):
    return abs(x - y) / abs(y)


def _covers_each_sample_once(history, total):
    seen = sorted((h["first_sample"], h["first_sample"] + h["num_samples"]) for h in history)
    assert seen[0][0] == 0 and seen[-1][1] == total, seen
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:])), seen  # no gap, no overlap


def test_reference_run_saves_and_keeps_the_newest(runs):
    a = runs["A"]
    assert [h["first_sample"] for h in a["history"]] == [16 * k for k in range(8)]
    assert all(h["applied"] for h in a["history"]) and a["resumed_from"] is None
    assert sorted(os.listdir(runs["root"] / "A")) == ["step-00000006", "step-00000008"]  # --keep 2


def test_resume_on_2_ranks_continues_at_the_next_sample(runs):
    a, b = runs["A"], runs["B"]
    assert b["world"]["num_nodes"] * b["world"]["gpus_per_node"] == 2 and b["micro_batches"] == 4
    assert b["resumed_from"].endswith("step-00000006")
    assert b["history"][:6] == a["history"][:6]  # carried in the checkpoint
    new = b["history"][6:]
    assert [h["first_sample"] for h in new] == [96, 112]
    for got, ref in zip(new, a["history"][6:], strict=True):
        assert _rel(got["loss"], ref["loss"]) <= TOL, (got, ref)
    _covers_each_sample_once(b["history"], 128)


def test_killed_rank_is_replaced_and_the_job_resumes_by_itself(runs):
    a, c = runs["A"], runs["C"]
    assert c["restart"] == 1 and c["resumed_from"].endswith("step-00000004"), c["resumed_from"]
    assert len(c["history"]) == 8
    for got, ref in zip(c["history"], a["history"], strict=True):
        assert got["first_sample"] == ref["first_sample"]
        assert _rel(got["loss"], ref["loss"]) <= TOL, (got, ref)
    _covers_each_sample_once(c["history"], 128)


def test_three_nan_steps_stop_the_job_with_one_line(runs):
    d = runs["D"]
    assert d.returncode == 1, d.stderr[-3000:]
    err = d.stderr.strip().splitlines()
    assert "Traceback" not in d.stderr, d.stderr[-3000:]
    assert err[-1].startswith("amsp train: error: amsp: 3 consecutive steps had a non-finite loss"), err
    assert "(steps 1-3; last: non-finite loss on rank(s) 1)" in err[-1]
    skipped = [line for line in err if "skipped on every rank" in line]  # rank 0 logs each
    assert len(skipped) == 2 and "step 1 " in skipped[0] and "step 2 " in skipped[1], err
