"""Tensor parallelism inside the node with AMSP over the data-parallel ranks (issue 38, item 1).

tiny-llama on 4 gloo ranks as T = 2 (the standard Llama layout, runtime/tensor_parallel.py) x
data-parallel 2, under ddp, zero3, ``p=1x1,g=1x1,os=2x1`` (= zero1 there) and zero2, and zero3 with activation checkpointing: two steps with gradient clipping
at 0.1 (below the gradient norm, so every step clips and a norm counted wrong on either mesh
dimension changes the weights). Per step the loss and the clip norm, and after the last step
the gathered full weights, must equal a plain single-process run on the same global batch
(tests/parity_check.reference: the whole model, AdamW, torch's own clip_grad_norm_) within
1e-5 (fp32). One launch for the three plans (the worker frees each plan's groups).
"""

from __future__ import annotations

import re

import pytest
import torch

from amsp_ext.common.models import build_llama
from dist_utils import run_ranks
from parity_check import reference

pytestmark = pytest.mark.distributed

PLANS = ("ddp", "zero3", "p=1x1,g=1x1,os=2x1", "zero2", "zero3+recompute")  # +recompute: ShardConfig.recompute
STEPS, CLIP = 2, 0.1


META = ("zero3+meta", "p=1x1,g=1x1,os=2x1+meta", "zero3+init")  # built on meta: seeded, from files


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    files = out / "seed1"  # what init_from reads: a Hugging Face folder of other weights (seed 1)
    build_llama("tiny-llama", seed=1).save_pretrained(files, safe_serialization=True)
    cases = (*PLANS, "ddp+nan", *META, "ddp+t1+meta", "guards")
    run_ranks(4, "tests.tp_worker", "2", str(out), str(STEPS), str(CLIP), ";".join(cases), timeout=300,
              env={"TP_WORKER_INIT_FROM": str(files)})
    return {**{plan: torch.load(out / (re.sub(r"[^A-Za-z0-9_.=-]", "_", plan) + ".pt"), weights_only=True)
               for plan in cases}, "files": files}


def check_against_reference(got, plan, world=2, initial=None):
    ref = reference(world, clip=CLIP, num_steps=STEPS, initial=initial)  # the data-parallel world's batches
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (plan, got["losses"], ref["losses"])
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert b > CLIP and abs(a - b) <= 1e-5 * abs(b), (plan, got["norms"], ref["norms"])
    final = ref["steps"][-1]
    assert set(final) <= set(got["weights"])
    worst = max(float((got["weights"][n] - final[n]).abs().max()) for n in final)
    assert worst <= 1e-5, (plan, worst)


@pytest.mark.parametrize("plan", PLANS)
def test_tp2_matches_single_process(tp_runs, plan):
    check_against_reference(tp_runs[plan], plan)


@pytest.mark.parametrize("case", META)
def test_tp2_model_on_meta_starts_with_the_t1_weights(tp_runs, case, tmp_path):
    """A model built on meta and made TP there: shard() fills each rank's block (rows of a
    colwise weight, columns of a rowwise one, FSDP2's block of those under zero3) from the seed,
    or reads it from a safetensors folder; the gathered weights right after shard() are the bits
    the same seed gives without TP (a 4-rank T = 1 run), or the files' tensors, and two steps
    from them equal the single-process run started from those weights."""
    from safetensors.torch import load_file, save_file

    if case.endswith("+init"):
        want = load_file(str(tp_runs["files"] / "model.safetensors"))
    else:
        want = tp_runs["ddp+t1+meta"]["initial"]
    got = tp_runs[case]["initial"]
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, (case, differ[:4])
    save_file({n: t.contiguous() for n, t in want.items()}, str(tmp_path / "initial.safetensors"))
    check_against_reference(tp_runs[case], case, initial=str(tmp_path / "initial.safetensors"))


