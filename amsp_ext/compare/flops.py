"""Model FLOPs per token by the Megatron-LM formula the paper uses, and MFU.

[Note: the formula]
Megatron-LM (Narayanan et al., SC'21, appendix) counts, for a GPT layer of hidden size h at
sequence length s, the forward matmul FLOPs per token as 24h^2 (QKV, output projection and a
4h MLP: 12h^2 weights, 2 FLOPs per multiply-add) plus 4sh for attention (QK^T and AV, s keys of h
dims each), plus 2hV for the logits; training is 3x forward (the layers 4x with full activation
recomputation; the logits are not recomputed). With B sequences per iteration that is the familiar
``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` FLOPs. Llama's layers are not GPT's (grouped-query
attention shrinks K and V, SwiGLU has three h x f matrices), so we keep the derivation and count
the layer's real weight matrices: ``2 * (dense matmul weights per layer)`` FLOPs per token
instead of 24h^2. For a GPT layer this reduces exactly to Megatron's closed form (tested).
Attention is *not* halved for causal masking - the paper follows FlashAttention's convention and
so do we. Embedding lookups, norms, softmax and the loss are not counted (as in Megatron).

MFU = (model FLOPs per token x tokens per GPU per second) / peak FLOP/s of one GPU. The harness
measures the peak with a dense matmul on the device, with all ranks busy at once (see
:mod:`amsp_ext.compare.peak`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["LayerShape", "layer_shape", "megatron_flops_per_token", "gpt_megatron_flops_per_iteration", "mfu"]


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """What the FLOPs formula needs from a decoder-only transformer."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    dense_weights_per_layer: int  # elements of all matmul weights in one layer

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size", "dense_weights_per_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def layer_shape(config: Mapping[str, Any]) -> LayerShape:
    """From a Llama ``config.json``-style dict (``amsp_ext.models.llama_config_dict``)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    f = int(config["intermediate_size"])
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h  # q, k+v, o
    mlp = 3 * h * f  # gate, up, down (SwiGLU)
    return LayerShape(num_layers=int(config["num_hidden_layers"]), hidden_size=h,
                      vocab_size=int(config["vocab_size"]), dense_weights_per_layer=attn + mlp)


def megatron_flops_per_token(shape: LayerShape, *, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward [+ recompute forward])."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    l, h, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    layers_forward = l * (2 * shape.dense_weights_per_layer + 4 * seq_len * h)
    # Recomputation repeats the layers' forward, not the logits (Megatron: 6hV either way).
    return (4 if recompute else 3) * layers_forward + 3 * 2 * h * V


def gpt_megatron_flops_per_iteration(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                                     vocab: int, recompute: bool = False) -> float:
    """Megatron-LM's closed form, for checking the general count against it."""
    B, s, l, h, V = batch, seq_len, num_layers, hidden, vocab
    lead = 96 if recompute else 72
    tail = 16 if recompute else 12
    return lead * B * s * l * h * h * (1 + s / (6 * h) + V / (tail * l * h))


def mfu(*, flops_per_token: float, tokens_per_gpu_per_s: float, peak_flops: float) -> float:
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return flops_per_token * tokens_per_gpu_per_s / peak_flops
