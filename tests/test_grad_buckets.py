"""Gradient buckets close at unit boundaries (grad_sync.py [Note: buckets close at unit
boundaries]), in the engine and in the planner's list, against hand-computed layouts."""

from __future__ import annotations

from types import SimpleNamespace

from amsp_ext.planner.issued import grad_buckets
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.runtime.sync.grad_sync import _plan_buckets


def _tensors(units_numels):
    return [SimpleNamespace(index=i, unit=u, numel=n) for i, (u, n) in enumerate(units_numels)]


def test_engine_buckets_close_at_units_once_big_enough():
    ts = _tensors([(0, 300), (1, 200), (1, 200), (2, 100), (3, 50)])
    # backward: 50 (u3), 100 (u2), 200, 200 (u1), 300 (u0); a bucket closes at a unit
    # boundary only once it holds 250 elements
    got = [[idx for idx, _, _ in b.slots] for b in _plan_buckets(ts, 1000, 250)]
    assert got == [[4, 3, 2, 1], [0]]
    got = [b.numel for b in _plan_buckets(ts, 400, 250)]  # the cap still applies
    assert got == [350, 200, 300]
    assert [b.numel for b in _plan_buckets(ts, 1000)] == [850]  # no unit rule: filled to U


def test_planner_buckets_small_llama_fp32():
    from amsp_ext.train.models import llama_config_dict

    spec = ModelSpec.from_hf_config(llama_config_dict("small-llama"), name="small-llama")
    got = [b for b, _ in grad_buckets(spec, Plan(), granularity="layer", bucket_bytes=25 * 2**20,
                                      elem_bytes=4)]
    layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256  # q o, k v, mlp, norms
    # lm_head and the final norm (263 KB < 1 MiB) ride with the last layer; then one bucket
    # per layer; the embedding last
    assert got == [4 * (256 * 256 + 256 + layer), 4 * layer, 4 * layer, 4 * layer, 4 * 256 * 256]
