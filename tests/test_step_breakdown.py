"""compare/breakdown.py on hand-made profiler events, against hand-computed figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from amsp_ext.compare.breakdown import step_breakdown


def ev(name, thread, start, end, parent=None, shapes=None, dtypes=None):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                           cpu_parent=parent, input_shapes=shapes or [], input_dtypes=dtypes or [])


def _two_steps():
    """Step 1 ends with a post-step broadcast; step 2 computes, launches a bucket all-reduce in
    backward and waits for it, and its forward waits for step 1's broadcast (microseconds)."""
    s1 = ev("phase::step", 1, 0, 1000)
    opt1 = ev("phase::optimizer", 1, 900, 1000, s1)
    bp = ev("amsp::broadcast_params::optim_bcast", 1, 950, 970, opt1)
    bc_issue = ev("c10d::broadcast_", 1, 955, 960, bp)
    s2 = ev("phase::step", 1, 1000, 3000)
    fwd = ev("phase::forward", 1, 1000, 1500, s2)
    bc_wait = ev("amsp::wait::broadcast::optim_bcast", 1, 1000, 1100, fwd)
    fwd_mm = ev("aten::mm", 1, 1100, 1500, fwd)
    bwd = ev("phase::backward", 1, 1500, 2400, s2)
    mm1 = ev("aten::mm", 1, 1500, 1800, bwd)
    ar_label = ev("amsp::all_reduce::param_replica", 1, 1799, 1811, bwd)
    ar_issue = ev("c10d::allreduce_", 1, 1800, 1810, ar_label, shapes=[[]])
    mm2 = ev("aten::mm", 1, 1810, 2000, bwd)
    ar_wait = ev("amsp::wait::all_reduce::param_replica", 1, 2000, 2200, bwd)
    worker_bc = ev("gloo:broadcast", 7, 960, 1050, shapes=[[250]], dtypes=["float"])
    worker_ar = ev("gloo:all_reduce", 8, 1820, 2150, shapes=[[1000]], dtypes=["c10::BFloat16"])
    return [s1, opt1, bp, bc_issue, s2, fwd, bc_wait, fwd_mm, bwd, mm1, ar_label, ar_issue, mm2,
            ar_wait, worker_bc, worker_ar]


def test_breakdown_hand_computed():
    b = step_breakdown(_two_steps())
    rows = {(r["phase"], r["kind"]): r for r in b["rows"]}
    assert set(rows) == {("backward", "AR"), ("post_step_broadcast", "BC")}
    ar = rows[("backward", "AR")]
    # issued 1800, ran to 2150: 350 us busy; compute in it: [1810, 2000] = 190 us
    assert ar["count"] == 1 and ar["bytes"] == 2000  # 1000 bf16 elements
    assert ar["busy_s"] == pytest.approx(350e-6)
    assert ar["overlapped_s"] == pytest.approx(190e-6)
    assert ar["exposed_s"] == pytest.approx(160e-6)  # 10 us issuing + 150 us in the wait
    sites = {w["site"]: w["s"] for w in ar["waits"]}
    assert sites["amsp::wait::all_reduce::param_replica"] == pytest.approx(150e-6)
    assert sites["amsp::all_reduce::param_replica"] == pytest.approx(10e-6)
    bc = rows[("post_step_broadcast", "BC")]
    # step 1's broadcast, issued at 955, done at 1050: nothing computes until 1100
    assert bc["bytes"] == 1000 and bc["busy_s"] == pytest.approx(95e-6)
    assert bc["exposed_s"] == pytest.approx(95e-6) and bc["overlapped_s"] == 0
    t = b["totals"]
    assert t["step_s"] == pytest.approx(2000e-6)
    assert t["compute_s"] == pytest.approx((400 + 300 + 190) * 1e-6)
    assert t["comm_s"] == pytest.approx(445e-6) and t["exposed_s"] == pytest.approx(255e-6)
    assert t["count"] == 2


def test_no_step_label_no_breakdown():
    assert step_breakdown([ev("aten::mm", 1, 0, 10)]) is None


