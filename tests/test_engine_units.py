"""Pure parts of the engine: units in forward order, ownership policies, config validation."""

from __future__ import annotations

import pytest

from amsp_ext.models import build_llama
from amsp_ext.runtime.config import OverlapConfig, ShardConfig
from amsp_ext.runtime.ownership import assign_blocks, assign_greedy, load_per_owner
from amsp_ext.runtime.param_shard import prefetch_targets
from amsp_ext.runtime.units import list_units, unit_param_counts


def test_units_cover_every_param_once_in_forward_order():
    model = build_llama("tiny-llama")
    units = list_units(model, "module")
    names = [u.name for u in units]
    assert names[:4] == ["", "model.embed_tokens", "model.layers.0", "model.layers.0.self_attn.q_proj"]
    assert names[-2:] == ["model.norm", "lm_head"]
    layer0 = [u for u in units if u.layer_index == 0]
    assert [u.name.rsplit(".", 1)[-1] for u in layer0] == [
        "0", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert layer0[0].numel == 2 * 64  # the two RMSNorms
    seen = [id(p) for u in units for _, p in u.params]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    counts = dict(unit_param_counts(model))
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())
    assert counts["model.layers.1.mlp.down_proj"] == 64 * 176
    assert len(list_units(model, "layer")) == 1 + 1 + 2 + 2  # root, embed, 2 layers, norm, head


def test_tied_weights_go_to_the_root_unit():
    model = build_llama("tiny-llama", tie_word_embeddings=True)
    units = list_units(model)
    assert [n for n, _ in units[0].params] == ["model.embed_tokens.weight"]
    assert "model.embed_tokens" not in [u.name for u in units]
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())


def test_backward_prefetch_follows_reverse_post_forward_order():
    units = list_units(build_llama("tiny-llama"), "module")
    fwd, bwd = prefetch_targets(units)
    name = {i: u.name.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")
            for i, u in enumerate(units)}
    order = [max(bwd, key=lambda k: 0 if k in bwd.values() else 1)]
    while order[-1] in bwd:
        order.append(bwd[order[-1]])
    assert [name[i] for i in order][:6] == ["lm_head", "model.norm", "L1", "L1.down_proj", "L1.up_proj", "L1.gate_proj"]
    assert name[order[-1]] == "model.embed_tokens"
    assert fwd[1] == 2  # embed prefetches layer 0's unit


def test_ownership_policies():
    numels = [16384, 128, 4096, 2048, 2048, 4096, 11264, 11264, 11264, 64, 16384]
    for b in (1, 2, 3, 4, 8):
        for f in (assign_greedy, assign_blocks):
            owner = f(numels, b)
            assert len(owner) == len(numels) and set(owner) <= set(range(b))
        blocks = assign_blocks(numels, b)
        assert blocks == sorted(blocks)  # contiguous in forward order
        assert set(blocks) == set(range(min(b, len(numels))))  # nobody left empty
    for b in (2, 4, 8):
        greedy = max(load_per_owner(numels, assign_greedy(numels, b), b))
        blocks = max(load_per_owner(numels, assign_blocks(numels, b), b))
        assert greedy <= blocks and greedy <= max(max(numels), 1.34 * sum(numels) / b)
    assert assign_greedy([5, 4, 3, 3], 2) == [0, 1, 1, 0]  # hand-computed LPT


@pytest.mark.parametrize("kw,field", [
    ({"precision": "fp8"}, "config.precision"),
    ({"granularity": "block"}, "config.granularity"),
    ({"ownership": "random"}, "config.ownership"),
    ({"grad_bucket_bytes": 0}, "config.grad_bucket_bytes"),
    ({"gpus_per_node": 0}, "config.gpus_per_node"),
    ({"timeout": -1}, "config.timeout"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ShardConfig(**kw)


def test_config_fingerprint_and_defaults(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ShardConfig().gpus_per_node == 4
    assert ShardConfig(timeout=5).fingerprint() == ShardConfig(timeout=9).fingerprint()
    assert ShardConfig(precision="bf16").fingerprint() != ShardConfig().fingerprint()
    with pytest.raises(ValueError, match="overlap.broadcast"):
        OverlapConfig(broadcast=1)
