"""Step-time model: FLOPs formula, compute time, overlap rules and their dependence on M."""

import pytest

from amsp_ext.planner.cost import comm_cost
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import parse_plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import ClusterSpec, paper_job
from amsp_ext.planner.step import (
    OverlapRules, model_flops_per_token, optimizer_step_time, step_estimate,
)
from planner_helpers import ab_profile


def test_flops_reduce_to_megatron_formula():
    # SwiGLU with i = 8h/3 has GPT's 8h^2 MLP weights; MHA: 4h^2 attention weights.
    h, L, V, s = 6, 3, 50, 12
    spec = ModelSpec(name="gptlike", hidden_size=h, intermediate_size=16, num_layers=L,
                     num_heads=2, num_kv_heads=2, head_dim=3, vocab_size=V)
    megatron = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))  # per token (B s = 1)
    assert model_flops_per_token(spec, s) == pytest.approx(megatron)


def test_llama7b_flops_per_token():
    spec = ModelSpec.preset("llama-7b")
    # 6 * (matmul weights incl. lm_head, no embedding lookup, no norms) + 12 L s h
    matmul = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 32000
    assert model_flops_per_token(spec, 4096) == pytest.approx(6 * matmul + 12 * 32 * 4096 * 4096)


def setup(plan, M=1, recompute=False, R=8, N=4):
    R0, N0 = max(R, 2), max(N, 2)
    spec = ModelSpec.preset("llama-7b")
    cl = ClusterSpec(num_nodes=N, gpus_per_node=R, gpu_memory_bytes=80 * 2**30)
    tr = paper_job(seq_len=2048, num_micro_batches=M, recompute=recompute)
    timer = CommTimer(ab_profile(R0, N0), gpus_per_node=R)
    p = parse_plan(plan)
    comm = comm_cost(p, spec, tr, timer, gpus_per_node=R, num_nodes=N, num_micro_batches=M)
    return spec, cl, tr, timer, p, comm


def estimate(plan, overlap=OverlapRules(), **kw):
    spec, cl, tr, timer, p, comm = setup(plan, **kw)
    return step_estimate(p, spec, tr, cl, timer, comm, num_micro_batches=tr.num_micro_batches,
                         efficiency=0.5, overlap=overlap), comm


def test_no_communication_is_compute_plus_optimizer():
    spec = ModelSpec.preset("llama-7b")
    cl = ClusterSpec(num_nodes=1, gpus_per_node=1, gpu_memory_bytes=2**40)
    tr = paper_job(seq_len=2048, num_micro_batches=2)
    timer = CommTimer(ab_profile(2, 2), gpus_per_node=1)
    p = parse_plan("p=1x1,os=1x1")
    comm = comm_cost(p, spec, tr, timer, gpus_per_node=1, num_nodes=1, num_micro_batches=2)
    assert comm.total == 0
    est = step_estimate(p, spec, tr, cl, timer, comm, num_micro_batches=2, efficiency=0.5)
    compute = 2 * 2048 * model_flops_per_token(spec, 2048) / (312e12 * 0.5)
    t_opt = 30 * spec.num_params / 2.039e12  # AdamW mixed: 30 bytes per owned parameter
    assert est.optimizer_s == pytest.approx(t_opt)
    assert est.step_s == pytest.approx(compute + t_opt)
    assert est.exposed_comm_s == pytest.approx(0, abs=1e-9)
    assert est.mfu == pytest.approx(0.5 * compute / (compute + t_opt))
    assert est.tokens_per_gpu_per_s == pytest.approx(2 * 2048 / (compute + t_opt))


def test_recompute_costs_time_not_useful_flops():
    plain, _ = estimate("p=1x1,g=1x1,os=1x1", R=1, N=1)
    rec, _ = estimate("p=1x1,g=1x1,os=1x1", R=1, N=1, recompute=True)
    layers = 32 * (4 * 4096**2 + 3 * 4096 * 11008) * 2 + 4 * 2048 * 4096 * 32  # fwd FLOPs/token
    extra = 2048 * layers / (312e12 * 0.5)  # one more forward of every layer
    assert rec.compute_s == pytest.approx(plain.compute_s + extra)
    assert rec.mfu == pytest.approx(plain.mfu * plain.step_s / rec.step_s)  # same useful FLOPs


@pytest.mark.parametrize("plan", ["p=8x1,g=8x1,os=8x4", "p=1x1,g=1x1,os=8x4", "p=8x4,g=8x4,os=8x4"])
def test_switching_an_overlap_off_never_helps(plan):
    on, comm = estimate(plan)
    for off in (OverlapRules(ag_rs=False), OverlapRules(ar=False), OverlapRules(bc=False),
                OverlapRules(ag_rs=False, ar=False, bc=False)):
        est, _ = estimate(plan, overlap=off)
        assert est.step_s >= on.step_s - 1e-12
    none, _ = estimate(plan, overlap=OverlapRules(ag_rs=False, ar=False, bc=False))
    # with no overlap at all every collective is on the critical path
    assert none.step_s == pytest.approx(on.compute_s + on.optimizer_s + comm.total, rel=1e-6)
    assert on.exposed_comm_s < comm.total


