"""compare/cpu.py: CPU seconds per step by thread, against hand-made readings and against a thread's
own clock (time.thread_time); the row's figure from per-rank, per-step readings by hand."""

from __future__ import annotations

import threading
import time

import pytest

from amsp_ext.compare.cpu import step_cpu, thread_cpu_s
from amsp_ext.compare.summary import _cpu


def test_step_cpu_by_hand():
    me = threading.get_native_id()
    before = {me: 1.0, 7: 2.0, 8: 0.5}
    after = {me: 1.3, 7: 2.25, 9: 0.1}  # thread 8 ended, thread 9 started
    got = step_cpu(before, after)
    assert got["main"] == pytest.approx(0.3) and got["other"] == pytest.approx(0.25 + 0.1)
    assert step_cpu(None, after) is None


def test_a_busy_thread_is_other_and_matches_its_own_clock():
    used, burnt, release = {}, threading.Event(), threading.Event()

    def burn():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:
            sum(range(1000))
        used["s"] = time.thread_time() - t0
        burnt.set()
        release.wait()  # alive until read: an ended thread's CPU is not in a reading

    before = thread_cpu_s()
    if before is None:
        pytest.skip("no /proc task list on this system")
    main0 = time.thread_time()
    worker = threading.Thread(target=burn)
    worker.start()
    burnt.wait()
    after = thread_cpu_s()
    main_used = time.thread_time() - main0
    release.set()
    worker.join()
    got = step_cpu(before, after)
    # the kernel counts in clock ticks (10 ms)
    assert got["other"] == pytest.approx(used["s"], abs=0.03)
    assert got["main"] == pytest.approx(main_used, abs=0.03)


def test_the_rows_figure_is_the_median_over_ranks_of_each_ranks_median_after_warmup():
    ranks = [{"cpu_s": [{"main": 9.0, "other": 9.0}] + [{"main": m, "other": m / 10} for m in (1, 2, 3)]},
             {"cpu_s": [{"main": 9.0, "other": 9.0}] + [{"main": m, "other": m / 10} for m in (3, 4, 5)]}]
    assert _cpu(ranks, 1) == pytest.approx({"main": 3.0, "other": 0.3})
    ranks[1]["cpu_s"][2] = None  # a rank that could not read /proc: no figure
    assert _cpu(ranks, 1) is None
