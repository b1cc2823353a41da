"""The FLOPs count behind every MFU figure (amsp train, amsp compare, the planner), against
Megatron-LM's closed form and a hand count."""

import pytest

from amsp_ext.metrics import flops_per_token, median_after_warmup, mfu
from amsp_ext.models import llama_config_dict


def test_reduces_to_megatron_closed_form_for_a_gpt_shaped_layer():
    # A Llama layer is GPT-shaped when K/V are full width and the three SwiGLU matrices hold
    # 8h^2 weights (3 * h * i = 8 h^2 with i = 8h/3): then per iteration Megatron-LM
    # (Narayanan et al. 2021) gives 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    h, l, V, s, B = 384, 6, 5000, 1024, 8
    cfg = {"hidden_size": h, "intermediate_size": 8 * h // 3, "num_hidden_layers": l,
           "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": V,
           "tie_word_embeddings": False, "model_type": "llama"}
    megatron = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert B * s * flops_per_token(cfg, s) == pytest.approx(megatron, rel=1e-12)


def test_tiny_llama_by_hand():
    # h=64, 4 heads of 16, 2 kv heads, i=176, l=2, V=256, s=128.
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 + gate/up/down 3*64*176 = 46080 weights
    # forward/token: 2*(2*46080 + 4*128*64) + 2*64*256 = 282624; training x3 = 847872
    assert flops_per_token(llama_config_dict("tiny-llama"), 128) == 847872
    assert mfu(flops_per_token=1e6, tokens_per_gpu_per_s=50.0, peak_flops=1e9) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(flops_per_token=1.0, tokens_per_gpu_per_s=1.0, peak_flops=0)


def test_median_after_warmup():
    assert median_after_warmup([9.0, 1.0, 3.0, 2.0]) == 2.0
    assert median_after_warmup([5.0]) == 5.0
