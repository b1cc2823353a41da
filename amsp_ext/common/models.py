"""Built-in Llama configurations (transformers ``LlamaForCausalLM`` from a config; never
downloaded weights). ``tiny-llama`` is the default for the main job and the tests."""

from __future__ import annotations

from typing import Any

# Byte-level tokens (amsp_ext.common.data): 256 symbols.
VOCAB_SIZE = 256

__all__ = ["VOCAB_SIZE", "MODEL_CONFIGS", "build_llama", "causal_lm_loss", "llama_config_dict", "model_spec"]

# Small enough for 8 gloo ranks on 2 CPU cores; GQA (2 kv heads) and SwiGLU like the real family.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "small-llama": dict(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}


def llama_config_dict(name: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` content of a built-in model (Llama architecture)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"model must be one of {', '.join(MODEL_CONFIGS)}, got {name!r}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "rms_norm_eps": 1e-5, "hidden_act": "silu", **MODEL_CONFIGS[name]}


def model_spec(model: str | None, model_config: str | None = None):
    """The planner's ModelSpec of a built-in model, a paper preset (llama-7b ...) or a
    config.json path (``amsp plan`` and ``amsp migrate`` take all three)."""
    from amsp_ext.planner.model_spec import MODEL_PRESETS, ModelSpec, ModelSpecError, load_model_spec

    if model in MODEL_CONFIGS:
        return ModelSpec.from_hf_config(llama_config_dict(model), name=model)
    if model is not None and model not in MODEL_PRESETS:
        raise ModelSpecError(f"model must be one of {', '.join([*MODEL_PRESETS, *MODEL_CONFIGS])} "
                             f"(or --model-config PATH), got {model!r}")
    return load_model_spec(model, model_config)


def build_llama(name: str = "tiny-llama", *, seed: int = 0, on_meta: bool = False, **overrides: Any):
    """A freshly initialised ``LlamaForCausalLM`` (fp32, eager attention), same on every rank;
    ``on_meta``: built on ``meta`` instead, for ``shard()`` to allocate and fill each rank's share."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**llama_config_dict(name), **overrides}
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    config._attn_implementation = "eager"
    if on_meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def causal_lm_loss(model, batch):
    """Mean next-token cross-entropy of ``batch`` (``[B, seq_len + 1]`` tokens, see amsp_ext.common.data)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
