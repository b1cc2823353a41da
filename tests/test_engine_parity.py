"""Engine parity: every pre-filtered plan (and DDP / ZeRO-1 / ZeRO-3 / MiCS as plans) matches a
single-process reference on the same global batches: 5 steps of tiny-llama on real text,
M = 2 micro-batches, AdamW. One torchrun launch per world size (the worker loops over plans),
plus one launch for bf16/fp16, recompute, clipping, sg strictly between sp and sos, ablations.

[Note: tolerances]
fp32: losses within 1e-5 relative, parameters within 1e-5 absolute (the spec). Observed: <1e-7
and <3e-6; the parameter gap comes from Adam dividing by sqrt(v) for near-zero gradients.
bf16/fp16: the reference is the same mixed-precision recipe in one process (compute-dtype
params and grads, fp32 masters and AdamW states); the engine differs in how the per-rank
compute-dtype gradients are summed (per rank, then across ranks, in the compute dtype).
Losses: 1e-3 relative (observed ~3e-5 bf16, ~5e-6 fp16). Parameters: a max-abs bound is
meaningless here, because Adam turns gradient noise on near-zero gradients into +-lr steps
(a single-process simulation of the per-rank split gives 2.2e-3 max-abs, the same as the
engine). We bound the relative L2 error of the update, ||master - ref|| / ||ref - init||, by
2.5e-2: observed 1.1e-2 (bf16), below the 2.9e-2 that separates the bf16 recipe from fp32,
while dropping ONE rank's micro-batch in ONE of the 5 steps gives 7.8e-2 (measured with the
same simulation), so the bound catches a lost or doubled gradient.
"""

from __future__ import annotations

import json

import pytest

from dist_utils import run_torchrun

pytestmark = pytest.mark.distributed


def _results(proc):
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["case"]] = r
    return out


def _plans_line(proc):
    line = next(l for l in proc.stdout.splitlines() if l.startswith("PLANS "))
    plans, named = line[len("PLANS "):].split(" NAMED ")
    return json.loads(plans), json.loads(named)


@pytest.mark.parametrize("nproc,R,num_plans", [(4, 2, 9), (8, 4, 16)])
def test_fp32_parity_every_prefiltered_plan(nproc, R, num_plans):
    proc = run_torchrun(nproc, "tests.engine_worker", "parity", str(R), timeout=600)
    plans, named = _plans_line(proc)
    assert len(plans) == num_plans
    assert set(named.values()) <= set(plans)  # DDP, ZeRO-1, ZeRO-3, MiCS are in the set
    res = _results(proc)
    assert sorted(res) == sorted(plans)
    for plan, r in res.items():
        assert r["loss_max_rel_diff"] <= 1e-5, (plan, r)
        assert r["param_max_abs_diff"] <= 1e-5, (plan, r)


@pytest.fixture(scope="module")
def extras():
    return _results(run_torchrun(4, "tests.engine_worker", "extras", "2", timeout=600))


def test_mixed_precision(extras):
    cases = [c for c in extras if c.startswith(("bf16:", "fp16:"))]
    assert len(cases) == 6
    for c in cases:
        r = extras[c]
        assert r["loss_max_rel_diff"] <= 1e-3, (c, r)
        assert r["master_update_rel_l2"] <= 2.5e-2, (c, r)  # fp32 masters
        if c.startswith("fp16:"):
            assert r["skipped"] == 0, (c, r)


def test_fp16_overflow_skips_the_step_everywhere(extras):
    r = extras["fp16-overflow:p=2x1,g=2x2,os=2x2"]
    assert r["skipped"] == 1 and r["scale"] == 512.0, r
    # the reference skipped the same step: everything else still matches
    assert r["loss_max_rel_diff"] <= 1e-3 and r["master_update_rel_l2"] <= 2.5e-2, r


def test_recompute_keeps_the_gathered_params_for_backward(extras):
    for c in ("recompute:p=2x1,g=2x1,os=2x2", "recompute:p=2x2,g=2x2,os=2x2"):
        r = extras[c]
        assert r["loss_max_rel_diff"] <= 1e-5 and r["param_max_abs_diff"] <= 1e-5, r
        # one AG per unit in forward and one in backward, with or without recompute
        # (without keeping, recompute would need a third)
        assert r["ag_per_micro_batch"] == 2 * r["num_units"], r
        assert r["ag_per_micro_batch_no_recompute"] == 2 * r["num_units"], r


def test_global_clipping_is_exact(extras):
    cases = [c for c in extras if c.startswith("clip:")]
    assert len(cases) == 5
    for c in cases:
        r = extras[c]
        assert min(r["ref_norms"]) > 0.05  # clipping was active on every step
        assert r["norm_max_rel_diff"] <= 1e-5, (c, r)
        assert r["loss_max_rel_diff"] <= 1e-5 and r["param_max_abs_diff"] <= 1e-5, (c, r)


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
])
def test_variants_match_reference(extras, case):
    r = extras[case]
    assert r["loss_max_rel_diff"] <= 1e-5 and r["param_max_abs_diff"] <= 1e-5, r
    if "state-dict" in case:
        assert r["metadata_ok"] and r["num_owned"] > 0, r
    if "tied" in case:
        assert r["root_unit_params"] == 1, r
    if "coalesced" in case:  # the smallest tensors went out packed, one broadcast per pack; the
        # budget ran out before the largest, and the packed bytes in flight stayed within it
        assert 0 < r["num_packed"] and r["num_items"] < r["num_tensors"], r
        assert r["num_packed_tensors"] < r["num_tensors"], r
        assert 0 < r["peak_staging"] <= r["staging_limit"], r


def test_model_state_bytes_match_the_planners_memory_model():
    """Measured params + grads + masters + optimizer states per rank within 10% of
    amsp_ext.planner.memory for every pre-filtered plan on 2 x 2 (bf16 and fp32)."""
    res = _results(run_torchrun(4, "tests.engine_worker", "memory", "2", timeout=600))
    assert len(res) == 18
    for case, r in res.items():
        assert r["worst_rank_rel_err"] <= 0.10, (case, r)
