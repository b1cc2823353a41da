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
from amsp_ext.planner.specs import paper_job
from planner_helpers import TOY, TOY_PHI, constant_profile

GB = {"allgather": 1.0, "reducescatter": 2.0, "allreduce": 4.0, "broadcast": 8.0}
PLAN = parse_plan("p=2x1,g=4x2,os=4x2")
TRAIN = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100)


def cost(concurrency="all_groups", plan=PLAN, training=TRAIN):
    timer = CommTimer(constant_profile(4, 2, GB, concurrency=concurrency), gpus_per_node=4)
    return comm_cost(plan, TOY, training, timer, gpus_per_node=4, num_nodes=2,
                     num_micro_batches=training.num_micro_batches)


def test_toy_has_436_params():
    assert TOY.num_params == TOY_PHI == 2 * 152 + 132


def test_four_terms_by_hand():
    c = cost()
    # Tp = M * sum_i [2 * 2Phi_i / 1e9 + 2Phi_i / 2e9] over the layers' units, but the root unit
    # (embedding 64 + lm_head 64 + final norm 4 = 132 params) gathered once, not again in
    # backward (units.py [Note: one root unit]): 3 * ((872 + 872 - 264) + 436) ns = 5748 ns
    assert c.t_p == pytest.approx(5748e-9)
    # buckets = 2Phi / (U sp) = 872 / 200 = 4.36; t(AR, 100 B) = 25 ns
    # Tg = (M - 1) * 4.36 * 25 ns = 218 ns (grad mesh (4/2) x (2/1))
    assert c.t_g == pytest.approx(218e-9)
    # T0_os = 4.36 * 25 ns = 109 ns (replica mesh (4/2) x (2/1))
    assert c.t0_os == pytest.approx(109e-9)
    # T1_os = (sos/sp) t(BC, 2Phi/sos) = 4 * (872/8 B) / 8e9 = 54.5 ns
    assert c.t1_os == pytest.approx(54.5e-9)
    assert c.total == pytest.approx((5748 + 218 + 109 + 54.5) * 1e-9)


def test_single_group_profile_charges_contention():
    c = cost("single_group")
    # cross-node meshes 2x2 are shared by R/p0 = 4/2 = 2 groups per node; Tp (2x1) is intra-node
    assert c.t_p == pytest.approx(5748e-9)
    assert (c.t_g, c.t0_os, c.t1_os) == pytest.approx((436e-9, 218e-9, 109e-9))


def test_terms_vanish_where_the_paper_says():
    ddp = cost(plan=parse_plan("p=1x1,g=1x1,os=1x1"))
    assert ddp.t_p == ddp.t_g == ddp.t1_os == 0  # only the all-reduce over all 8 GPUs
    assert ddp.t0_os == pytest.approx(872 / 100 * 25e-9)
    zero3 = cost(plan=parse_plan("p=4x2,g=4x2,os=4x2"))
    assert zero3.t_g == zero3.t0_os == zero3.t1_os == 0
    one = cost(plan=PLAN, training=paper_job(seq_len=8, num_micro_batches=1, bucket_bytes=100))
    assert one.t_g == 0  # M = 1: the last micro-batch's all-reduce is T0_os


def test_model_states_by_hand():
    m = memory_breakdown(TOY, PLAN, TRAIN, gpus_per_node=4, num_nodes=2)
    assert m.params == 2 * 436 // 2  # 2 Phi / sp
    assert m.grads == 2 * 436 // 8  # 2 Phi / sg
    assert m.optim == 12 * 436 // 8  # 12 Phi / sos (fp32 master + m + v)


@pytest.mark.parametrize("opt,prec,k", [
    ("adamw", "bf16", 12), ("adamw", "fp32", 8), ("sgd-momentum", "bf16", 8),
    ("sgd-momentum", "fp32", 4), ("lion", "fp16", 8), ("adam8bit", "bf16", 6 + 8 / 2048),
    ("adam8bit", "fp32", 2 + 8 / 2048), ("muon", "bf16", 8), ("muon", "fp32", 4), ("adafactor", "bf16", 4),
    ("adafactor", "fp32", 0),
])
def test_optimizer_bytes(opt, prec, k):
    assert optimizer_bytes_per_param(opt, prec) == pytest.approx(k)