@pytest.mark.slow  # inductor's cold compile (~1 min); the eager TP path: test_tp2_matches_single_process
def test_tp2_with_compiled_blocks(tmp_path):
    """torchtitan's order under TP: TP, then ``block.compile()`` per decoder block, then shard
    (ddp): the same losses, norms and weights as the single-process run, and no graph break."""
    run_ranks(4, "tests.tp_worker", "2", str(tmp_path), str(STEPS), str(CLIP), "ddp+compile", timeout=900)
    got = torch.load(tmp_path / "ddp_compile.pt", weights_only=True)
    check_against_reference(got, "ddp+compile")
    assert got["graph_breaks"] == 0


def test_tp_nonfinite_loss_on_one_tp_rank_skips_the_step_everywhere(tp_runs):
    """Rank 1 (TP coordinate 1 of data-parallel rank 0) alone gets a NaN loss at step 0: the
    verdict rides on the norm's all-reduce over both dimensions, so all 4 ranks skip that step
    (optim/nonfinite.py [Note: one decision, on the norm all-reduce]) and apply the next."""
    got = tp_runs["ddp+nan"]
    assert got["skipped"] == [1, 1, 1, 1], got["skipped"]
    assert got["norms"][0] != got["norms"][0] and got["norms"][1] > 0, got["norms"]  # NaN, then finite


@pytest.mark.parametrize("case,want", [
    ("T does not divide the node", "config.tensor_parallel=3 must divide the GPUs per node (4); allowed: 1, 2, 4"),
    ("T without a TP model", "config.tensor_parallel=2 but the model has no tensor-parallel (DTensor) parameter"),
    ("TP model without T", "set ShardConfig(tensor_parallel=T)"),
])
def test_tp_bad_input_is_one_line(tp_runs, case, want):
    msg = tp_runs["guards"][case]
    assert want in msg and "\n" not in msg, msg


