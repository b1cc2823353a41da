"""amsp dryrun (tools/dryrun.py): bytes against hand-computed values at 1,024 ranks,
and bad input refused in one line before any process starts."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from amsp_ext.engine_config import EngineConfig
from amsp_ext.tools.dryrun import DryRunSpec
from amsp_ext.tools.dryrun_report import bytes_per_kind, tp_bytes_per_phase

# the engine the hand counts below are worked out for (bf16 compute, fp32 reduction, one unit
# per Linear), given explicitly: the engine's defaults are fp32 and layer units
PAPER_ENGINE = EngineConfig(precision="bf16", reduce_dtype="fp32", granularity="module")

# tiny-llama by hand (common/models.py): vocab 256, hidden 64, intermediate 176, 2 layers,
# 4 heads of 16, 2 kv heads -> (rows, cols) of every parameter
_LAYER = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176), (64,), (64,)]
_SHAPES = [(256, 64)] + _LAYER * 2 + [(64,), (256, 64)]
_ROOT = [(256, 64), (64,), (256, 64)]  # embedding, final norm, lm_head: one unit (units.py)
PHI = sum(math.prod(s) for s in _SHAPES)


def _padded(world: int, shapes=_SHAPES) -> int:
    """FSDP2 pads each parameter's dim 0 to a multiple of the shard group (the gathered size)."""
    return sum(-(-s[0] // world) * world * math.prod(s[1:]) for s in shapes)


STEADY_PLANS = ("zero3", "mics:8", "p=1x1,g=1x1,os=8x1")


def _single_specs() -> dict[str, DryRunSpec]:
    """The dry runs the tests below count by hand."""
    tiny, paper_1024 = dict(model="tiny-llama", seq_len=32), dict(num_nodes=128, gpus_per_node=8)
    return {
        "zero3_1024": DryRunSpec(engine=PAPER_ENGINE, **tiny, **paper_1024, plan="zero3", steps=1, ranks=(5,)),
        "os_only_1024": DryRunSpec(engine=PAPER_ENGINE, **tiny, **paper_1024, plan="p=1x1,g=1x1,os=8x1",
                                   steps=1, ranks=(1023,)),
        "loss_peak": DryRunSpec(model="tiny-llama", num_nodes=1, gpus_per_node=4, plan="p=1x1,g=1x1,os=1x1",
                                seq_len=512, ranks=(1,)),
        "tp_1024": DryRunSpec(engine=dataclasses.replace(PAPER_ENGINE, tensor_parallel=2), **tiny, **paper_1024,
                              plan="zero3", steps=1, ranks=(5,)),
        "tp_recompute": DryRunSpec(engine=dataclasses.replace(PAPER_ENGINE, tensor_parallel=2, recompute=True),
                                   **tiny, num_nodes=1, gpus_per_node=4, plan="ddp", steps=1, ranks=(1,)),
        "recompute_peak": DryRunSpec(engine=dataclasses.replace(PAPER_ENGINE, recompute=True), model="tiny-llama",
                                     num_nodes=1, gpus_per_node=8, plan="p=4x1,g=4x1,os=8x1", seq_len=64,
                                     ranks=(0,)),
        "two_level_1024": DryRunSpec(engine=dataclasses.replace(PAPER_ENGINE, all_reduce="two_level"), **tiny,
                                     **paper_1024, plan="ddp", steps=1, ranks=(1023,)),
        "adafactor_zero3_2x2": DryRunSpec(engine=EngineConfig(), **tiny, num_nodes=2, gpus_per_node=2,
                                          plan="zero3", steps=1, ranks=(0, 1, 2, 3), optimizer="adafactor"),
        **{f"steady {plan}": DryRunSpec(engine=PAPER_ENGINE, **tiny, **paper_1024, plan=plan,
                                        num_micro_batches=2, steps=2, ranks=(0,)) for plan in STEADY_PLANS},
        **{f"mics8 {t}": DryRunSpec(engine=PAPER_ENGINE, model="tiny-llama", num_nodes=2, gpus_per_node=8,
                                    plan="mics:8", seq_len=64, ranks=(0,), tensors=t) for t in ("fake", "real")},
    }


@pytest.fixture(scope="module")
def single():
    """The dry runs of the by-hand tests in one pool of two processes (each rank process is
    mostly its interpreter's imports: one at a time, or a pool per test, left a core idle)."""
    from amsp_ext.tools.dryrun import dry_run_many

    specs = _single_specs()
    return dict(zip(specs, dry_run_many(list(specs.values()))))


def test_tiny_phi_by_hand():
    assert PHI == 125248


@pytest.mark.distributed
def test_zero3_at_1024_ranks_bytes_by_hand(single):
    r = single["zero3_1024"]
    rank = r["ranks"][0]
    got = bytes_per_kind(rank)
    n, root = _padded(1024), _padded(1024, _ROOT)
    # M = 1: every unit of the layers gathered in forward and again in backward (bf16, 2 bytes),
    # the root unit (embedding, final norm, lm_head) once: it stays gathered into the backward
    # (units.py [Note: one root unit]); one reduce-scatter per unit in the fp32 reduce dtype
    # (4 bytes); no all-reduce, no broadcast
    assert got == {"all_gather": 2 * (2 * n - root), "reduce_scatter": 4 * n, "all_reduce": 0, "broadcast": 0,
                   "all_to_all": 0}
    # one per unit and pass: 2 layers x 8 units (module granularity) twice, the root once
    kinds = [c["kind"] for c in rank["collectives"]]
    assert (kinds.count("all_gather"), kinds.count("reduce_scatter")) == (2 * 16 + 1, 16 + 1)
    assert {(c["group_size"], c["cross_node"]) for c in rank["collectives"]
            if c["kind"] != "all_reduce"} == {(1024, True)}


@pytest.mark.distributed
def test_whole_tensor_optimizer_under_zero3_bytes_by_hand(single):
    """Adafactor under zero3 on 2 x 2 ranks (fp32): each step adds two all-to-alls in the
    param_shard group (runtime/optim/whole_tensor.py). A rank sends every owned row shard's
    gradient, padded to its chunk, to its whole owner (4 bytes x padded Phi / 4), and each whole
    owner sends every rank its rows back (4 ranks x its tensors' padded chunks): summed over the
    four ranks 4 x padded Phi each way, 8 x padded Phi bytes; the planner's 2 x 4 Phi / sos per
    rank is that mean. Nothing else changes: no broadcast under zero3."""
    r = single["adafactor_zero3_2x2"]
    got = [bytes_per_kind(rank) for rank in r["ranks"]]
    n, root = _padded(4), _padded(4, _ROOT)
    assert sum(g["all_to_all"] for g in got) == 8 * n
    # fp32: the layers gathered twice, the root unit once (units.py [Note: one root unit])
    assert all(g["all_gather"] == 4 * (2 * n - root) and g["reduce_scatter"] == 4 * n and g["broadcast"] == 0
               for g in got)
    assert r["planner"]["bytes"]["all_to_all"] == 8 * n // 4  # the mean over the ranks


@pytest.mark.distributed
def test_os_only_at_1024_ranks_bytes_by_hand(single):
    r = single["os_only_1024"]
    got = bytes_per_kind(r["ranks"][0])
    # gradients all-reduced in fp32 over the 128 replicas (and an fp32 flag per tensor: grad_sync.py
    # [Note: a parameter no backward reached]), then each of 8 owners broadcasts its bf16
    # parameters in the node: this rank takes part in all 8 broadcasts (2 Phi bytes)
    assert got == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4 * (PHI + len(_SHAPES)),
                   "broadcast": 2 * PHI, "all_to_all": 0}
    assert r["world"] == 1024 and r["ranks"][0]["rank"] == 1023


@pytest.mark.distributed
def test_steady_state_categories_at_1024_ranks_by_hand(single):
    """--steps 2 measures the second step: the optimizer states made by the first step and the
    gradients kept across M = 2 micro-batches show at the peak, with hand-counted bytes."""
    plans = STEADY_PLANS
    results = [single[f"steady {plan}"] for plan in plans]
    num_tensors = len(_SHAPES)  # AdamW keeps one fp32 "step" scalar per tensor
    # rank 0's shard: zero3 pads dim 0 to 1,024 (one row of every tensor, _padded); mics:8 splits
    # every tensor evenly in 8 (all dims 0 here are multiples of 8); os=8x1 keeps whole bf16 params
    local = {"zero3": _padded(1024) // 1024, "mics:8": PHI // 8}
    for plan, r in zip(plans, results):
        rank = r["ranks"][0]
        mem, states = rank["memory"], rank["model_state_bytes"]
        assert sum(mem.values()) == rank["peak_bytes"], plan
        assert all(mem[c] > 0 for c in ("params", "grads", "optimizer", "activations", "temporary")), (plan, mem)
        if plan in local:
            n = local[plan]
            # fp32 master + m + v (12 bytes) per local element, all alive through the step
            assert mem["optimizer"] == 12 * n + 4 * num_tensors, (plan, mem)
            assert states["grads"] == 4 * n, plan  # fp32 sharded gradients, accumulated
            # the peak is inside the second micro-batch's backward: the accumulated gradients,
            # give or take the unit whose fresh gradient is being reduced into them. The loss's
            # backward and lm_head's tie for it (the head is gathered at the start of the
            # forward: runtime/sync/outside_reads.py), and at 1,024 ranks tiny-llama's shard is
            # smaller than its head: the peak may be taken in lm_head's backward, beside its
            # unsharded bf16 gradient (V x h elements)
            head = 2 * 256 * 64
            assert 0.5 * 4 * n <= mem["grads"] <= 1.5 * 4 * n + head, (plan, mem)
            assert mem["params"] >= 2 * n, (plan, mem)  # bf16 shard (+ what is gathered)
        else:
            assert mem["params"] == 2 * PHI, mem  # whole bf16 parameters, nothing gathered
            assert states["grads"] == 4 * PHI, states  # Tg at sg = 1: all fp32 grads kept
            assert mem["grads"] >= 4 * PHI, mem  # kept at the peak (plus owned ones being reduced)
            # ownership is by whole tensor: about an eighth of the elements, fp32 master + m + v
            owned = states["master"] // 4
            assert PHI / 8 <= owned <= 1.1 * PHI / 8, states
            assert states["optim_states"] - 8 * owned in range(4, 4 * num_tensors + 1, 4), states
            assert mem["optimizer"] == states["master"] + states["optim_states"], (mem, states)


@pytest.mark.slow  # ~25 s: three more rank processes; the frozen engine's path is test_forward_only's
def test_a_frozen_reference_beside_the_policy_by_hand():
    """tools/dryrun.py [Note: frozen models in a dry run]: a DPO-style job, the trained model
    and one frozen copy on the same ranks. os=8x1 (sp = 1): both models' bf16 parameters whole,
    2 x 2 x Phi bytes, and the optimizer's bytes those of the trained model alone. zero3: per
    micro-batch the frozen forward adds one all-gather per unit (root + 2 layers = 3) to the
    trained model's 5, and no reduce-scatter."""
    from amsp_ext.tools.dryrun import dry_run_many

    base = dict(engine=dataclasses.replace(PAPER_ENGINE, granularity="layer"), model="tiny-llama",
                num_nodes=1, gpus_per_node=8, seq_len=32, num_micro_batches=2, steps=2, ranks=(0,))
    alone, frozen, zero3 = dry_run_many([DryRunSpec(**base, plan="p=1x1,g=1x1,os=8x1"),
                                         DryRunSpec(**base, plan="p=1x1,g=1x1,os=8x1", frozen_models=1),
                                         DryRunSpec(**base, plan="zero3", frozen_models=1)])
    a, f = alone["ranks"][0], frozen["ranks"][0]
    assert a["memory"]["params"] == 2 * PHI and f["memory"]["params"] == 2 * 2 * PHI, (a["memory"], f["memory"])
    assert f["memory"]["optimizer"] == a["memory"]["optimizer"] and f["model_state_bytes"] == a["model_state_bytes"]
    assert frozen["planner"]["memory"]["params"] == 2 * 2 * PHI  # the planner charges the same
    kinds = {}
    for c in zero3["ranks"][0]["collectives"]:
        if c["group"] == "param_shard":
            kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    assert kinds == {"all_gather": 2 * (5 + 3), "reduce_scatter": 2 * 3}, kinds
    assert zero3["planner"]["collectives"]["planner"] == kinds


def test_peak_in_the_loss_backward_holds_the_losss_two_fp32_gradients(single):
    """tiny-llama (V = 256) at seq 512, fp32, DDP on 1 x 4, M = 1: the engine's peak is in the
    loss's backward, where the temporaries are the NLL's and the log-softmax backward's fp32
    T x V gradients, 8 * 512 * 256 bytes (planner/memory.py [Note: the loss's gradients]; the
    64 bytes over are scalars)."""
    r = single["loss_peak"]
    rank = r["ranks"][0]
    assert rank["peak_moment"] == "loss backward"
    assert 8 * 512 * 256 <= rank["memory"]["temporary"] <= 8 * 512 * 256 + 256
    assert r["planner"]["moments"]["loss backward"]["temporary"] == 8 * 512 * 256


# one TP rank's shard of tiny-llama at T = 2 (runtime/tensor_parallel.py parallelize_llama):
# q/k/v, gate/up split by rows, o and down by columns; norms, embedding and lm_head whole
_TP2_LAYER = [(32, 64), (16, 64), (16, 64), (64, 32), (88, 64), (88, 64), (64, 88), (64,), (64,)]
_TP2_SHAPES = [(256, 64)] + _TP2_LAYER * 2 + [(64,), (256, 64)]


@pytest.mark.distributed
def test_tensor_parallel_at_1024_ranks_tp_and_amsp_traffic_by_hand(single):
    """128 nodes x 8 as TP 2 x data-parallel 512, zero3: the TP log holds 2 all-reduces per layer
    in forward and 2 in backward, each of b x s x h bf16 bytes (Megatron's count, which the
    planner prices); AMSP's collectives run on the 512 data-parallel ranks of this rank's TP
    coordinate and move its TP shard: FSDP2 pads each shard's dim 0 to a multiple of 512."""
    r = single["tp_1024"]
    rank, tp = r["ranks"][0], r["planner"]["tensor_parallel"]
    act = 1 * 32 * 64 * 2  # micro-batch 1 x seq 32 x hidden 64 x bf16
    assert [(c["phase"], c["bytes"]) for c in rank["tp_collectives"]] == [("forward", act)] * 4 + [("backward", act)] * 4
    assert tp_bytes_per_phase(rank) == {"forward": 4 * act, "backward": 4 * act, "optimizer": 0}
    assert tp["step_bytes"] == {"forward": 4 * act, "backward": 4 * act} and tp["activation_allreduce_bytes"] == act
    n = sum(-(-s[0] // 512) * 512 * math.prod(s[1:]) for s in _TP2_SHAPES)
    root = _padded(512, _ROOT)  # kept whole on every TP rank; gathered once (units.py [Note: one root unit])
    assert bytes_per_kind(rank) == {"all_gather": 2 * (2 * n - root), "reduce_scatter": 4 * n, "all_reduce": 0,
                                    "broadcast": 0, "all_to_all": 0}
    assert {c["group_size"] for c in rank["collectives"] if c["group"] == "param_shard"} == {512}
    assert rank["model_state_bytes"]["master"] == 4 * n // 512  # fp32 masters of this rank's rows
    # start-up: lm_head (the last module) built whole in fp32, beside every rank's bf16 rows and
    # fp32 masters, each tensor's dim 0 padded to one row of 512. Neither the previous module's
    # fp32 initialisation (materialize.fill) nor DTensor's global-shape shape-propagation
    # tensors (fake ones, in a dry run) are counted: with them it was 98,304 bytes.
    rows = sum(math.prod(s[1:]) for s in _TP2_SHAPES)
    assert 4 * 256 * 64 + 6 * rows <= rank["startup_peak_bytes"] <= 1.01 * (4 * 256 * 64 + 6 * rows)


@pytest.mark.distributed
def test_tensor_parallel_with_recompute_reruns_one_all_reduce_per_layer(single):
    """With activation checkpointing the backward re-runs each layer's forward only until the
    tensors its backward needs are back (torch's early stop): the attention's all-reduce again,
    not the MLP's, so 3 per layer in backward, as the planner prices it (tensor_parallel.py)."""
    r = single["tp_recompute"]
    act = 1 * 32 * 64 * 2
    assert tp_bytes_per_phase(r["ranks"][0]) == {"forward": 4 * act, "backward": 6 * act, "optimizer": 0}
    assert r["planner"]["tensor_parallel"]["step_bytes"] == {"forward": 4 * act, "backward": 6 * act}


@pytest.mark.distributed
def test_recompute_peak_files_the_gathered_layer_as_temporary(single):
    """With recomputation and sp = 4 the peak is in a layer's backward, beside the layer FSDP2
    gathered for the recomputation. MemTracker would file those parameters as activations (a
    forward gathered them) or parameters; the dry run files them as temporaries, as the planner
    counts them (dryrun.py [Note: categories at the peak]). So the parameters at the peak are
    exactly the bf16 shard, and the activations are less than one gathered layer. Start-up
    holds one module's fp32 initialisation at a time (the planner's start-up, within 1 %)."""
    r = single["recompute_peak"]
    rank, layer = r["ranks"][0], sum(math.prod(s) for s in _LAYER)
    assert rank["peak_moment"] == r["planner"]["peak_moment"] == "layer backward"
    assert rank["memory"]["params"] == 2 * PHI // 4 == r["planner"]["memory"]["params"]
    assert rank["memory"]["activations"] < 2 * layer <= rank["memory"]["temporary"]
    start = r["planner"]["memory"]["startup"]
    assert start <= rank["startup_peak_bytes"] <= 1.01 * start


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "2", "--gpus-per-node", "8", "--plan", "zero3", "--tensor-parallel", "3"], "tensor_parallel"),
    (["--nodes", "2", "--gpus-per-node", "8", "--plan", "zero3", "--tensor-parallel", "8"],
     "num_attention_heads=4 (allowed here: 1, 2)"),
    (["--nodes", "3", "--gpus-per-node", "8", "--plan", "mics:16"], "num_nodes=3"),
    (["--nodes", "2", "--gpus-per-node", "8", "--plan", "p=3x1,g=1x1,os=1x1"], "p"),
    (["--nodes", "2", "--gpus-per-node", "8", "--plan", "zero3", "--ranks", "16"], "--ranks"),
    (["--nodes", "2", "--gpus-per-node", "8", "--plan", "zero3", "--model", "llama-99b"], "model"),
])
def test_bad_input_one_line_before_any_process(args, needle):
    base = ["--model", "tiny-llama", "--seq-len", "32"]
    if "--model" in args:
        base = ["--seq-len", "32"]
    p = subprocess.run([sys.executable, "-m", "amsp_ext.cli.main", "dryrun", *base, *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "rank" not in p.stdout


def test_device_cuda_without_a_gpu_is_one_line_naming_the_choices():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "-m", "amsp_ext.cli.main", "dryrun", "--model", "tiny-llama",
                        "--seq-len", "32", "--nodes", "1", "--gpus-per-node", "8", "--plan", "zero3",
                        "--tensors", "real", "--device", "cuda"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "device 'cuda'" in lines[0] and "cpu, cuda" in lines[0], p.stderr


@pytest.mark.distributed
def test_real_tensors_count_what_the_fake_run_counts(single):
    """[Note: real tensors on a GPU], on the CPU: rank 0 of 2 x 8 under MiCS-8 with allocated
    tensors (the model initialised, every op computed) records the same peak, categories,
    model-state bytes and collectives as the run on tensors without storage, and takes the
    ordinary path: the fake backend fills its outputs, so no step is skipped."""
    fake, real = single["mics8 fake"], single["mics8 real"]
    f, r = fake["ranks"][0], real["ranks"][0]
    assert "real" not in f and real["tensors"] == "real"
    assert r["real"]["fake_fills_outputs"] is True and r["real"]["steps_skipped"] == 0
    assert len(r["real"]["step_s"]) == 2 and r["real"]["untracked_step_s"] > 0
    assert r["peak_bytes"] == f["peak_bytes"] > 0
    assert r["memory"] == f["memory"] and r["peak_moment"] == f["peak_moment"]
    assert r["model_state_bytes"] == f["model_state_bytes"]
    assert f["collectives"] and _per_phase(r["collectives"]) == _per_phase(f["collectives"])


def _per_phase(records):
    import collections

    return collections.Counter((c["kind"], c["group"], c["group_size"], c["cross_node"], c["bytes"],
                                c["phase"]) for c in records)


@pytest.mark.distributed
def test_equivalent_to_a_real_4_rank_run(tmp_path):
    """The dry run's collective log of one step (kind, group, size, cross-node, bytes, count per
    phase) and model-state bytes equal a real gloo run's, rank 0 of 2 x 2, for four plans: one
    real launch runs all four, the four dry runs share one pool of two processes."""
    import json

    from amsp_ext.tools.dryrun import dry_run_many
    from tests.dist_utils import run_ranks
    from tests.dryrun_real_worker import PLANS

    out = tmp_path / "real.json"
    run_ranks(4, "tests.dryrun_real_worker", str(out), timeout=300)
    real = json.loads(out.read_text())
    dries = dry_run_many([DryRunSpec(engine=PAPER_ENGINE, model="tiny-llama", num_nodes=2, gpus_per_node=2,
                                     plan=plan, seq_len=32, steps=1, ranks=(0,)) for plan in PLANS])
    for plan, result in zip(PLANS, dries):
        dry = result["ranks"][0]
        assert dry["collectives"], plan  # a log that recorded nothing would match an empty trace
        assert _per_phase(dry["collectives"]) == _per_phase(real[plan]["collectives"]), plan
        assert dry["model_state_bytes"] == real[plan]["model_state_bytes"], plan
        assert all(dry["model_state_bytes"][k] > 0 for k in ("params", "grads", "master", "optim_states")), plan


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s: the dry run's memory count reaches the default tier through test_equivalent_to_a_real_4_rank_run
def test_plan_verify_drops_a_candidate_that_does_not_fit_by_the_engine(capsys):
    """amsp plan --verify K: first every fitting candidate is verified at a roomy GPU (all fit);
    then the GPU memory is set between the model's and the engine's count of one whose engine
    peak is above the model's, so the model says it fits and the engine says not: it is dropped.
    M = 2, so that the gradients the model charges (4 Phi/sg) are held at the peak; at M = 1 the
    model overcounts every candidate by them on purpose ([Note: gradients at M = 1]). Measured
    (tiny-llama 1 x 4, seq 32, --verify 9): engine/model 0.99-1.04 on eight candidates, 1.14 for
    ZeRO-3; the first candidate, DDP, 2,988,965 against 2,937,216 bytes."""
    import json

    from amsp_ext.cli.main import main

    args = ["plan", "--model", "tiny-llama", "--nodes", "1", "--gpus-per-node", "4", "--memory-reserve", "0B",
            "--seq-len", "32", "--micro-batches", "2", "--profile", "paper-a800", "--precision", "bf16",
            "--reduce-dtype", "fp32", "--granularity", "module", "--json"]
    assert main([*args, "--gpu-memory", "64MiB", "--verify", "2"]) == 0
    roomy = json.loads(capsys.readouterr().out)["verify"]
    assert len(roomy) > 1 and all(v["fits"] for v in roomy)
    under = [v for v in roomy if v["engine_peak_bytes"] > v["planner_bytes"]]
    assert under, roomy  # the premise: the model undercounts at least one candidate
    victim = under[0]
    squeeze = (victim["engine_peak_bytes"] + victim["planner_bytes"]) // 2
    k = next(i for i, v in enumerate(roomy) if v is victim) + 3
    rc = main([*args, "--gpu-memory", f"{squeeze}B", "--verify", str(k)])
    text = capsys.readouterr()
    if rc != 0:  # nothing fits by the engine: one line saying so, naming the victim
        assert len(text.err.strip().splitlines()) == 1 and victim["plan"] in text.err, text.err
        return
    out = json.loads(text.out)
    got = {v["plan"]: v for v in out["verify"]}
    assert not got[victim["plan"]]["fits"]  # fits by the model, not by the engine: dropped
    assert got[victim["plan"]]["engine_peak_bytes"] == victim["engine_peak_bytes"]
    assert all(v["fits"] == (v["engine_peak_bytes"] <= squeeze) for v in out["verify"])
    assert out["plan_text"] == next(v["plan"] for v in out["verify"] if v["fits"]) != victim["plan"]


@pytest.mark.distributed
def test_two_level_all_reduce_at_1024_ranks_bytes_by_hand(single):
    """DDP's plan on 128 x 8 with all_reduce="two_level" (collectives.py [Note: two-level
    all-reduce]): tiny-llama's one fp32 bucket (PHI elements, a multiple of 8: no padding) is
    summed in the node (8 ranks), its eighth across the 128 nodes, and gathered back in the
    node; only the middle phase crosses nodes."""
    from amsp_ext.planner.profile import CommTimer, load_profile

    r = single["two_level_1024"]
    got = {}
    for c in r["ranks"][0]["collectives"]:
        key = (c["group"], c["kind"], c["group_size"], c["cross_node"])
        got[key] = got.get(key, 0) + c["bytes"]
    # the bucket carries an fp32 flag per tensor (grad_sync.py [Note: a parameter no backward
    # reached]), padded to split over the node's 8 ranks
    bucket = -(-(PHI + len(_SHAPES)) // 8) * 8
    assert got == {("param_replica_local", "all_reduce", 8, False): 4 * bucket,
                   ("param_replica_node", "all_reduce", 128, True): 4 * bucket // 8,
                   ("param_replica_local", "all_gather", 8, False): 4 * bucket}
    # and no all-reduce of the clip norm's sum of squares: every rank holds every gradient
    # (optim/nonfinite.py [Note: one decision, on the norm all-reduce])
    # the planner charges the same three collectives over 2v + v/8 bytes
    timer = CommTimer(load_profile("paper-a800"), 8, all_reduce="two_level")
    assert timer.issued("allreduce", 4 * PHI, 8, 128) == (3, 4 * PHI * (2 + 1 / 8))