def test_whole_tensor_optimizer_by_hand():
    """Muon / Adafactor (cost.py [Note: the whole-tensor exchange], memory.py [Note: whole-tensor
    optimizers]): with sp > 1, Twt = 2 t(RS, 4 Phi / sos) on the p mesh and the step's exchange
    buffers 2 * 4 Phi / sos. The optimizer states are the owners' byte caps (the largest tensor
    X is the toy's embedding and head, 16 x 4 = 64): sp = 2, b = 4 groups: a rank's rows
    R = Phi/8 + X/2, whole tensors R + X, K = 8 on them and, in bf16, the fp32 rows beside;
    sp = 1: Phi/8 + X whole tensors, K = 8 (fp32: K = 4, the masters are the parameters)."""
    muon = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100, optimizer="muon")
    c = cost(training=muon)
    assert c.t_wt == pytest.approx(2 * (4 * 436 / 8) / 2e9)  # 218 ns
    assert c.total == pytest.approx((5748 + 218 + 109 + 54.5 + 218) * 1e-9)
    m = memory_breakdown(TOY, PLAN, muon, gpus_per_node=4, num_nodes=2)
    rows = 436 / 8 + 64 / 2
    assert m.optim == int(8 * (rows + 64) + 4 * rows) == 1550
    assert m.tmp_parts["whole_tensor_exchange"] == 2 * 4 * 436 // 8
    assert m.moments["optimizer step"]["tmp"] == (m.tmp_parts["owned_fp32_grads"] + m.tmp_parts["broadcast_staging"]
                                                  + 2 * 4 * 436 // 8)
    fp32 = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100, optimizer="muon",
                     precision="fp32")
    # fp32: the rows are the parameters, the whole fp32 masters are the copy
    assert memory_breakdown(TOY, PLAN, fp32, gpus_per_node=4, num_nodes=2).optim == int((4 + 4) * (rows + 64)) == 1204
    # sp = 1: every rank holds whole tensors already; nothing is exchanged, the owners are capped
    unsharded = parse_plan("p=1x1,g=4x2,os=4x2")
    assert cost(plan=unsharded, training=muon).t_wt == 0
    assert memory_breakdown(TOY, unsharded, muon, gpus_per_node=4, num_nodes=2).optim == 8 * (436 / 8 + 64) == 948
    # one owner (sos = sp): it holds everything, exactly
    assert memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), muon, gpus_per_node=4, num_nodes=2).optim == 8 * 436
    # an elementwise optimizer keeps K Phi / sos
    assert memory_breakdown(TOY, unsharded, TRAIN, gpus_per_node=4, num_nodes=2).optim == 12 * 436 // 8
    # an elementwise optimizer on the same plan pays neither
    assert cost().t_wt == 0


def test_frozen_models_by_hand():
    """A frozen reference of the same shape beside the trained model (specs.py [Note: frozen
    models]): its parameter shard e Phi / sp more memory, and one forward all-gather per unit per
    micro-batch on the p mesh: Tfz = M * 2 Phi / 1 GB/s = 3 * 872 ns = 2616 ns."""
    dpo = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100, frozen_models=1)
    c = cost(training=dpo)
    assert c.t_frozen == pytest.approx(2616e-9)
    assert c.total == pytest.approx((5748 + 218 + 109 + 54.5 + 2616) * 1e-9)
    m = memory_breakdown(TOY, PLAN, dpo, gpus_per_node=4, num_nodes=2)
    assert m.params == 2 * (2 * 436 // 2)  # the policy's and the reference's shards
    assert m.grads == 2 * 436 // 8 and m.optim == 12 * 436 // 8  # the reference has neither
    two = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100, frozen_models=2)
    assert cost(training=two).t_frozen == pytest.approx(2 * 2616e-9)
    # p = 1: a frozen model is held whole and gathers nothing
    assert cost(plan=parse_plan("p=1x1,g=4x2,os=4x2"), training=dpo).t_frozen == 0