def test_llama_layout_checks():
    """parallelize_llama refuses, before touching the model, a T that does not divide the heads
    (tiny-llama: 4 heads, 2 key/value heads) and a model without a Llama layout."""
    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime.tensor_parallel import check_llama_layout

    with pytest.raises(ValueError, match=r"tensor_parallel=4 must divide the model's num_key_value_heads \(2\)"):
        check_llama_layout(build_llama("tiny-llama"), 4)
    with pytest.raises(ValueError, match="has no tensor-parallel layout"):
        check_llama_layout(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
    assert len(check_llama_layout(build_llama("tiny-llama"), 2)) == 2


def _amsp_train(*args) -> dict:
    """``amsp train --json ARGS`` as a user runs it (the launcher, not forked ranks): its summary."""
    import json
    import os
    import subprocess
    import sys

    from dist_utils import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "amsp_ext.cli", "train", "--json", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # four `amsp train` launches (~2 min on 2 cores); the engine path: test_tp2_matches_single_process
def test_amsp_train_tensor_parallel_matches_ddp_and_checkpoints_load_across_t(tmp_path):
    """``amsp train --nproc-per-node 4 --tensor-parallel 2 --plan zero3`` (TP 2 x FSDP2 over the
    data-parallel 2) gives the per-step losses of ``--nproc-per-node 2 --plan ddp``: the same
    global batch, read by data-parallel rank (clipping at 1.0 on, as by default). Checkpoints
    after step 2 load across T both ways: the TP one resumed without TP (2 ranks, zero2) and the
    DDP one resumed under TP 2 (4 ranks, zero3) give the uninterrupted run's losses for steps 3
    and 4 (step 4's depends on the restored AdamW states)."""
    def train(*args):
        return _amsp_train("--steps", "4", *args)

    ck_tp, ck_ddp = tmp_path / "tp", tmp_path / "ddp"
    save = ("--save-every", "2", "--keep", "2")
    tp = train("--nproc-per-node", "4", "--tensor-parallel", "2", "--plan", "zero3", "--save-dir", str(ck_tp), *save)
    ddp = train("--nproc-per-node", "2", "--plan", "ddp", "--save-dir", str(ck_ddp), *save)
    to_t1 = train("--nproc-per-node", "2", "--plan", "zero2", "--resume", str(ck_tp / "step-00000002"))
    to_t2 = train("--nproc-per-node", "4", "--tensor-parallel", "2", "--plan", "zero3",
                  "--resume", str(ck_ddp / "step-00000002"))
    assert tp["tensor_parallel"] == 2 and tp["plan_str"] == "p=2x1,g=2x1,os=2x1", tp["plan_str"]
    # the planner's model states are one TP rank's shard's (whole embedding, norms and lm_head)
    predicted = tp["model_state_bytes"]["predicted"]["total"]
    for measured in tp["model_state_bytes"]["measured"]:
        assert abs(measured["total"] - predicted) <= 0.1 * predicted, (measured, predicted)
    assert to_t1["resumed_from"] and to_t1["tensor_parallel"] == 1
    assert to_t2["resumed_from"] and to_t2["tensor_parallel"] == 2
    for run in (tp, to_t1, to_t2):
        for a, b in zip(run["loss"], ddp["loss"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (run["loss"], ddp["loss"])


@pytest.mark.slow  # two `amsp train` launches (~1 min on 2 cores)
def test_amsp_train_tensor_parallel_in_bf16_trains_like_ddp(tmp_path):
    """bf16 under TP with sp = 1 (the TP DTensors and the plain parameters converted by the
    engine, runtime/materialize.py to_dtype_keep_buffers): ``--tensor-parallel 2 --plan ddp``
    on 4 ranks runs and gives the per-step losses of 2-rank DDP in bf16, within bf16's
    rounding of a different summation order (1e-2 relative)."""
    def train(*args):
        return _amsp_train("--steps", "3", "--precision", "bf16", *args)

    tp = train("--nproc-per-node", "4", "--tensor-parallel", "2", "--plan", "ddp")
    ddp = train("--nproc-per-node", "2", "--plan", "ddp")
    assert tp["tensor_parallel"] == 2 and tp["precision"] == "bf16"
    for a, b in zip(tp["loss"], ddp["loss"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(b), (tp["loss"], ddp["loss"])


@pytest.mark.slow  # 8 ranks (~25 s on 2 cores); the 4-rank cases above are the default tier's
def test_tp2_on_two_nodes_every_shard_group_size(tmp_path):
    """8 ranks as 2 nodes x 4, T = 2: the data-parallel world is 2 nodes x 2. Shard groups smaller
    than it (inside the node, across the nodes, mics:2) are cut from the (dp, tp) mesh
    (tensor_parallel.py [Note: FSDP2's mesh under TP]); with zero3 and ddp, each equals the
    single-process run on the 4 data-parallel ranks' batches."""
    plans = ("p=2x1,g=2x1,os=2x2", "p=1x2,g=1x2,os=2x2", "mics:2", "zero3", "ddp")
    run_ranks(8, "tests.tp_worker", "2", str(tmp_path), str(STEPS), str(CLIP), ";".join(plans), timeout=400,
              env={"TP_WORKER_GPUS_PER_NODE": "4"})
    for plan in plans:
        got = torch.load(tmp_path / (re.sub(r"[^A-Za-z0-9_.=-]", "_", plan) + ".pt"), weights_only=True)
        check_against_reference(got, plan, world=4)


def test_data_parallel_groups_of_a_2d_mesh():
    """2 nodes x 4 ranks, T = 2 (TP groups {0,1}, {2,3}, ... inside the nodes): the plan's groups
    hold the ranks of one TP coordinate only, laid out over the 2 x 2 data-parallel world."""
    from amsp_ext.planner.plan import resolve_plan
    from amsp_ext.topology.groups import World, rank_groups

    world = World(num_nodes=2, gpus_per_node=2, tensor_parallel=2)
    assert (world.size, world.global_size, world.node_of(3), world.node_of(4)) == (4, 8, 0, 1)
    zero3 = rank_groups(resolve_plan("zero3", gpus_per_node=2, num_nodes=2), world)
    assert zero3["param_shard"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    mics = rank_groups(resolve_plan("p=2x1,g=2x1,os=2x1", gpus_per_node=2, num_nodes=2), world)
    assert mics["param_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mics["param_replica"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
