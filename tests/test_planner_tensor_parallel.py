"""Tensor parallelism in the planner (planner/tensor_parallel.py, planner/joint.py): the TP
shard, its all-reduces counted and timed by hand, the batch cap that makes ``auto`` pick T > 1,
bad degrees as one line, and T = 1 leaving the paper's plan as it was."""

import json

import pytest

from amsp_ext.cli.main import main
from amsp_ext.planner.memory import activation_bytes, memory_breakdown
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import parse_plan
from amsp_ext.planner.profile import BandwidthProfile, CommTimer
from amsp_ext.planner.search import evaluate, make_problem, search
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
from amsp_ext.planner.tensor_parallel import TensorParallelError, parse_tensor_parallel, tp_comm
from tests.planner_helpers import constant_profile

# h=8, i=16, 2 layers, 4 heads of dim 2, 2 KV heads, vocabulary 16, untied.
# Whole layer: norms 16, q 64, k 32, v 32, o 64, gate 128, up 128, down 128 = 592.
# One TP-2 rank: norms 16 (replicated), q 32, k 16, v 16, o 32, gate 64, up 64, down 64 = 304;
# outside, whole on every TP rank (the engine's layout): embedding 16*8 = 128, final norm 8,
# lm_head 128 = 264.
TOY = ModelSpec(name="toy", hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=2, vocab_size=16)
TOY_TP2_PHI = 2 * 304 + 264
GiB = 2**30


def two_meshes_profile():
    """All-reduce on 2x1 at 100 GB/s and on 8x1 at 50 GB/s, any size: t = v / w."""
    entries = [{"op": "allreduce", "p0": p0, "p1": 1,
                "points": [{"bytes": 1, "GBps": w}, {"bytes": 2**40, "GBps": w}]}
               for p0, w in ((2, 100.0), (8, 50.0))]
    return BandwidthProfile.from_dict({"schema": "amsp-profile/1", "name": "two",
                                       "metadata": {"concurrency": "all_groups"}, "entries": entries})


@pytest.mark.parametrize("degree,gbps", [(2, 100.0), (8, 50.0)])
def test_one_layer_tp_traffic_by_hand(degree, gbps):
    """Megatron without sequence parallelism: 2 all-reduces of s*h*2 B (bf16) per layer in
    forward and 2 in backward, on the T x 1 mesh; micro-batch 1."""
    s, h = 2048, 4096
    spec = ModelSpec(name="llama-like", hidden_size=h, intermediate_size=11008, num_layers=32,
                     num_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000)
    tr = TrainingSpec(seq_len=s, num_micro_batches=1, precision="bf16")
    tp = tp_comm(spec, tr, CommTimer(two_meshes_profile(), 8), degree)
    one = s * h * 2  # 16 MiB
    assert tp.activation_bytes == one == 16 * 2**20
    assert tp.layer_bytes == 4 * one
    assert tp.layer_s == pytest.approx(4 * one / (gbps * 1e9), rel=1e-12)
    # recomputation re-runs each layer's forward in backward: 2 more
    rc = tp_comm(spec, TrainingSpec(seq_len=s, num_micro_batches=1, precision="bf16", recompute=True),
                 CommTimer(two_meshes_profile(), 8), degree)
    # recompute: the attention's all-reduce once more (checkpoint's early stop skips the MLP's)
    assert rc.layer_bytes == 5 * one and rc.layer_s == pytest.approx(5 * one / (gbps * 1e9), rel=1e-12)