def test_activations_by_hand():
    # A_layer = e(4h + 2q + 2kv + 4i) + 8h + 4a + 8 = 2(16 + 8 + 4 + 32) + 32 + 8 + 8 = 168
    # per token (8h: the unfused RMSNorms' fp32 inputs); A_out = 4h + 2eh + 4 + 4V (the final
    # unfused norm, the fp32 log-softmax) = 16 + 16 + 4 + 64 = 100 per token; T = 8 tokens
    assert activation_bytes(TOY, TRAIN) == 8 * (2 * 168 + 100)
    rec = paper_job(seq_len=8, num_micro_batches=1, recompute=True)
    assert activation_bytes(TOY, rec) == 8 * (2 * (2 * 4) + 100)  # L e h + A_out
    fp32 = paper_job(seq_len=8, num_micro_batches=1, precision="fp32")
    # e = 4: A_layer = 4 * 60 + 32 + 16 = 288; A_out = 16 + 32 + 4 + 64 = 116
    assert activation_bytes(TOY, fp32) == 8 * (2 * 288 + 116)


def test_llama7b_activations_against_megatron_scale():
    from amsp_ext.planner.model_spec import ModelSpec

    spec = ModelSpec.preset("llama-7b")
    t = paper_job(seq_len=4096, num_micro_batches=1)
    per_layer_token = (activation_bytes(spec, t) / 4096 - (4 * 4096 + 2 * 2 * 4096 + 4 + 4 * 32000)) / 32
    # e(4h + 2h + 2h + 4i) + 8h + 4a + 8 with h = 4096, i = 11008, a = 32: 45.5 h (GPT's is
    # 34 h); 187,016 bytes per token is what one HF decoder layer keeps under FakeTensorMode
    # (saved_tensors_hooks; [Note: unfused RMSNorm]), less RoPE's shared cos/sin (512)
    assert per_layer_token == 2 * (8 * 4096 + 4 * 11008) + 8 * 4096 + 128 + 8 == 187016 - 512
    assert 45 < per_layer_token / 4096 < 46


def test_tmp_buffers_by_hand():
    m = memory_breakdown(TOY, PLAN, TRAIN, gpus_per_node=4, num_nodes=2)
    parts = m.tmp_parts
    assert parts["loss_grads"] == 8 * 8 * 16  # two fp32 T x V tensors, T = 8, V = 16
    # 2U in flight + the bucket being filled: U = 100 > the largest layer tensor's 2 * 32 / sp
    assert parts["buckets"] == 2 * 100 + 100
    # largest layer unit is gate/up/down (32 params): current + prefetched, bf16, + one
    # reduce-scatter input in the reduce dtype (bf16 here)
    assert parts["gathered_params"] == 2 * (32 + 32) + 2 * 32
    # the root unit (embedding + lm_head + final norm: 132 params) gathered since the forward,
    # bf16, and lm_head's and the final norm's unsharded bf16 gradients waiting for its one
    # reduce-scatter (memory.py [Note: the root unit's memory])
    assert (parts["root_gathered"], parts["root_grads"]) == (2 * 132, 2 * (64 + 4))
    assert parts["owned_fp32_grads"] == 4 * 436 // 8
    assert parts["broadcast_staging"] == 100  # sos > sp
    assert parts["layer_grad_in"] == 8 * 2 * 4  # the gradient flowing into a layer, T e h
    # loss backward: 8 * 436 kept + 1024 + 264 = 4776; layer backward: 8 * (436 - 100) + 300
    # + 192 + 264 + 136 + 64 = 3644; optimizer step: 218 + 100
    assert m.moments == {"loss backward": {"activations": 3488, "tmp": 1024 + 264},
                         "layer backward": {"activations": 2688, "tmp": 300 + 192 + 264 + 136 + 64},
                         "optimizer step": {"activations": 0, "tmp": 318}}
    assert parts["peak_phase"] == "loss backward"
    assert (m.activations, m.tmp, m.kept_activations) == (3488, 1288, 3488)
    rec = paper_job(seq_len=8, num_micro_batches=3, bucket_bytes=100, recompute=True)
    mr = memory_breakdown(TOY, PLAN, rec, gpus_per_node=4, num_nodes=2)
    # the whole layer the recomputation gathered (152), nothing prefetched beside it (module
    # units: the next one in backward is in that layer), one reduce-scatter input of the
    # largest layer unit (gate, up, down: 32), bf16
    assert mr.tmp_parts["gathered_params"] == 2 * 152 + 2 * 32
    assert mr.tmp_parts["recomputed_layer"] == 8 * 168
    # kept 8 * (8 + 8 + 100) = 928: loss backward 928 + 1024 + 264 = 2216 < layer backward
    # 8 * 16 + 1344 + 300 + 368 + 264 + 136 + 64 = 2604
    assert mr.tmp_parts["peak_phase"] == "layer backward"
    assert (mr.activations, mr.tmp) == (128, 1344 + 300 + 368 + 264 + 136 + 64)
    # units that are whole layers: the previous layer is prefetched beside the held one, and
    # the reduce-scatter input is a whole layer's gradients
    ml = memory_breakdown(TOY, PLAN, paper_job(seq_len=8, num_micro_batches=3, bucket_bytes=100,
                                               recompute=True, granularity="layer"),
                          gpus_per_node=4, num_nodes=2)
    assert ml.tmp_parts["gathered_params"] == 2 * (152 + 152) + 2 * 152
    ddp = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), TRAIN, gpus_per_node=4,
                           num_nodes=2)
    assert ddp.tmp_parts == {"loss_grads": 1024, "recomputed_layer": 0, "buckets": 300,
                             "layer_grad_in": 64, "gathered_params": 0, "root_gathered": 0,
                             "root_grads": 0, "owned_fp32_grads": 4 * 436,
                             "broadcast_staging": 0, "peak_phase": "loss backward"}
    assert ddp.tmp == 1024  # 3488 + 1024 > 2688 + 300 + 64 > 4 * 436
    short = paper_job(seq_len=1, num_micro_batches=3, bucket_bytes=100)  # kept 436 (2 x 168 + 100)
    ddp1 = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), short, gpus_per_node=4,
                            num_nodes=2)
    assert ddp1.tmp_parts["peak_phase"] == "optimizer step"  # 4 * 436 > 436 + 128, 336 + 300 + 8
    assert (ddp1.activations, ddp1.tmp, ddp1.kept_activations) == (0, 4 * 436, 436)
    assert m.total == m.params + m.grads + m.optim + m.activations + m.tmp


