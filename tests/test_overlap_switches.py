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
    proc = run_ranks(4, "tests.overlap_switch_worker", timeout=240)
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