def test_step_depends_on_m():
    one, c1 = estimate("p=8x4,g=8x4,os=8x4", M=1)
    four, c4 = estimate("p=8x4,g=8x4,os=8x4", M=4)
    assert c4.t_p == pytest.approx(4 * c1.t_p)
    assert four.step_s > one.step_s
    assert four.mfu > one.mfu  # more compute to hide the per-step collectives behind


def test_optimizer_time_shrinks_with_sos():
    spec, cl, tr, *_ = setup("p=1x1,os=1x1")
    t1 = optimizer_step_time(spec, parse_plan("p=1x1,os=1x1"), tr, cl)
    t8 = optimizer_step_time(spec, parse_plan("p=1x1,os=8x1"), tr, cl)
    assert t1 == pytest.approx(8 * t8)


def test_timeline_helpers_by_hand():
    import numpy as np

    from amsp_ext.planner.step import _bucket_ready, _chain, _stream_end

    c = np.array([2.0, 1.0, 3.0])
    g = np.array([1.0, 4.0, 1.0])
    # prefetch: start0 = g0 = 1; start1 = 1 + max(c0, g1) = 5; start2 = 5 + max(c1, g2) = 6
    assert _chain(c, g, np.zeros(3)).tolist() == [1.0, 5.0, 6.0]
    # no overlap (each gather takes the compute thread for all its time): gather after the
    # previous compute: 1, 1 + 2 + 4 = 7, 7 + 1 + 1 = 9
    assert _chain(c, g, g).tolist() == [1.0, 7.0, 9.0]
    # half of each gather on the compute thread: 1, 1 + max(2 + 2, 4) = 5, 5 + max(1 + 0.5, 1)
    assert _chain(c, g, g / 2).tolist() == [1.0, 5.0, 6.5]
    # FIFO stream: ready 0, 1, 10 with durations 3, 3, 1 -> ends 3, 6, 11
    assert _stream_end(np.array([0.0, 1.0, 10.0]), np.array([3.0, 3.0, 1.0])) == 11.0
    # buckets of 10 bytes over grads of 4, 8, 3 bytes ready at 1, 2, 3:
    # bucket 1 closes inside the 2nd unit (ready 2), bucket 2 = the remaining 5 bytes (ready 3)
    ready, sizes = _bucket_ready(np.array([4.0, 8.0, 3.0]), np.array([1.0, 2.0, 3.0]), 10.0)
    assert ready.tolist() == [2.0, 3.0] and sizes.tolist() == [10.0, 5.0]


def test_engine_all_reduce_window_counts_bytes_by_hand():
    """planner/buckets.py [Note: bytes in flight], as the calibrated model applies it: one micro-batch,
    backward 0..10 s, four buckets ready at 1, 2, 3, 4 s, each all-reduce 4 s, no thread cost."""
    import numpy as np

    from amsp_ext.planner.step import _engine_micro_batches

    ready = np.array([1.0, 2.0, 3.0, 4.0])
    ar = [np.array([[4.0, 0.0]] * 4)]

    def end(b_bytes, cap):
        return _engine_micro_batches(1, first_fwd=0.0, fwd=0.0, bwd=10.0, b_ready=ready,
                                     b_bytes=np.array(b_bytes, dtype=float), ar=ar, max_in_flight=cap, rs=None)

    # the stream is FIFO: ends 5, 9, 13, 17; no limit, so the backward never waits: the pass
    # ends with the last all-reduce at 17
    assert end([1, 1, 1, 1], None) == 17.0
    # four small buckets under a cap of 2 full (U = 4 bytes: cap 8): all four in flight at once
    assert end([1, 1, 1, 1], 8.0) == 17.0
    # full buckets (4 bytes each), cap 8: bucket 2 waits for bucket 0 (ends 5, launch 3 -> +2 s
    # on the backward), bucket 3 for bucket 1 (ends 9; its launch, 4 + 2 = 6, -> +3 s): the
    # backward ends at 10 + 5 = 15, the last all-reduce at 17
    assert end([4, 4, 4, 4], 8.0) == 17.0
    # a long backward (30 s) makes the stall visible: all-reduces of 8 s end at 9, 17, 25, 33
    # whatever the cap; with full buckets bucket 2 launches at 9 (3 -> +6 s on the backward)
    # and bucket 3 at 17 (its ready time 4 + 6 = 10 -> +7 s): the backward ends at 30 + 13
    ar[0] = np.array([[8.0, 0.0]] * 4)

    def long(b_bytes, cap):
        return _engine_micro_batches(1, first_fwd=0.0, fwd=0.0, bwd=30.0, b_ready=ready,
                                     b_bytes=np.array(b_bytes, dtype=float), ar=ar, max_in_flight=cap, rs=None)

    assert long([4, 4, 4, 4], 8.0) == 43.0
    # small buckets under the same cap never stall it (a cap of 2 buckets would: 43 again)
    assert long([1, 1, 1, 1], 8.0) == 33.0
    # a bucket bigger than the cap first waits for all before it: bucket 3 at 25 (4 -> +21 s)
    assert long([1, 1, 1, 9], 8.0) == 51.0