def test_buffers_never_exceed_the_ranks_gradients():
    # TOY has 436 params: 872 bf16 gradient bytes per rank unsharded, 436 with sp = 2. A 128 MiB
    # bucket can never be filled, so the buffers are capped at those bytes (small-model plans).
    big = paper_job(seq_len=8, num_micro_batches=3)  # default U = 128 MiB
    ddp = memory_breakdown(TOY, parse_plan("p=1x1,g=1x1,os=1x1"), big, gpus_per_node=4, num_nodes=2)
    assert ddp.tmp_parts["buckets"] == 872  # 2U in flight + one filling, all of it the rank's 872
    m = memory_breakdown(TOY, parse_plan("p=2x1,g=2x1,os=4x2"), big, gpus_per_node=4, num_nodes=2)
    assert m.tmp_parts["buckets"] == 436 and m.tmp_parts["broadcast_staging"] == 436


def test_llama30b_layer_backward_with_recomputation_by_hand():
    """The moment the dry run found LLaMA-30B's peak at (128 x 8, seq 4096, bf16 and bf16
    reduction, 128 MiB buckets, recomputation, plan p=1x1,g=8x8,os=8x8): inside the last layer's
    down_proj backward. Engine there: 3.01 GiB of activations, 1.71 GiB of temporaries, 4.72 GiB
    together (comparisons/results/dryrun_paper-a800_2026-12-02.md)."""
    from amsp_ext.planner.model_spec import ModelSpec

    spec = ModelSpec.preset("llama-30b")
    t = paper_job(seq_len=4096, num_micro_batches=1, precision="bf16", reduce_dtype="bf16",
                     bucket_bytes=128 * 2**20, recompute=True, granularity="module")
    m = memory_breakdown(spec, parse_plan("p=1x1,g=8x8,os=8x8"), t, gpus_per_node=8, num_nodes=128)
    h, i, L, V, T = 6656, 17920, 60, 32000, 4096
    a_layer = 2 * (4 * h + 2 * h + 2 * h + 4 * i) + 8 * h + 4 * 52 + 8
    assert a_layer == 303320
    buckets = 2 * 128 * 2**20 + 2 * i * h  # 2U in flight + down_proj's bf16 gradient, larger than U
    grad_in = T * 2 * h  # the gradient flowing into the layer
    layer = m.moments["layer backward"]
    assert layer == {"activations": T * L * 2 * h, "tmp": T * a_layer + buckets + grad_in}
    assert layer["tmp"] == 1_803_911_168  # 1.68 GiB
    kept = T * (L * 2 * h + 4 * h + 2 * 2 * h + 4 + 4 * V)
    assert m.moments["loss backward"] == {"activations": kept, "tmp": 8 * T * V}
    # the two backward moments are within 1 % of each other (4.73 and 4.72 GiB); the layer's
    # wins, as it did in the engine
    assert kept + 8 * T * V < T * L * 2 * h + T * a_layer + buckets + grad_in
    assert m.tmp_parts["peak_phase"] == "layer backward"


