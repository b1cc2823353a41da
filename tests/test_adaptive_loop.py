"""Adaptive AMSP outside `amsp train`: your own loop on ``amsp_ext.shard(config=ShardConfig(
adaptive=...))`` and a DeepSpeed script with ds_config ``amsp.adaptive`` switch plans by
themselves at the end of an ``optimizer.step()`` once the monitor sees a slow link (a fake one:
AMSP_FAULTS ``slow`` from step K), and train like torch DDP on every step before and after the
switch. One 4-rank launch (tests/adaptive_loop_worker.py); the band of test_adaptive_train.py
([Note: the band of this test] there: the bundled A800 profile is ~200x off on CPU).
"""

from __future__ import annotations

import json

import pytest

from dist_utils import run_torchrun

pytestmark = pytest.mark.distributed

K, WINDOW, STEPS, FACTOR = 4, 4, 12, 1e6


@pytest.fixture(scope="module")
def results():
    faults = ";".join(f"slow:rank={r}:step={K}-{STEPS}:x={FACTOR:g}" for r in range(4))
    proc = run_torchrun(4, "tests.adaptive_loop_worker", timeout=300, env={"AMSP_FAULTS": faults})
    return {r["case"]: r for r in (json.loads(line[len("RESULT "):])
                                   for line in proc.stdout.splitlines() if line.startswith("RESULT "))}


@pytest.mark.parametrize("case", ["loop", "deepspeed"])
def test_switches_by_itself_and_trains_like_ddp(results, case):
    r = results[case]
    assert r["num_losses"] == STEPS
    # one switch, away from zero3, within window + 1 steps of the slow link (the monitor reads
    # step k's numbers at the end of step k + 1); nothing before it
    assert len(r["switches"]) == 1, r["decisions"]
    sw = r["switches"][0]
    assert sw["from"] == "p=2x2,g=2x2,os=2x2" and sw["to"] != sw["from"], sw
    assert K + WINDOW <= sw["step"] <= K + WINDOW + 2, (sw, r["decisions"])
    assert all("SWITCH" in line or "stay" in line for line in r["decisions"])
    # every step, before and after the switch, as torch DDP (fp32 parity bound)
    assert r["loss_max_rel_diff"] <= 1e-5 and r["norm_max_rel_diff"] <= 1e-5, r
