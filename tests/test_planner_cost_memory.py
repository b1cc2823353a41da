"""Tp, Tg, T0_os, T1_os and the memory terms on a small hand-worked case.

Toy model (tests/planner_helpers.py): Phi = 436 parameters; cluster R = 4 GPUs x N = 2 nodes;
plan p=2x1, g=4x2, os=4x2; M = 3 micro-batches; U = 100 bytes; bf16 (e = 2 bytes).
Constant bandwidths: allgather 1, reducescatter 2, allreduce 4, broadcast 8 GB/s, so
t(op, v) = v / (w * 1e9) on every mesh.
"""

import pytest

from amsp_ext.planner.cost import comm_cost
from amsp_ext.planner.memory import activation_bytes, memory_breakdown, optimizer_bytes_per_param
from amsp_ext.planner.plan import parse_plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import TrainingSpec
from planner_helpers import TOY, TOY_PHI, constant_profile

GB = {"allgather": 1.0, "reducescatter": 2.0, "allreduce": 4.0, "broadcast": 8.0}
PLAN = parse_plan("p=2x1,g=4x2,os=4x2")
TRAIN = TrainingSpec(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100)


def cost(concurrency="all_groups", plan=PLAN, training=TRAIN):
    timer = CommTimer(constant_profile(4, 2, GB, concurrency=concurrency), gpus_per_node=4)
    return comm_cost(plan, TOY, training, timer, gpus_per_node=4, num_nodes=2,
                     num_micro_batches=training.num_micro_batches)


def test_toy_has_436_params():
    assert TOY.num_params == TOY_PHI == 2 * 152 + 132


def test_four_terms_by_hand():
    c = cost()
    # Tp = M * sum_i [2 * 2Phi_i / 1e9 + 2Phi_i / 2e9] = 3 * (4 + 1) * 436 ns = 6540 ns
    assert c.t_p == pytest.approx(6540e-9)
    # buckets = 2Phi / (U sp) = 872 / 200 = 4.36; t(AR, 100 B) = 25 ns
    # Tg = (M - 1) * 4.36 * 25 ns = 218 ns (grad mesh (4/2) x (2/1))
    assert c.t_g == pytest.approx(218e-9)
    # T0_os = 4.36 * 25 ns = 109 ns (replica mesh (4/2) x (2/1))
    assert c.t0_os == pytest.approx(109e-9)
    # T1_os = (sos/sp) t(BC, 2Phi/sos) = 4 * (872/8 B) / 8e9 = 54.5 ns
    assert c.t1_os == pytest.approx(54.5e-9)
    assert c.total == pytest.approx((6540 + 218 + 109 + 54.5) * 1e-9)


def test_single_group_profile_charges_contention():
    c = cost("single_group")
    # cross-node meshes 2x2 are shared by R/p0 = 4/2 = 2 groups per node; Tp (2x1) is intra-node
    assert c.t_p == pytest.approx(6540e-9)
    assert (c.t_g, c.t0_os, c.t1_os) == pytest.approx((436e-9, 218e-9, 109e-9))


def test_terms_vanish_where_the_paper_says():
    ddp = cost(plan=parse_plan("p=1x1,g=1x1,os=1x1"))
    assert ddp.t_p == ddp.t_g == ddp.t1_os == 0  # only the all-reduce over all 8 GPUs
    assert ddp.t0_os == pytest.approx(872 / 100 * 25e-9)
    zero3 = cost(plan=parse_plan("p=4x2,g=4x2,os=4x2"))
    assert zero3.t_g == zero3.t0_os == zero3.t1_os == 0
    one = cost(plan=PLAN, training=TrainingSpec(seq_len=8, num_micro_batches=1, bucket_bytes=100))
    assert one.t_g == 0  # M = 1: the last micro-batch's all-reduce is T0_os


def test_model_states_by_hand():
    m = memory_breakdown(TOY, PLAN, TRAIN, gpus_per_node=4, num_nodes=2)
    assert m.params == 2 * 436 // 2  # 2 Phi / sp
    assert m.grads == 2 * 436 // 8  # 2 Phi / sg
    assert m.optim == 12 * 436 // 8  # 12 Phi / sos (fp32 master + m + v)


@pytest.mark.parametrize("opt,prec,k", [
    ("adamw", "bf16", 12), ("adamw", "fp32", 8), ("sgd-momentum", "bf16", 8),
    ("sgd-momentum", "fp32", 4), ("lion", "fp16", 8), ("adam8bit", "bf16", 6 + 8 / 2048),
    ("adam8bit", "fp32", 2 + 8 / 2048),
])
def test_optimizer_bytes(opt, prec, k):
    assert optimizer_bytes_per_param(opt, prec) == pytest.approx(k)