def test_tp_shard_memory_by_hand():
    cl = ClusterSpec(num_nodes=1, gpus_per_node=4, gpu_memory_bytes=80 * GiB)
    tr = TrainingSpec(seq_len=16, num_micro_batches=1, precision="bf16")
    prob = make_problem(TOY, cl, tr, constant_profile(4, 1, dict.fromkeys(
        ("allreduce", "allgather", "reducescatter", "broadcast"), 10.0)), tensor_parallel=2)
    assert prob.spec.num_params == TOY_TP2_PHI and prob.model is TOY
    assert prob.cluster.gpus_per_node == 2 and prob.node_gpus == 4  # AMSP's world: 2 x 1
    mem = memory_breakdown(prob.spec, parse_plan("p=2x1,g=2x1,os=2x1"), tr, gpus_per_node=2, num_nodes=1)
    assert mem.params == 2 * TOY_TP2_PHI // 2
    # per token and layer, bf16 (e = 2), h=8, q=8, kv=4, i=16, a=4:
    # replicated e*4h + 8h + 8 = 136; split (e(2q + 2kv + 4i) + 4a) / 2 = (176 + 16) / 2 = 96
    # outside, the logits whole: 4h + 2eh + 4 + 4V = 32 + 32 + 4 + 64 = 132
    assert activation_bytes(prob.spec, tr) == 16 * (2 * (136 + 96) + 132)


@pytest.mark.parametrize("granularity,tied", [("layer", False), ("module", False), ("module", True)])
def test_tp_on_the_critical_path_of_a_world_without_amsp_traffic(granularity, tied):
    """2 GPUs, TP 2: one data-parallel rank, so no AMSP collective; the step is compute + TP
    all-reduces + optimizer, and the TP time is 4L all-reduces of s*h*2 B (none outside the
    layers: embedding, lm_head and loss are whole on every TP rank)."""
    from dataclasses import replace

    s, W = 64, 10.0
    cl = ClusterSpec(num_nodes=1, gpus_per_node=2, gpu_memory_bytes=80 * GiB)
    tr = TrainingSpec(seq_len=s, num_micro_batches=3, precision="bf16", granularity=granularity)
    prof = constant_profile(2, 1, dict.fromkeys(("allreduce", "allgather", "reducescatter", "broadcast"), W))
    model = replace(TOY, tie_word_embeddings=tied)
    prob = make_problem(model, cl, tr, prof, objective="step", tensor_parallel=2)
    c = evaluate(prob, search(prob).best.plan, with_step=True)
    per_mb = 4 * TOY.num_layers * s * 8 * 2 / (W * 1e9)
    assert c.comm.t_tp == pytest.approx(3 * per_mb, rel=1e-12)
    assert c.comm.total == pytest.approx(c.comm.t_tp, rel=1e-12)
    st = c.step
    assert st.tp_comm_s == pytest.approx(3 * per_mb, rel=1e-12)
    assert st.step_s == pytest.approx(st.compute_s + st.tp_comm_s + st.optimizer_s, rel=1e-9)
    assert st.exposed_comm_s == pytest.approx(0, abs=1e-12)


BATCH = ["plan", "--model", "llama-7b", "--nodes", "4", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
         "--profile", "paper-a800", "--seq-len", "2048", "--micro-batches", "1", "--precision", "bf16",
         "--recompute", "--json"]


def test_a_batch_cap_pure_dp_exceeds_makes_auto_pick_tp(capsys):
    # pure data parallelism: 32 ranks x 1 micro-batch x 2048 = 65,536 tokens, over the cap
    assert main(BATCH + ["--tensor-parallel", "auto", "--max-global-batch-tokens", "32768"]) == 0
    d = json.loads(capsys.readouterr().out)
    t = d["plan"]["tensor_parallel"]
    assert t in (2, 4, 8)
    assert d["tensor_parallel"]["global_batch_tokens"] == 32 // t * 2048 <= 32768
    assert d["memory_bytes"]["total"] <= d["memory_bytes"]["limit"]
    opts = {o["tensor_parallel"]: o for o in d["tensor_parallel_choice"]["options"]}
    assert opts[1]["global_batch_tokens"] == 65536
    assert "exceeds --max-global-batch-tokens 32768" in opts[1]["reason"]
    assert d["step"]["tp_comm_s"] > 0 and d["t_comm_s"]["t_tp"] > 0


