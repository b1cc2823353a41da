"""The paper's Table V switches (``--no-overlap-allgather/-allreduce/-broadcast``) each turn off
the overlap of their kind, as a fact of program order (no timing): with the switch on, some
collectives of that kind have compute between their issue and their wait; off, none does
(compare/breakdown.py [Note: issue-to-wait windows]). One 4-rank launch, tiny-llama."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.distributed

KIND = {"allgather": "AG", "allreduce": "AR", "broadcast": "BC"}


@pytest.fixture(scope="module")
def windows():
    # [Note: one rerun after a rank's crash]
    # In 1 of 18 launches on 2026-12-02 (and in one full suite run before), one rank died of
    # SIGSEGV after its six profiled cases, before rank 0 printed RESULT; the cause is
    # not found (the worker profiles six times with torch.profiler in forked ranks). What this
    # test checks is program order inside the traces, so a launch killed by a signal is run
    # once more, and said so; a second crash, or any other failure, fails the test.
    proc = run_ranks(4, "tests.overlap_switch_worker", timeout=240, check=False)
    if proc.returncode in (128 + 11, 128 + 6):  # fork_launch: 128 + signal of the first bad rank
        print(f"overlap_switch_worker: a rank died (exit {proc.returncode}); running it once more")
        proc = run_ranks(4, "tests.overlap_switch_worker", timeout=240, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("switch", sorted(KIND))
def test_switch_off_removes_its_overlap(windows, switch):
    kind = KIND[switch]
    on, off = windows[f"{switch}:on"][kind], windows[f"{switch}:off"][kind]
    # off also waits, inside the profile, for the last step's broadcasts (on: the next forward)
    assert off["waited"] >= on["waited"] >= 2, (on, off)
    assert on["with_compute"] >= 1, on  # on: issued, compute ran, then waited
    assert off["with_compute"] == 0, off  # off: every one waited for where it was issued


def test_a_switch_leaves_the_other_kinds_alone(windows):
    # the all-gather switch does not touch the gradient all-reduce of the same run, nor the
    # all-reduce switch the broadcasts
    assert windows["allgather:off"].get("AR") == windows["allgather:on"].get("AR")
    assert windows["allreduce:off"]["AR"]["waited"] == windows["allreduce:on"]["AR"]["waited"]