def test_activations_by_hand():
    # A_layer = e(4h + 2q + 2kv + 4i) + 8h + 4a + 8 = 2(16 + 8 + 4 + 32) + 32 + 8 + 8 = 168
    # per token (8h: the unfused RMSNorms' fp32 inputs); A_out = 2eh + 4 + (e + 8) V
    # = 16 + 4 + 160 = 180 per token; T = 8 tokens
    assert activation_bytes(TOY, TRAIN) == 8 * (2 * 168 + 180)
    rec = TrainingSpec(seq_len=8, num_micro_batches=1, recompute=True)
    assert activation_bytes(TOY, rec) == 8 * (2 * (2 * 4) + 168 + 180)  # L e h + A_layer + A_out
    fp32 = TrainingSpec(seq_len=8, num_micro_batches=1, precision="fp32")
    # e = 4: A_layer = 4 * 60 + 32 + 16 = 288; A_out = 32 + 4 + 12 * 16 = 228
    assert activation_bytes(TOY, fp32) == 8 * (2 * 288 + 228)


def test_llama7b_activations_against_megatron_scale():
    from amsp_ext.planner.model_spec import ModelSpec

    spec = ModelSpec.preset("llama-7b")
    t = TrainingSpec(seq_len=4096, num_micro_batches=1)
    per_layer_token = (activation_bytes(spec, t) / 4096 - (2 * 2 * 4096 + 4 + 10 * 32000)) / 32
    # e(4h + 2h + 2h + 4i) + 8h + 4a + 8 with h = 4096, i = 11008, a = 32: 45.5 h (GPT's is
    # 34 h); 187,016 bytes per token is what one HF decoder layer keeps under FakeTensorMode
    # (saved_tensors_hooks; [Note: unfused RMSNorm]), less RoPE's shared cos/sin (512)
    assert per_layer_token == 2 * (8 * 4096 + 4 * 11008) + 8 * 4096 + 128 + 8 == 187016 - 512
    assert 45 < per_layer_token / 4096 < 46


def test_tmp_buffers_by_hand():
    m = memory_breakdown(TOY, PLAN, TRAIN, gpus_per_node=4, num_nodes=2)
    parts = m.tmp_parts
    assert parts["buckets"] == 2 * 100  # two buckets in flight
    # largest unit is the embedding/lm_head (64 params): current + prefetched + 2 grads, bf16
    assert parts["gathered_params"] == 2 * (64 + 64) + 2 * 2 * 64
    assert parts["owned_fp32_grads"] == 4 * 436 // 8
    assert parts["broadcast_staging"] == 100  # sos > sp
    # backward phase (activations 4128 + 200 + 512) beats the step phase (218 + 100)
    assert parts["peak_phase"] == "backward"
    assert m.tmp == 200 + 512
    rec = TrainingSpec(seq_len=8, num_micro_batches=3, bucket_bytes=100, recompute=True)
    mr = memory_breakdown(TOY, PLAN, rec, gpus_per_node=4, num_nodes=2)
    assert mr.tmp_parts["gathered_params"] == 2 * (152 + 64) + 2 * 2 * 64  # a whole layer kept
    ddp = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), TRAIN, gpus_per_node=4,
                           num_nodes=2)
    assert ddp.tmp_parts == {"buckets": 200, "gathered_params": 0, "owned_fp32_grads": 4 * 436,
                             "broadcast_staging": 0, "peak_phase": "backward"}
    assert ddp.tmp == 200  # 4128 + 200 > 4 * 436
    short = TrainingSpec(seq_len=1, num_micro_batches=3, bucket_bytes=100)  # activations 516 (2 x 168 + 180)
    ddp1 = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), short, gpus_per_node=4,
                            num_nodes=2)
    assert ddp1.tmp_parts["peak_phase"] == "optimizer step"  # 4 * 436 > 516 + 200
    assert ddp1.activations == 516
    assert ddp1.tmp == 4 * 436 - 516
    assert ddp1.activations + ddp1.tmp == 4 * 436
    assert m.total == m.params + m.grads + m.optim + m.activations + m.tmp


def test_buffers_never_exceed_the_ranks_gradients():
    # TOY has 436 params: 872 bf16 gradient bytes per rank unsharded, 436 with sp = 2. A 128 MiB
    # bucket can never be filled, so the buffers are capped at those bytes (small-model plans).
    big = TrainingSpec(seq_len=8, num_micro_batches=3)  # default U = 128 MiB
    ddp = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), big, gpus_per_node=4, num_nodes=2)
    assert ddp.tmp_parts["buckets"] == 2 * 872
    m = memory_breakdown(TOY, parse_plan("p=2x1,g=2x1,os=4x2"), big, gpus_per_node=4, num_nodes=2)
    assert m.tmp_parts["buckets"] == 2 * 436 and m.tmp_parts["broadcast_staging"] == 436