def test_two_level_all_reduce_charged_through_the_training_spec():
    """TrainingSpec.all_reduce reaches the problem's timer; DDP's T0_os on 4 x 2 by hand."""
    import dataclasses

    from amsp_ext.planner.search import evaluate, make_problem
    from amsp_ext.planner.specs import ClusterSpec

    two = dataclasses.replace(TRAIN, all_reduce="two_level")
    problem = make_problem(TOY, ClusterSpec(num_nodes=2, gpus_per_node=4, gpu_memory_bytes=2**36), two,
                           constant_profile(4, 2, GB))
    c = evaluate(problem, parse_plan("p=1x1,g=1x1,os=1x1")).comm
    # one 100 B bucket: RS 100 B on 4x1 at 2 GB/s (50 ns) + AR of its 25 B quarter on 1x2 at
    # 4 GB/s (6.25 ns) + AG 100 B on 4x1 at 1 GB/s (100 ns); 8.72 buckets
    assert c.t0_os == pytest.approx(8.72 * 156.25e-9)
    assert cost(plan=parse_plan("p=1x1,g=1x1,os=1x1")).t0_os == pytest.approx(8.72 * 25e-9)
    with pytest.raises(ValueError, match="all_reduce must be one of flat, two_level"):
        dataclasses.replace(TRAIN, all_reduce="ring")


def test_startup_memory_by_hand():
    """[Note: start-up memory] for LLaMA-7B under ZeRO-3 on 1,024 ranks in bf16: 2 bytes of each
    local (padded) parameter + 4 of each owned master + the 32000 x 4096 embedding built whole in
    fp32 for the initializer (larger than a 4096 x 11008 MLP linear)."""
    from amsp_ext.planner.memory import startup_bytes
    from amsp_ext.planner.model_spec import load_model_spec

    spec = load_model_spec("llama-7b", None)
    plan = parse_plan("p=8x128,g=8x128,os=8x128")
    bf16 = paper_job(seq_len=4096, micro_batch_size=1, num_micro_batches=1)
    # 1,024-way shards pad each dim 0 to a multiple of 1,024 ([Note: FSDP2's padding]): gate's and
    # up's 11,008 rows take 11 per rank (11,264), the embedding's and lm_head's 32,000 take 32
    h = 4096
    padded = 32 * (2 * h + 4 * h * h + 2 * 11264 * h + h * 11008) + 2 * 32768 * h + h
    assert padded == spec.padded_params(1024) == 6_811_815_936  # Phi is 6,738,415,616
    assert startup_bytes(spec, plan, bf16) == 2 * padded // 1024 + 4 * padded // 1024 + 4 * 32000 * 4096
    m = memory_breakdown(spec, plan, bf16, gpus_per_node=8, num_nodes=128)
    assert m.startup == 564_200_984 and m.total == m.step_total > m.startup
    # fp32: the masters are the parameters; the toy (h = 4, V = 16) starts with 4 * 436 / sp
    # bytes of parameters and its 16 x 4 embedding whole in fp32 (a layer's largest linear is 32)
    fp32 = paper_job(seq_len=8, micro_batch_size=1, num_micro_batches=3, bucket_bytes=100, precision="fp32")
    assert startup_bytes(TOY, PLAN, fp32) == 4 * 436 // 2 + 4 * 64