def test_scalar_collectives_are_other():
    s = ev("phase::step", 1, 0, 100)
    opt = ev("phase::optimizer", 1, 0, 100, s)
    clip = ev("amsp::all_reduce::world", 1, 10, 20, opt)
    issue = ev("c10d::allreduce_", 1, 11, 12, clip)
    fn = ev("_c10d_functional::all_reduce", 1, 30, 31, opt)
    w1 = ev("gloo:all_reduce", 5, 13, 25, shapes=[[1]], dtypes=["float"])
    w2 = ev("gloo:all_reduce", 5, 32, 40, shapes=[[1]], dtypes=["float"])
    b = step_breakdown([s, opt, clip, issue, fn, w1, w2])
    assert [(r["phase"], r["kind"], r["count"]) for r in b["rows"]] == [("optimizer", "other", 2)]


def test_a_two_level_all_reduce_counts_as_AR():
    """Its reduce-scatter and all-gather on the levels of param_replica are the gradient
    all-reduce (the planner's T0_os), not a parameter gather; FSDP2's on param_shard stay AG."""
    s = ev("phase::step", 1, 0, 100)
    bwd = ev("phase::backward", 1, 0, 100, s)
    rs = ev("amsp::reduce_scatter::param_replica_local", 1, 10, 12, bwd)
    rs_issue = ev("c10d::_reduce_scatter_base_", 1, 10, 11, rs, shapes=[[8], [16]])
    ar = ev("amsp::all_reduce::param_replica_node", 1, 30, 32, bwd)
    ar_issue = ev("c10d::allreduce_", 1, 30, 31, ar, shapes=[[]])
    ag = ev("amsp::all_gather::param_replica_local", 1, 50, 52, bwd)
    ag_issue = ev("c10d::_allgather_base_", 1, 50, 51, ag, shapes=[[16], [8]])
    ag_p = ev("amsp::all_gather::param_shard", 1, 70, 72, bwd)
    ag_p_issue = ev("c10d::_allgather_base_", 1, 70, 71, ag_p, shapes=[[32], [16]])
    workers = [ev("gloo:all_reduce", 5, 12, 20, shapes=[[16]], dtypes=["float"]),
               ev("gloo:all_reduce", 6, 31, 45, shapes=[[8]], dtypes=["float"]),
               ev("gloo:all_gather", 5, 52, 58, shapes=[[8]], dtypes=["float"]),
               ev("gloo:all_gather", 7, 72, 80, shapes=[[16]], dtypes=["float"])]
    b = step_breakdown([s, bwd, rs, rs_issue, ar, ar_issue, ag, ag_issue, ag_p, ag_p_issue, *workers])
    assert sorted((r["kind"], r["count"]) for r in b["rows"]) == [("AG", 1), ("AR", 3)]


def test_a_reduce_scatter_issued_as_an_all_reduce_counts_as_RS():
    """On gloo the engine issues a unit's reduce-scatter as an all-reduce of its input
    (runtime/collectives.py [Note: a reduce-scatter that can be polled (gloo)]): it is the
    gradient reduce-scatter, with its input's bytes, as FSDP2's own on the same group."""
    s = ev("phase::step", 1, 0, 100)
    bwd = ev("phase::backward", 1, 0, 100, s)
    rs = ev("amsp::reduce_scatter::param_shard", 1, 10, 12, bwd)
    rs_issue = ev("c10d::allreduce_", 1, 10, 11, rs, shapes=[[]])
    worker = ev("gloo:all_reduce", 5, 12, 20, shapes=[[16]], dtypes=["float"])
    b = step_breakdown([s, bwd, rs, rs_issue, worker])
    assert [(r["kind"], r["count"], r["bytes"]) for r in b["rows"]] == [("RS", 1, 64)]
    assert b["wire"]["grad_bytes_per_step"] == 64  # 16 fp32 elements: the whole gradient it reduces


def test_median_step_is_read_whole_with_its_predecessor_skipped():
    """Four profiled steps: the first only precedes; of the other three (exposed 400, 300 and
    200 us by hand: nothing computes while each all-reduce runs) the 300-us one is kept."""
    from amsp_ext.compare.breakdown import median_step

    events = []
    steps = []
    for k, run_us in enumerate((50, 400, 300, 200)):
        t = k * 1000
        s = ev("phase::step", 1, t, t + 1000)
        bwd = ev("phase::backward", 1, t, t + 900, s)
        label = ev("amsp::all_reduce::param_replica", 1, t + 100, t + 110, bwd)
        events += [s, bwd, ev("aten::mm", 1, t, t + 100, bwd), label,
                   ev("c10d::allreduce_", 1, t + 100, t + 110, label, shapes=[[]]),
                   ev("amsp::wait::all_reduce::param_replica", 1, t + 110, t + 100 + run_us, bwd),
                   ev("gloo:all_reduce", 8, t + 105, t + 100 + run_us, shapes=[[1000]], dtypes=["float"])]
        steps.append(s)
    b, step = median_step(events)
    assert step is steps[2]
    assert b["exposed_s_per_step"] == pytest.approx([400e-6, 300e-6, 200e-6])
    assert b["totals"]["exposed_s"] == pytest.approx(300e-6) and b["totals"]["count"] == 1
    assert median_step(events[:7]) is None  # one step: nothing after the first to read


