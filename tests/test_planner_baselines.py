"""Baselines as factor tuples and ZeRO++ (hpZ) costed by hand on the toy case."""

import pytest

from amsp_ext.planner.baselines import baselines, comparison
from amsp_ext.planner.search import make_problem
from amsp_ext.planner.specs import ClusterSpec, paper_job
from planner_helpers import TOY, constant_profile

GB = {"allgather": 1.0, "reducescatter": 2.0, "allreduce": 4.0, "broadcast": 8.0}


def problem():
    cl = ClusterSpec(num_nodes=2, gpus_per_node=4, gpu_memory_bytes=2**30)
    tr = paper_job(seq_len=8, num_micro_batches=3, bucket_bytes=100)
    return make_problem(TOY, cl, tr, constant_profile(4, 2, GB), memory_reserve_bytes=0)


def test_factor_tuples():
    got = {b.key: b.plan.as_tuple() for b in baselines(problem())}
    assert got == {
        "ddp": (1, 1, 1, 1, 1, 1), "zero1": (1, 1, 1, 1, 4, 2), "zero2": (1, 1, 4, 2, 4, 2),
        "zero3": (4, 2, 4, 2, 4, 2), "zero++": (4, 2, 4, 2, 4, 2), "mics": (4, 1, 4, 1, 4, 1),
    }
    mics2 = {b.key: b for b in baselines(problem(), mics_size=2)}["mics"]
    assert mics2.plan.as_tuple() == (2, 1, 2, 1, 2, 1)


def test_zeropp_by_hand():
    b = {b.key: b for b in baselines(problem())}
    zpp, z3 = b["zero++"].candidate, b["zero3"].candidate
    # Tp = M * sum_i [AG(2Phi_i) on 4x2 + AG(2Phi_i) on the hpZ node 4x1 + RS(2Phi_i) on 4x2]
    #    = 3 * (872/1e9 + 872/1e9 + 872/2e9) s = 6540 ns; no Tg / T0_os / T1_os
    assert zpp.comm.t_p == pytest.approx(6540e-9)
    assert zpp.comm.t_g == zpp.comm.t0_os == zpp.comm.t1_os == 0
    # ZeRO-3 gathers the layers twice over 4x2 but the root unit (embedding 64 + lm_head 64 +
    # final norm 4 params = 264 B) once, as FSDP2 does (units.py [Note: one root unit]):
    # 3 * ((872 + 608)/1e9 + 872/2e9) = 5748 ns
    assert z3.comm.t_p == pytest.approx(5748e-9)
    # secondary shard: 2 Phi / hpZ = 872 / 4 bytes on top of ZeRO-3's shard. 8-way sharding pads
    # every tensor's dim 0 to a multiple of 8 (memory.py [Note: FSDP2's padding]): per layer the
    # norms 2 x 8, q/k/v/o 4 x 8 x 4, gate/up 2 x 8 x 4, down 8 x 8; embedding and lm_head 16 x 4,
    # the final norm 8: the toy stores 680 elements, not 436
    assert TOY.padded_params(8) == 2 * (16 + 4 * 32 + 2 * 32 + 64) + 64 + 8 + 64 == 680
    assert TOY.padded_params(2) == TOY.num_params  # every dim 0 of the toy is even
    assert zpp.memory.params == 2 * 680 // 8 + 872 // 4
    assert zpp.memory.total == z3.memory.total + 872 // 4


def test_comparison_sentence():
    bs = {b.key: b for b in baselines(problem())}
    chosen, z3 = bs["mics"].candidate, bs["zero3"]
    # MiCS 5.8025 us of communication against ZeRO-3's 5.748 us (the root unit gathered once,
    # test_zeropp_by_hand): 5.8025 / 5.748 = 1.0095x more; 6072 B against 5000 B of memory:
    # 1072 B more, 0.0 GiB at one decimal
    assert chosen.comm.total == pytest.approx(5.8025e-6) and z3.candidate.comm.total == pytest.approx(5.748e-6)
    assert comparison(chosen, z3) == "vs ZeRO-3: 1.01x more communication, 0.0 GiB more memory per GPU"
