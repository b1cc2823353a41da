"""ModelSpec: exact parameter counts (presets vs published sizes, HF configs, a real model)."""

import pytest

from amsp_ext.planner.model_spec import ModelSpec, ModelSpecError, load_model_spec


def llama_count(h, i, L, V=32000):
    # written out independently of model_spec: 4 attention projections (MHA), 3 MLP matrices,
    # 2 RMSNorm vectors per layer; embedding + lm_head (untied) + final norm.
    return L * (4 * h * h + 3 * h * i + 2 * h) + 2 * V * h + h


@pytest.mark.parametrize("name,h,i,L,published", [
    ("llama-7b", 4096, 11008, 32, 6.74e9),
    ("llama-13b", 5120, 13824, 40, 13.02e9),
    ("llama-30b", 6656, 17920, 60, 32.53e9),
    ("llama-65b", 8192, 22016, 80, 65.29e9),
])
def test_presets_match_published_sizes(name, h, i, L, published):
    spec = ModelSpec.preset(name)
    assert spec.num_params == llama_count(h, i, L)
    assert spec.num_params == pytest.approx(published, rel=5e-4)
    assert sum(u.num_params for u in spec.units("module")) == spec.num_params
    assert sum(u.num_params for u in spec.units("layer")) == spec.num_params


def test_7b_exact_count():
    # 32 * (4*4096^2 + 3*4096*11008 + 8192) + 2*32000*4096 + 4096
    assert ModelSpec.preset("llama-7b").num_params == 6_738_415_616


def test_units_in_forward_order_and_named_like_hf():
    spec = ModelSpec.preset("llama-7b")
    units = spec.units("module")
    assert len(units) == 32 * 8 + 3
    assert [u.kind for u in units[:10]] == [
        "embedding", "norms", "q", "k", "v", "o", "gate", "up", "down", "norms"]
    assert units[1].modules == ("model.layers.0.input_layernorm",
                                "model.layers.0.post_attention_layernorm")
    assert units[2].modules == ("model.layers.0.self_attn.q_proj",)
    assert [u.kind for u in units[-2:]] == ["final_norm", "lm_head"]
    layer = spec.units("layer")
    assert [u.modules for u in layer[1:3]] == [("model.layers.0",), ("model.layers.1",)]


def test_gqa_tied_and_bias_flags():
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
               tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    spec = ModelSpec.from_hf_config(cfg)
    # head_dim 16, kv width 32. q: 64*64+64, k,v: 64*32+32, o: 64*64+64, gate/up: 64*176+176,
    # down: 176*64+64, norms 128.
    layer = (64 * 64 + 64) * 2 + (64 * 32 + 32) * 2 + (64 * 176 + 176) * 2 + (176 * 64 + 64) + 128
    assert spec.params_per_layer == layer
    assert spec.num_params == 3 * layer + 100 * 64 + 64  # tied: no lm_head
    assert [u.kind for u in spec.units("module")][-1] == "final_norm"


def test_qwen2_has_qkv_bias_only():
    cfg = dict(model_type="qwen2", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    kinds = dict(ModelSpec.from_hf_config(cfg).layer_module_params())
    assert kinds["q"] == 8 * 8 + 8 and kinds["k"] == 8 * 4 + 4 and kinds["o"] == 8 * 8


@pytest.mark.parametrize("overrides", [
    {}, {"tie_word_embeddings": True}, {"attention_bias": True, "mlp_bias": True},
    {"num_key_value_heads": 4},
])
def test_counts_match_a_real_llama(overrides):
    pytest.importorskip("transformers")
    from amsp_ext.common.models import build_llama, llama_config_dict

    cfg = {**llama_config_dict("tiny-llama"), **overrides}
    spec = ModelSpec.from_hf_config(cfg)
    model = build_llama("tiny-llama", **overrides)
    modules = dict(model.named_modules())
    seen = set()
    for u in spec.units("module") + spec.units("layer"):
        params = {id(p): p for m in u.modules for p in modules[m].parameters()}
        assert sum(p.numel() for p in params.values()) == u.num_params, u.name
        seen.update(params) if u.kind != "layer" else None
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert len(seen) == len(list(model.parameters()))  # module units cover every parameter


def test_bad_models_one_line():
    with pytest.raises(ModelSpecError, match="model must be one of llama-7b") as e:
        ModelSpec.preset("llama-8b")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelSpecError, match="'num_hidden_layers'"):
        ModelSpec.from_hf_config({"hidden_size": 8, "intermediate_size": 8,
                                  "num_attention_heads": 2, "vocab_size": 4})
    with pytest.raises(ModelSpecError, match="model_type 'gpt2'"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ModelSpecError, match="multiple of num_key_value_heads"):
        ModelSpec.from_hf_config(dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=2,
                                      vocab_size=4, head_dim=2))
    with pytest.raises(ModelSpecError, match="hidden_size must be an integer >= 1"):
        ModelSpec.from_hf_config(dict(hidden_size=-8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=4, head_dim=2))


def test_load_from_path(tmp_path):
    import json

    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(model_type="llama", hidden_size=8, intermediate_size=16,
                                 num_hidden_layers=1, num_attention_heads=2, vocab_size=10)))
    assert load_model_spec(config_path=p).num_params == 8 * 8 * 4 + 3 * 8 * 16 + 16 + 2 * 80 + 8
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        load_model_spec(config_path=tmp_path / "bad.json")
    with pytest.raises(ModelSpecError, match="cannot read"):
        load_model_spec(config_path=tmp_path / "missing.json")
