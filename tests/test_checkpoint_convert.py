"""``amsp checkpoint convert --trust``: an old-format checkpoint (pickled parts, written in the
test by that format's layout: tests/convert_worker.py) becomes a current one that loads with
every value the old run saved. The references are the saving run's own tensors and streams,
not the converter's output. One process (a 1-rank group), so no CPU lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("AMSP_CHECKPOINT_KEY", None)
    p = subprocess.run([sys.executable, "-m", "tests.convert_worker", str(root)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_old_format_refused_naming_the_convert_command(result):
    assert "amsp checkpoint convert --trust" in result["refused_old"]
    assert "\n" not in result["refused_old"]


def test_convert_without_trust_refuses_in_one_line_and_writes_nothing(result):
    r = result["no_trust"]
    assert r["rc"] == 2 and r["stderr"].count("\n") == 1 and "--trust" in r["stderr"], r
    assert not result["untrusted_dst_created"]


def test_existing_destination_refused(result):
    r = result["dst_exists"]
    assert r["rc"] == 2 and "exists" in r["stderr"] and r["stderr"].count("\n") == 1, r


def test_converted_checkpoint_restores_what_the_old_run_saved(result):
    assert result["converted"]["rc"] == 0, result["converted"]
    assert result["format"] == "amsp-checkpoint/3" and result["converted_from"] == "amsp-checkpoint/2"
    assert ".metadata" not in result["files"] and not any(f.endswith(".distcp") for f in result["files"])
    assert result["weights_max_abs_diff"] == 0.0
    assert result["states_equal"] and result["note_state"] == [3, 2.5]
    assert result["num_steps"] == result["saved_num_steps"] == 1
    assert result["lr"] == result["saved_lr"]
    assert result["extra"] == result["extra_expected"]
    assert result["rng_restored"]
    assert result["next_loss"] == result["ref_next_loss"]  # same plan, fp32: bit-exact continuation
