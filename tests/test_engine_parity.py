"""Engine parity: every pre-filtered plan (and DDP / ZeRO-1 / ZeRO-3 / MiCS as plans) matches a
single-process reference on the same global batches: 5 steps of tiny-llama on real text,
M = 2 micro-batches, AdamW (2 steps on 8 ranks). One torchrun launch per world size (the worker
loops over plans, freeing each plan's process groups), plus one launch for 16-bit reduction,
fp16, recompute, clipping, sg strictly between sp and sos, ablations and APIs, and one for the
memory model.

The workers only write what they saw (tests/parity_check.py); the reference runs here, in this
process, and every comparison is made here at EVERY step: the loss of each step, and the fp32
masters after each step (rebuilt from the owners' shards), plus, after the last step, every
rank's local parameters against the owners' masters (every broadcast landed). A non-finite
loss fails a case, except at the one step where the fp16-overflow case injects it.

[Note: tolerances]
fp32: losses within 1e-5 relative, parameters within 1e-5 absolute, every step (the spec).
Observed: < 1e-7 and < 2e-6; the parameter gap comes from Adam dividing by sqrt(v) for
near-zero gradients. Replicas equal their owners bit for bit.

bf16 with reduce_dtype="fp32" (the default) on every pre-filtered plan of 2 x 2: losses within
5e-3 relative of the fp32 reference at every step (the acceptance bound of issue 13; observed
2.28e-4 worst), and the fp32 masters against the single-process bf16 recipe by the update bound
below. On this small run (4 ranks, M = 2) the summation dtype is not what separates bf16 from
fp32: with bf16 reduction the loss is 2.35e-4 from fp32 too; the gap is the bf16 forward and
backward themselves.

16-bit reduction (reduce_dtype = the precision) keeps its documented bound: losses 1e-3 relative
of the same mixed-precision recipe run in one process (compute-dtype params and grads, fp32
masters and AdamW states); the engine differs in how per-rank compute-dtype gradients are
summed. Parameters: a max-abs bound is meaningless here, because Adam turns gradient noise on
near-zero gradients into +-lr steps. We bound the relative L2 error of the update,
||master - ref|| / ||ref - init||, at step s (1-based) by 2.5e-2 * sqrt(5 / s): Adam's
per-step noise is independent across steps while the update grows linearly, so the relative
error shrinks like 1/sqrt(s); at s = 5 it is the 2.5e-2 bound this file always had (observed
1.2e-2 to 1.3e-2 with bf16 reduction, 1.0e-2 to 1.2e-2 with fp32; dropping ONE rank's micro-batch in ONE of the 5 steps gives 7.8e-2,
measured with a single-process simulation, so the bound catches a lost or doubled gradient).
Observed per step with fp32 reduction: 3.5e-2, 2.2e-2, 1.7e-2, 1.4e-2, 1.2e-2 (bounds 5.6e-2,
4.0e-2, 3.2e-2, 2.8e-2, 2.5e-2).
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_ranks
from parity_check import (DTYPES, STEPS, initial_params, load_cases, loss_rel_diffs, master_update_rel_l2,
                          param_max_abs_diffs, reference, replicas_match_owners)

pytestmark = pytest.mark.distributed


def update_bound(step: int) -> float:
    return 2.5e-2 * math.sqrt(5 / (step + 1))


def check_fp32(case, ref):
    losses = loss_rel_diffs(case["losses"], ref["losses"])
    params = param_max_abs_diffs(case, ref)
    assert max(losses) <= 1e-5, losses
    assert max(params) <= 1e-5, params
    assert replicas_match_owners(case, torch.float32) == 0.0


def check_mixed(case, ref, precision, *, nonfinite_ok=(), tied=False):
    losses = loss_rel_diffs(case["losses"], ref["losses"], nonfinite_ok=nonfinite_ok)
    assert max(losses) <= 1e-3, losses
    updates = master_update_rel_l2(case, ref, initial_params(tied))
    for s, u in enumerate(updates):
        assert u <= update_bound(s), (s, updates)
    assert replicas_match_owners(case, DTYPES[precision]) == 0.0


def _plans_line(proc):
    line = next(l for l in proc.stdout.splitlines() if l.startswith("PLANS "))
    plans, named = line[len("PLANS "):].split(" NAMED ")
    import json
    return json.loads(plans), json.loads(named)


@pytest.fixture(scope="module")
def extras(tmp_path_factory):
    out = tmp_path_factory.mktemp("extras")
    run_ranks(4, "tests.engine_worker", "extras", "2", str(out), timeout=600)
    return load_cases(out / "extras")


@pytest.mark.parametrize("nproc,R,num_plans,steps", [
    (4, 2, 9, STEPS),
    # conftest.py [Note: test tiers]: the 4-rank case above runs every code path this one does
    pytest.param(8, 4, 16, 2, marks=pytest.mark.slow),
])
def test_parity_every_prefiltered_plan(nproc, R, num_plans, steps, tmp_path):
    """[Note: 2 steps on 8 ranks]
    8 ranks on 2 cores cost ~5x a 4-rank case per step (an sp > 1 case 1-2 s a step, sp = 8
    ~4 s), and 2 steps exercise every path 5 do: step 1 from fresh Adam states, step 2 with
    them, and step 2 waits for step 1's broadcasts in its forward; the final local parameters
    are checked against the owners' masters after step 2 (its broadcasts landed). Steps 3-5 add
    no path on 8 ranks that the 4-rank run (5 steps, same code) does not take."""
    proc = run_ranks(nproc, "tests.engine_worker", "parity", str(R), str(tmp_path), str(steps), timeout=600)
    plans, named = _plans_line(proc)
    assert len(plans) == num_plans
    assert set(named.values()) <= set(plans)  # DDP, ZeRO-1, ZeRO-3, MiCS are in the set
    cases = load_cases(tmp_path / "parity")
    precisions = ("fp32", "bf16") if nproc == 4 else ("fp32",)
    assert sorted(cases) == sorted(f"{prec}:{p}" for prec in precisions for p in plans)
    assert {len(c["losses"]) for c in cases.values()} == {steps}
    ref32 = reference(nproc, num_steps=steps)
    worst_bf16 = 0.0
    for name, case in cases.items():
        if name.startswith("fp32:"):
            check_fp32(case, ref32)
        else:  # bf16 with fp32 reduction: the fp32 reference's loss within 5e-3, every step
            vs32 = loss_rel_diffs(case["losses"], ref32["losses"])
            assert max(vs32) <= 5e-3, (name, vs32)
            worst_bf16 = max(worst_bf16, max(vs32))
            check_mixed(case, reference(nproc, precision="bf16"), "bf16")
    print(f"bf16 reduce fp32: worst loss rel diff vs fp32 reference {worst_bf16:.2e}")


def test_sixteen_bit_reduction_keeps_its_bound(extras):
    cases = [c for c in extras if c.startswith(("bf16-reduce-", "fp16-reduce-"))]
    assert len(cases) == 6
    for c in cases:
        prec = c[:4]
        check_mixed(extras[c], reference(4, precision=prec), prec)
        if prec == "fp16":
            assert extras[c]["extra"]["skipped"] == 0, c


def test_fp16_overflow_skips_the_step_everywhere(extras):
    case = extras["fp16-overflow:p=2x1,g=2x2,os=2x2"]
    assert case["extra"]["skipped"] == 1 and case["extra"]["scale"] == 512.0, case["extra"]
    # the reference skipped the same step: everything else still matches, every step
    check_mixed(case, reference(4, precision="fp16", skip=(2,)), "fp16", nonfinite_ok=(2,))


def test_recompute_keeps_the_gathered_params_for_backward(extras):
    for c in ("recompute:p=2x1,g=2x1,os=2x2", "recompute:p=2x2,g=2x2,os=2x2"):
        check_fp32(extras[c], reference(4))
        r = extras[c]["extra"]
        # one AG per unit in forward and one in backward, with or without recompute
        # (without keeping, recompute would need a third); the root unit (embedding, final
        # norm, lm_head) is gathered once, kept into the backward (units.py [Note: one root unit])
        assert r["ag_per_micro_batch"] == 2 * r["num_units"] - 1, r
        assert r["ag_per_micro_batch_no_recompute"] == 2 * r["num_units"] - 1, r


def test_global_clipping_is_exact(extras):
    cases = [c for c in extras if c.startswith("clip:")]
    assert len(cases) == 5
    ref = reference(4, clip=0.05)
    assert min(ref["norms"]) > 0.05  # clipping was active on every step
    for c in cases:
        norms = [abs(a - b) / b for a, b in zip(extras[c]["norms"], ref["norms"], strict=True)]
        assert len(norms) == 5 and max(norms) <= 1e-5, (c, norms)
        check_fp32(extras[c], ref)


@pytest.mark.parametrize("case", [
    "sg-between:p=1x1,g=2x1,os=2x2",
    "overlap-off:p=2x1,g=2x2,os=2x2",
    "small-buckets:p=2x1,g=2x2,os=2x2",
    "blocks:p=1x1,g=2x2,os=2x2",
    "layer-granularity:p=2x1,g=2x1,os=2x2",
    "boundary-api+lr-schedule+state-dict:p=1x1,g=2x2,os=2x2",
    "tied-embeddings:p=1x1,g=2x2,os=2x2",  # the shared weight goes to the root unit
    "tied-embeddings:p=2x1,g=2x1,os=2x2",
    "coalesced-broadcasts:p=2x1,g=2x1,os=2x2",
    "unit-buckets:p=1x1,g=2x2,os=2x2",
    "unit-buckets:p=2x1,g=2x2,os=2x2",
    "two-level:ddp",
    "two-level-small-buckets:ddp",
    "two-level-small-buckets:p=1x1,g=2x2,os=2x2",
])
def test_variants_match_reference(extras, case):
    ref = reference(4, sched="lr-schedule" in case, tied="tied" in case)
    check_fp32(extras[case], ref)
    r = extras[case]["extra"]
    if "state-dict" in case:
        assert r["metadata_ok"] and r["num_owned"] > 0 and r["num_steps"] == 5, r
    if "tied" in case:
        assert r["root_unit_params"] == 2, r  # the shared weight and the final norm
    if case == "small-buckets:p=2x1,g=2x2,os=2x2":
        # sp = 2: every unit's shard is above the 4 KiB U and none is split (planner/buckets.py
        # [Note: a sharded unit is one bucket]): one all-reduce per unit, as HSDP's, at each
        # boundary (the replica group) and each other micro-batch (Tg, sg = 4 > sp)
        assert r["num_buckets"] == r["num_units"] == 3, r
        assert r["counts"]["all_reduce:param_replica"] == STEPS * 3, r
    if "unit-buckets" in case:  # 3 units: the root (embedding, final norm, lm_head), 2 layers.
        # sp = 1, tensors in registration order (units.py layout_order), backward: lm_head +
        # final norm (one unit) | layer 1 | layer 0 | embedding: 4 buckets. sp = 2: the root's
        # gradients arrive last, with its one reduce-scatter: layer 1 | layer 0 | root: 3
        assert r["num_units"] == 3, r
        assert r["num_buckets"] == (4 if "p=1x1" in case else 3), r
    if "two-level" in case:  # every gradient all-reduce ran in the node, across, and gathered
        # back in the node (on gloo the first phase is an all-reduce: collectives.py [Note:
        # two-level all-reduce]); none on the flat groups
        c, n = r["counts"], STEPS * r["num_buckets"]  # the boundary's buckets, once a step
        tg = STEPS * r["num_buckets"] if "g=2x2" in case else 0  # M - 1 = 1 Tg pass a step
        assert c.get("all_reduce:param_replica", 0) == 0 and c.get("all_reduce:grad", 0) == 0, c
        assert c["all_reduce:param_replica_local"] == c["all_gather:param_replica_local"] == n, c
        assert c["all_reduce:param_replica_node"] == n, c
        if tg:
            assert c["all_reduce:grad_local"] == c["all_reduce:grad_node"] == c["all_gather:grad_local"] == tg, c
        if "small-buckets" in case:
            assert r["num_buckets"] > 4, r
        else:  # lm_head + final norm (one root unit) | layer 1 | layer 0 | embedding (the
            # root's, apart: sp = 1 keeps registration order), all in flight at the flush,
            # which issues every chain's in-node all-gather before it waits for any
            # (GradSync._flush; collectives.py [Note: two-level all-reduce])
            assert r["num_buckets"] == 4 and r["max_local_gathers_in_flight"] >= 2, r
    if "coalesced" in case:  # the smallest tensors went out packed, one broadcast per pack; the
        # budget ran out before the largest, and the packed bytes in flight stayed within it
        assert 0 < r["num_packed"] and r["num_items"] < r["num_tensors"], r
        assert r["num_packed_tensors"] < r["num_tensors"], r
        assert 0 < r["peak_staging"] <= r["staging_limit"], r


def test_swa_averaged_model_fed_from_a_sharded_model(extras):
    case = extras["swa:p=1x1,g=1x1,os=2x2"]
    ref = reference(4)
    check_fp32(case, ref)
    r = case["extra"]
    assert r["n_averaged"] == 5
    for name, got in r["swa"].items():  # the average of the reference's five steps
        want = torch.stack([s[name] for s in ref["steps"]]).mean(0)
        assert float((got - want).abs().max()) <= 1e-5, name
    assert "cannot be deep-copied" in r["deepcopy_error"] and "\n" not in r["deepcopy_error"]


def test_model_state_bytes_match_the_planners_memory_model():
    """Measured params + grads + masters + optimizer states per rank (after one step) within 10%
    of amsp_ext.planner.memory for every pre-filtered plan on 2 x 2 (bf16 with bf16 reduction
    and fp32), and bf16 with fp32 reduction on four plans."""
    import json

    proc = run_ranks(4, "tests.engine_worker", "memory", "2", timeout=600)
    res = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            res[r["case"]] = r
    assert len(res) == 22
    for case, r in res.items():
        assert r["worst_rank_rel_err"] <= 0.10, (case, r)
    # fp32 reduction doubles the gradient bytes the planner charges (2 -> 4 per element)
    a, b = res["bf16-reduce-bf16:p=1x1,g=2x2,os=2x2"], res["bf16-reduce-fp32:p=1x1,g=2x2,os=2x2"]
    assert b["predicted"]["grads"] == 2 * a["predicted"]["grads"], (a, b)
