"""The FLOPs count behind every MFU figure (amsp train, amsp compare, the planner), against
Megatron-LM's closed form and a hand count."""

import pytest

from amsp_ext.common.metrics import flops_per_token, median_after_warmup, mfu
from amsp_ext.common.models import llama_config_dict


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


def test_mfu_of_a_run_whose_peak_was_measured_never_exceeds_one():
    # The run's own peak (runtime/measure/peak.py: best of trials of 1024^2 matmuls, timed by the
    # slowest rank; here one process) and a few real training steps of tiny-llama at the
    # shape `amsp train` uses: MFU = planner FLOPs/token x tokens/s / peak must be in (0, 1].
    import time

    import torch

    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.metrics import mfu_check
    from amsp_ext.common.models import build_llama, causal_lm_loss
    from amsp_ext.runtime.measure.peak import device_peak

    torch.manual_seed(0)
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak.measured and peak.flops > 0 and "slowest rank" in peak.source
    model = build_llama("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(4):
        batch = micro_batch(step, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=8,
                            seq_len=128)
        t0 = time.perf_counter()
        causal_lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    tgs = 8 * 128 / min(times[1:])  # the fastest step: the strongest test of the bound
    value = mfu(flops_per_token=flops_per_token(llama_config_dict("tiny-llama"), 128),
                tokens_per_gpu_per_s=tgs, peak_flops=peak.flops)
    assert 0 < value <= 1, (value, peak)
    assert mfu_check(value) is None


def test_mfu_above_one_is_flagged_and_gpu_peaks_come_from_the_table():
    from amsp_ext.common.metrics import mfu_check, table_peak

    assert "exceeds 100%" in mfu_check(1.3) and mfu_check(0.4) is None and mfu_check(None) is None
    assert table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert table_peak("NVIDIA H100 PCIe") == 756e12
    assert table_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert table_peak("NVIDIA H200") == 989e12
    assert table_peak("Some Future GPU") is None