def test_a_fixed_batch_too_small_for_pure_dp_goes_to_tp(capsys):
    """16 sequences cannot feed 32 data-parallel ranks; TP 2 (16 ranks) and up can."""
    argv = [a for a in BATCH if a not in ("--micro-batches", "1")] + ["--global-batch-size", "16"]
    assert main(argv + ["--tensor-parallel", "auto"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["tensor_parallel"] >= 2
    reason = d["tensor_parallel_choice"]["options"][0]["reason"]
    assert d["tensor_parallel_choice"]["options"][0]["tensor_parallel"] == 1 and "multiple of" in reason


def test_text_output_shows_the_tp_share(capsys):
    argv = [a for a in BATCH if a != "--json"] + ["--tensor-parallel", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TP 2 inside the node" in out and "data-parallel world 4 x 4" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  TP "))
    assert "80.0 MiB of all-reduces per layer" in line  # 5 x 2048 x 4096 x 2 B (16 MiB), recompute
    assert "of the step) beside AMSP's" in line


@pytest.mark.parametrize("argv,words", [
    (["--gpus-per-node", "4", "--tensor-parallel", "8"],
     "tensor_parallel=8 must divide gpus_per_node=4 (allowed here: 1, 2, 4)"),
    (["--model", "llama-30b", "--tensor-parallel", "8"],
     "tensor_parallel=8 must divide the model llama-30b's num_attention_heads=52 (allowed here: 1, 2, 4)"),
    (["--model-config", "KV2", "--tensor-parallel", "4"],
     "tensor_parallel=4 must divide the model kv2's num_key_value_heads=2 (allowed here: 1, 2)"),
    (["--model-config", "NOHEADS", "--tensor-parallel", "2"], "config.json has no 'num_attention_heads'"),
    (["--tensor-parallel", "1", "--max-global-batch-tokens", "4096"],
     "no --tensor-parallel degree fits (--tensor-parallel auto tries every degree): T=1: global batch "
     "of 65536 tokens exceeds --max-global-batch-tokens 4096"),
    (["--tensor-parallel", "2", "--verify", "1"], "--verify dry-runs the plan without tensor parallelism"),
])
def test_bad_tp_input_is_one_line(capsys, tmp_path, argv, words):
    configs = {"KV2": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 64},
               "NOHEADS": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "vocab_size": 64}}
    argv = list(argv)
    for i, a in enumerate(argv):
        if a in configs:
            folder = tmp_path / a.lower()
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(configs[a]))
            argv[i] = str(folder / "config.json")
    base = list(BATCH)
    for flag in ("--gpus-per-node", "--model"):
        if flag in argv or (flag == "--model" and "--model-config" in argv):
            i = base.index(flag)
            del base[i:i + 2]
    rc = main(base + argv)
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("amsp plan: error: "), err
    assert words in err, err


def test_parse_tensor_parallel_is_one_line():
    assert parse_tensor_parallel("auto") is None and parse_tensor_parallel("4") == 4
    with pytest.raises(TensorParallelError, match=r"^--tensor-parallel must be one of 1, 2, 4, 8 or auto, "
                                                  r"got '3'$"):
        parse_tensor_parallel("3")


