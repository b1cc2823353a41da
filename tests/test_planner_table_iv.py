"""The paper's Table IV: plans `amsp plan` picks on paper-a800 with the paper's settings.

Settings (paper Sec. VI): 128 nodes x 8 A800-80GB, seq 4096, micro-batch 1, 4M-token global
batch (so M = 1 at 1024 GPUs), recomputation for LLaMA-30B only, AdamW in bf16.

[Note: why 13B and 30B differ from the paper]
paper-a800 is a single-group table, so the planner charges every cross-node mesh for the R/p0
groups of that shape that share a node's NICs in training (see profile.py). Under that model
the T0_os all-reduce moves the same bytes through each node's NICs whatever sp is (R/s0_p
groups each all-reducing 2Phi/sp), so sharding parameters inside a node no longer buys a
cheaper T0_os; it only adds Tp. Where sp = 1 fits (with sg = sos, which costs nothing extra at
M = 1) the planner keeps sp = 1: 13B gets p=1x1,g=8x2,os=8x2 (72.1 GiB of 78 usable; before
the unfused-RMSNorm activation correction, planner/memory.py, measured by ``amsp dryrun``, it
was p=1x1,g=8x1,os=8x1 at 76.4 GiB, which the corrected count puts at 82.6 and ``amsp dryrun``
measures at 79.78 GiB on rank 0, over the 78 GiB usable: comparisons/results/
dryrun_paper-a800_2026-12-02.md) and 30B
p=1x1,g=8x8,os=8x8. Costed in isolation (no contention), the same search drifts to MiCS-like
sp = 8 plans instead (checked below). Neither reproduces the paper's sp = 4 (13B) / sp = 8,
sos = 32 (30B); we keep the contention model because it is what the hardware does. The memory
model is not the cause: its 7B estimate (58.9 GiB, 63 GB) is close to the paper's measured
~60 GB (Fig. 13). With --objective step the paper's plans are within 1-4% of the chosen ones.
"""

import dataclasses
import json

import pytest

from amsp_ext.cli.main import main

SETTINGS = ["--nodes", "128", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
            "--profile", "paper-a800", "--seq-len", "4096", "--micro-batch-size", "1",
            "--global-batch-tokens", "4194304", "--json",
            # the paper's engine: bf16 with 2-byte gradient traffic, per-Linear units; the
            # bucket these tests were written against (amsp plan's engine defaults are fp32,
            # layer units and 25 MiB: engine_config.py)
            "--precision", "bf16", "--reduce-dtype", "bf16", "--granularity", "module",
            "--grad-bucket-bytes", "128MiB"]
XFAIL = pytest.mark.xfail(strict=True, reason=(
    "contention-aware costing: T0_os moves the same bytes through each node's NICs for any sp, "
    "so sharding parameters only adds Tp and the planner keeps sp = 1 where it fits (with "
    "sg = sos); see the module Note"))


def plan_of(capsys, model, recompute):
    rc = main(["plan", "--model", model] + SETTINGS + (["--recompute"] if recompute else []))
    assert rc == 0
    return json.loads(capsys.readouterr().out)["plan_text"]


@pytest.mark.parametrize("model,recompute,expected", [
    ("llama-7b", False, "p=1x1,g=1x1,os=8x1"),  # sp = sg = 1, sos = 8 (8x1)
    pytest.param("llama-13b", False, "p=4x1,g=4x1,os=8x1", marks=XFAIL),  # sp = sg = 4, sos = 8
    pytest.param("llama-30b", True, "p=8x1,g=8x1,os=8x4", marks=XFAIL),  # sp = sg = 8, sos = 32
])
def test_table_iv(capsys, model, recompute, expected):
    assert plan_of(capsys, model, recompute) == expected


def test_what_the_planner_picks_instead_fits_and_costs_no_more_than_the_papers_plan(capsys):
    """Not a snapshot of the pick: whatever it is, it fits and its Eq. 1 time is at most the
    Table IV plan's (evaluated on its own, plan by plan), which is what minimising means."""
    from amsp_ext.planner.plan import parse_plan
    from amsp_ext.planner.search import evaluate, make_problem
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

    cl = ClusterSpec(num_nodes=128, gpus_per_node=8, gpu_memory_bytes=80 * 2**30)
    for model, rec, paper in (("llama-13b", False, "p=4x1,g=4x1,os=8x1"),
                              ("llama-30b", True, "p=8x1,g=8x1,os=8x4")):
        pick = plan_of(capsys, model, rec)
        tr = TrainingSpec(seq_len=4096, global_batch_tokens=4 * 2**20, recompute=rec, precision="bf16",
                          reduce_dtype="bf16", granularity="module", bucket_bytes=128 * 2**20)
        prob = make_problem(model, cl, tr, "paper-a800", memory_reserve_bytes=2 * 2**30)
        chosen, theirs = evaluate(prob, parse_plan(pick)), evaluate(prob, parse_plan(paper))
        assert chosen.feasible, (model, pick)
        assert chosen.comm.total <= theirs.comm.total * (1 + 1e-9), (model, pick, paper)


def test_isolation_costing_drifts_to_mics_like_plans():
    from amsp_ext.planner.profile import load_profile
    from amsp_ext.planner.search import make_problem, search
    from amsp_ext.planner.specs import ClusterSpec, paper_job

    iso = dataclasses.replace(load_profile("paper-a800"), concurrency="all_groups")
    cl = ClusterSpec(num_nodes=128, gpus_per_node=8, gpu_memory_bytes=80 * 2**30)
    for model, rec in (("llama-13b", False), ("llama-30b", True)):
        tr = paper_job(seq_len=4096, global_batch_tokens=4 * 2**20, recompute=rec)
        best = search(make_problem(model, cl, tr, iso)).best.plan
        assert best.mesh("p") == (8, 1), (model, str(best))
