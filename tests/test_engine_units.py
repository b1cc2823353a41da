"""Pure parts of the engine: units in forward order, ownership policies, config validation."""

from __future__ import annotations

import pytest
import torch

from amsp_ext.common.models import build_llama
from amsp_ext.runtime.config import OverlapConfig, ShardConfig
from amsp_ext.runtime.optim.ownership import assign_blocks, assign_greedy, load_per_owner
from amsp_ext.runtime.sync.param_shard import prefetch_targets
from amsp_ext.runtime.sync.units import list_units, unit_param_counts


def test_units_cover_every_param_once_in_forward_order():
    model = build_llama("tiny-llama")
    units = list_units(model, "module")
    names = [u.name for u in units]
    # units.py [Note: one root unit]: everything outside the layers is the root unit, first
    assert names[:3] == ["", "model.layers.0", "model.layers.0.self_attn.q_proj"]
    assert names[-1] == "model.layers.1.mlp.down_proj"
    assert [n for n, _ in units[0].params] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    layer0 = [u for u in units if u.layer_index == 0]
    assert [u.name.rsplit(".", 1)[-1] for u in layer0] == [
        "0", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert layer0[0].numel == 2 * 64  # the two RMSNorms
    seen = [id(p) for u in units for _, p in u.params]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    counts = dict(unit_param_counts(model, "module"))
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())
    assert counts["model.layers.1.mlp.down_proj"] == 64 * 176
    assert counts["<root>"] == 2 * 256 * 64 + 64  # embedding, lm_head, final norm
    assert len(list_units(model, "layer")) == 1 + 2  # root (embed, norm, head), 2 layers


def test_tied_weights_go_to_the_root_unit():
    model = build_llama("tiny-llama", tie_word_embeddings=True)
    units = list_units(model, "module")
    assert [n for n, _ in units[0].params] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert [u.kind for u in units].count("root") == 1
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())


def test_backward_prefetch_follows_reverse_post_forward_order():
    units = list_units(build_llama("tiny-llama"), "module")
    fwd, bwd = prefetch_targets(units)
    name = {i: u.name.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")
            for i, u in enumerate(units)}
    order = [max(bwd, key=lambda k: 0 if k in bwd.values() else 1)]
    while order[-1] in bwd:
        order.append(bwd[order[-1]])
    # the root (kept gathered since the forward) prefetches the last layer, never itself
    assert [name[i] for i in order][:5] == ["", "L1", "L1.down_proj", "L1.up_proj", "L1.gate_proj"]
    assert name[order[-1]] == "L0.q_proj" and 0 not in bwd.values()
    assert fwd[0] == 1 and 0 not in fwd.values()  # the root prefetches layer 0's unit


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


def test_blocks_is_the_best_contiguous_partition():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(300):
        numels = [rng.choice([1, 2, 3, 8, 40, 100]) for _ in range(rng.randint(1, 8))]
        b = rng.randint(1, 4)
        # brute force over every way of cutting the list into at most b contiguous blocks
        best = min(max(sum(numels[i:j]) for i, j in zip((0,) + cuts, cuts + (len(numels),)))
                   for k in range(min(b, len(numels)))
                   for cuts in itertools.combinations(range(1, len(numels)), k))
        assert max(load_per_owner(numels, assign_blocks(numels, b), b)) == best, (numels, b)
    assert assign_blocks([5, 1, 1, 4, 3], 2) == [0, 0, 0, 1, 1]  # 7 | 7


@pytest.mark.parametrize("kw,field", [
    ({"precision": "fp8"}, "config.precision"),
    ({"granularity": "block"}, "config.granularity"),
    ({"ownership": "random"}, "config.ownership"),
    ({"grad_bucket_bytes": 0}, "config.grad_bucket_bytes"),
    ({"broadcast_bucket_bytes": -1}, "config.broadcast_bucket_bytes"),
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


def _local_tensors(numels, owners):
    import torch.nn as nn

    from amsp_ext.runtime.optim.layout import LocalTensor
    return [LocalTensor(index=i, name=f"t{i}", param=nn.Parameter(torch.zeros(n)), unit=i,
                        global_shape=(n,), local_shape=(n,), shard_index=0, owner_rank=o,
                        keeper_rank=o) for i, (n, o) in enumerate(zip(numels, owners))]


def test_broadcast_items_pack_the_smallest_tensors_per_owner_within_the_budget():
    from amsp_ext.runtime.sync.param_sync import broadcast_items

    # fp32, bucket 64 B: the smallest tensors are packed until 64 B are taken (t0, t1, t2, t4;
    # t6 no longer fits), per owner into packs of at most 32 B, each issued at the position of
    # its first tensor; the 400 B tensor and t6 go in place; an empty local shard is skipped
    ts = _local_tensors([4, 4, 4, 100, 4, 0, 4], [0, 0, 1, 1, 1, 0, 0])
    items = broadcast_items(ts, 64)
    assert [[t.index for t in it.tensors] for it in items] == [[0, 1], [2, 4], [3], [6]]
    assert [it.packed for it in items] == [True, True, False, False]
    assert [it.owner_rank for it in items] == [0, 1, 1, 0]
    assert [it.nbytes for it in items] == [32, 32, 400, 16]
    # one owner, 8 B tensors, bucket 32 B: packs of 16 B, budget for four of the five
    items = broadcast_items(_local_tensors([2, 2, 2, 2, 2], [0] * 5), 32)
    assert [[t.index for t in it.tensors] for it in items] == [[0, 1], [2, 3], [4]]
    # 0 = one broadcast per tensor
    assert len(broadcast_items(_local_tensors([4, 4, 4], [0, 0, 0]), 0)) == 3


class _HalfInit(torch.nn.Module):
    """An initializer that writes ``weight`` and forgets ``bias`` (or writes +-inf and 1s)."""

    def __init__(self, overflow: bool = False):
        super().__init__()
        self.overflow = overflow
        self.weight = torch.nn.Parameter(torch.empty(4, 3))
        self.bias = torch.nn.Parameter(torch.empty(4))

    def reset_parameters(self):
        if self.overflow:  # sums to inf - inf = NaN, yet holds no NaN
            self.weight.copy_(torch.tensor([float("inf"), float("-inf"), 0.0]).expand(4, 3))
            self.bias.fill_(1.0)
        else:
            self.weight.fill_(0.5)


def test_fill_names_a_parameter_the_initializer_leaves_unset():
    from amsp_ext.runtime.materialize import fill

    with pytest.raises(ValueError, match=r"module '<root>' \(_HalfInit\) left parameter 'bias' unset"):
        fill(_HalfInit(), device=torch.device("cpu"), seed=0, init_buffers=False)


def test_fill_accepts_values_whose_sum_is_nan_but_hold_none():
    from amsp_ext.runtime.materialize import fill

    m = _HalfInit(overflow=True)
    fill(m, device=torch.device("cpu"), seed=0, init_buffers=False)
    assert torch.isnan(m.weight.sum()) and not torch.isnan(m.weight).any()
    assert torch.equal(m.bias, torch.ones(4))