def test_functional_collective_is_one_collective_and_the_next_step_keeps_its_all_reduce():
    """DTensor's clip norm issues ``_c10d_functional::all_reduce`` with a ``c10d::allreduce_``
    inside it, one gloo run. Counted as two issues, the inner one (no shape) was left over and
    taken by the next step's bucket all-reduce, which then fell out of its step. Hand-made: step
    1 ends with the nested pair; step 2 all-reduces a 1000-element bf16 bucket."""
    s1 = ev("phase::step", 1, 0, 1000)
    opt = ev("phase::optimizer", 1, 800, 1000, s1)
    fn = ev("_c10d_functional::all_reduce", 1, 810, 830, opt, shapes=[[21]])
    inner = ev("c10d::allreduce_", 1, 812, 828, fn, shapes=[[]])
    worker_norm = ev("gloo:all_reduce", 7, 815, 900, shapes=[[21]], dtypes=["float"])
    s2 = ev("phase::step", 1, 1000, 2000)
    bwd = ev("phase::backward", 1, 1000, 2000, s2)
    ar = ev("c10d::allreduce_", 1, 1500, 1510, bwd, shapes=[[]])
    worker_ar = ev("gloo:all_reduce", 8, 1520, 1700, shapes=[[1000]], dtypes=["c10::BFloat16"])
    events = [s1, opt, fn, inner, worker_norm, s2, bwd, ar, worker_ar]
    first = step_breakdown(events, index=0)
    assert [(r["phase"], r["kind"], r["count"]) for r in first["rows"]] == [("optimizer", "other", 1)]
    second = step_breakdown(events, index=1)
    assert [(r["phase"], r["kind"], r["count"], r["bytes"]) for r in second["rows"]] == [
        ("backward", "AR", 1, 2000)]
    assert second["wire"]["grad_bytes_per_step"] == 2000 and second["wire"]["grad_dtype"] == "bf16"


def test_runs_of_two_groups_match_their_issues_by_numel():
    """A two-level all-reduce of two buckets (800 and 200 bf16 elements): bucket 2's in-node run
    waits behind bucket 1's while bucket 1's node run (its 400-element half) starts. Matched by
    order alone, that node run took bucket 2's in-node issue and the step counted 800 + 400
    gradient elements; matched by the tensor list's numel (``structured_input_shapes``, where the
    profiler keeps an ``allreduce_``'s tensor), 800 + 200, the gradient once."""
    s = ev("phase::step", 1, 0, 1000)
    bwd = ev("phase::backward", 1, 0, 1000, s)
    evs = [s, bwd]
    for name, t, n in (("local", 100, 800), ("local", 200, 200), ("node", 300, 400), ("node", 400, 100)):
        label = ev(f"amsp::all_reduce::param_replica_{name}[0]", 1, t, t + 5, bwd)
        issue = ev("c10d::allreduce_", 1, t + 1, t + 4, label, shapes=[[], [], []])
        issue.structured_input_shapes = [[[n]], [], []]
        evs += [label, issue]
    runs = ((7, 110, 250, 800), (8, 310, 600, 400), (7, 500, 520, 200), (8, 610, 700, 100))
    evs += [ev("gloo:all_reduce", th, a, b, shapes=[[n]], dtypes=["c10::BFloat16"]) for th, a, b, n in runs]
    wire = step_breakdown(evs)["wire"]
    assert wire["grad_bytes_per_step"] == 2 * (800 + 200)
    assert wire["bytes_per_step"] == {"all_reduce": 2 * (800 + 200 + 400 + 100)}
    for e in evs:  # a torch that keeps no tensor-list shape: the order-only reading, one bucket off
        e.structured_input_shapes = None
    assert step_breakdown(evs)["wire"]["grad_bytes_per_step"] == 2 * (800 + 400)