def test_tp_1_keeps_table_iv_plan(capsys):
    """--tensor-parallel 1 gives the paper's Table IV plan for LLaMA-7B (the hand-known pick of
    tests/test_planner_table_iv.py), with no TP term anywhere."""
    from tests.test_planner_table_iv import SETTINGS

    assert main(["plan", "--model", "llama-7b", *SETTINGS, "--tensor-parallel", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan_text"] == "p=1x1,g=1x1,os=8x1" and d["plan"]["tensor_parallel"] == 1
    assert "tensor_parallel" not in d and "tensor_parallel_choice" not in d
    assert d["t_comm_s"]["t_tp"] == 0.0 and d["step"]["tp_comm_s"] == 0.0
    t = d["t_comm_s"]
    assert t["total"] == t["t_p"] + t["t_g"] + t["t0_os"] + t["t1_os"]


def test_plan_auto_under_tp_plans_the_data_parallel_world():
    """What an engine run with TP T asks of plan "auto": factors over (R/T) x N."""
    from amsp_ext.planner.auto import AutoPlanConfig, auto_problem, resolve_auto
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

    auto = AutoPlanConfig(seq_len=2048, profile="paper-a800")
    training = TrainingSpec(seq_len=2048, precision="bf16", bucket_bytes=25 * 2**20, granularity="layer",
                            recompute=True)
    cluster = ClusterSpec(num_nodes=2, gpus_per_node=8, gpu_memory_bytes=80 * GiB)
    prob = auto_problem("llama-7b", auto, training, cluster, tensor_parallel=4)
    assert (prob.cluster.gpus_per_node, prob.node_gpus, prob.tensor_parallel) == (2, 8, 4)
    planned = resolve_auto("llama-7b", auto, training, cluster, all_reduce="auto", tensor_parallel=4)
    assert all(2 % s0 == 0 for s0 in (planned.plan.s0_p, planned.plan.s0_g, planned.plan.s0_os))


@pytest.mark.parametrize("t2_seconds,chosen", [(1.995, 1), (1.90, 2)])
def test_joint_choice_is_per_token_with_ties_to_the_smaller_degree(t2_seconds, chosen):
    """T=1: 4 s per 4M tokens (1.0 us/token). T=2: 2M tokens in 1.995 s (0.9975 us, within the
    1% tie: T=1 kept) or 1.90 s (0.95 us: T=2). T=4 fits nowhere, T=8 is over the cap."""
    from types import SimpleNamespace

    from amsp_ext.planner.joint import search_tensor_parallel
    from amsp_ext.planner.search import NoFeasiblePlan

    tokens = {1: 4 * 2**20, 2: 2 * 2**20, 4: 2**20, 8: 8 * 2**20}
    seconds = {1: 4.0, 2: t2_seconds}

    def problem_for(t):
        return SimpleNamespace(global_batch_tokens=tokens[t], tie_tolerance=0.01)

    def search_for(t):
        if t == 4:
            raise NoFeasiblePlan("no plan fits")
        best = SimpleNamespace(plan=f"plan{t}")
        return SimpleNamespace(best=best, objective=lambda c, t=t: seconds[t], problem=problem_for(t)), t

    result, extra, choice = search_tensor_parallel((1, 2, 4, 8), problem_for, search_for,
                                                   max_global_batch_tokens=4 * 2**20)
    assert choice.degree == extra == chosen and result.best.plan == f"plan{chosen}"
    reasons = {o.degree: o.reason for o in choice.options}
    assert reasons[1] == reasons[2] == "" and reasons[4] == "no plan fits"
    assert reasons[8] == "global batch of 8388608 tokens exceeds --max-global-batch-tokens 4194304"


def test_padded_shard_of_a_tp_shard_by_hand():
    """FSDP2 pads each tensor's dim 0 to a multiple of sp (memory.py [Note: FSDP2's padding]).
    LLaMA-65B's TP 8 shard at sp = 1,024: q/k/v 1,024 rows, o/down/norms 8,192: exact; gate/up
    2,752 rows take 3 per rank (3,072); embedding/lm_head 32,000 rows take 32 (32,768). The dry
    run of TP 8 + ZeRO-3 at 8,192 ranks measured params and optimizer 5.0 % over Phi/sp."""
    from amsp_ext.planner.specs import paper_job
    from amsp_ext.planner.tensor_parallel import tp_shard_spec

    s = tp_shard_spec(ModelSpec.preset("llama-65b"), 8)
    h = 8192
    layer = 2 * h + 3 * 1024 * h + h * 1024 + 2 * 3072 * h + h * 2752
    padded = 80 * layer + 2 * 32768 * h + h
    assert s.padded_params(1024) == padded
    assert 1.050 < padded / s.num_params < 1.051
    assert s.padded_params(8) == s.num_params  # every dim 0 divides 8
    t = paper_job(seq_len=4096, num_micro_batches=1, precision="bf16", reduce_dtype="bf16")
    m = memory_breakdown(s, parse_plan("p=1x1024,g=1x1024,os=1x1024"), t, gpus_per_node=1, num_nodes=1024)
    assert (m.params, m.optim) == (2 * padded // 1024, 12 * padded // 1024)
