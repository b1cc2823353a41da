"""ModelSpec: exact per-module parameter counts of a Llama-style decoder.

The planner costs parameter sharding module by module (the K modules per layer that Eq. Tp sums
over), so it needs the exact size of every module, not ``12 L h^2``. The counts come from a
Hugging Face ``config.json`` (Llama architecture: RMSNorm, GQA attention with rotary embeddings,
SwiGLU MLP, tied or untied embeddings, optional biases) or from a preset of the original LLaMA
family.

[Note: sharding units]
The engine shards (and all-gathers) parameters in *units*; the planner must cost the same units.
With ``granularity="module"`` a decoder layer has eight units in forward order: the two RMSNorms
together (``norms``: they are tiny and would only add launch latency as units of their own),
then ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down`` (one per Linear, bias included). With
``granularity="layer"`` the whole layer is one unit. Outside the layers there are always
``embedding`` (first), ``final_norm`` and ``lm_head`` (last; absent when the embeddings are tied,
since the tied weight lives in ``embedding``). Unit names are the Hugging Face module paths of
``LlamaForCausalLM``, so the engine can map them onto ``named_modules()``.

This module is pure Python: the planner never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from amsp_ext.choices import GRANULARITIES

__all__ = [
    "MODEL_PRESETS",
    "ModelSpec",
    "ModelSpecError",
    "Unit",
    "load_model_spec",
]


# The original LLaMA family (Touvron et al. 2023, Table 2): published sizes 6.7B/13.0B/32.5B/65.2B.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40),
    "llama-30b": dict(hidden_size=6656, intermediate_size=17920, num_hidden_layers=60,
                      num_attention_heads=52),
    "llama-65b": dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=80,
                      num_attention_heads=64),
}
_PRESET_COMMON = dict(vocab_size=32000, tie_word_embeddings=False, model_type="llama")

# model_type -> (bias on q/k/v, bias on o) when the config has no ``attention_bias`` key.
_ATTN_BIAS_DEFAULT = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False)}


class ModelSpecError(ValueError):
    """A model that cannot be read. One line, naming the field."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One sharding unit: a display ``name``, its ``kind``, the HF module paths it covers
    (``modules``, as in ``LlamaForCausalLM.named_modules()``) and its parameter count."""

    name: str
    kind: str
    modules: tuple[str, ...]
    num_params: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_positions: int | None = None  # config.json max_position_embeddings (None: unknown)

    def check_seq_len(self, seq_len: int, *, flag: str = "--seq-len") -> None:
        """A sequence longer than the model's positions is refused (one line)."""
        if self.max_positions is not None and seq_len > self.max_positions:
            raise ModelSpecError(f"{flag} must be <= {self.max_positions} for {self.name} "
                                 f"(max_position_embeddings), got {seq_len}")

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelSpecError(f"model {self.name}: {f} must be an integer >= 1, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"model {self.name}: num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    # -- per-module sizes -----------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _layer_tensors(self) -> list[tuple[str, int, int]]:
        """``(unit kind, dim 0, elements per row)`` of every parameter tensor of one decoder
        layer, in forward order, as Hugging Face lays them out (a Linear's weight is out x in)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        qb, ob, mb = self.qkv_bias, self.o_bias, self.mlp_bias
        weights = [("norms", h, 1), ("norms", h, 1), ("q", q, h), ("k", kv, h), ("v", kv, h),
                   ("o", h, q), ("gate", i, h), ("up", i, h), ("down", h, i)]
        biases = [("q", q, 1)] * qb + [("k", kv, 1)] * qb + [("v", kv, 1)] * qb + [("o", h, 1)] * ob
        biases += [("gate", i, 1)] * mb + [("up", i, 1)] * mb + [("down", h, 1)] * mb
        return weights + biases

    def _outside_tensors(self) -> list[tuple[str, int, int]]:
        """The same for the tensors outside the decoder layers."""
        emb = ("embedding", self.vocab_size, self.hidden_size)
        lm_head = [] if self.tie_word_embeddings else [("lm_head", self.vocab_size, self.hidden_size)]
        return [emb, ("final_norm", self.hidden_size, 1), *lm_head]

    @staticmethod
    def _per_kind(tensors: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        out: dict[str, int] = {}
        for kind, d0, row in tensors:
            out[kind] = out.get(kind, 0) + d0 * row
        return list(out.items())

    def layer_module_params(self) -> list[tuple[str, int]]:
        """``(kind, params)`` of one decoder layer's units at module granularity, forward order."""
        return self._per_kind(self._layer_tensors())

    @property
    def params_per_layer(self) -> int:
        return sum(n for _, n in self.layer_module_params())

    def outside_params(self) -> list[tuple[str, int]]:
        """``(kind, params)`` of the units outside the decoder layers, forward order."""
        return self._per_kind(self._outside_tensors())

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + sum(n for _, n in self.outside_params())

    def padded_params(self, shards: int) -> int:
        """The model's size as ``shards``-way sharding stores it: every tensor's dim 0 split into
        ``shards`` equal parts, padded up to a multiple of ``shards`` (memory.py [Note: FSDP2's
        padding]); ``num_params`` where every dim 0 divides."""
        def stored(tensors: list[tuple[str, int, int]]) -> int:
            return sum(-(-d0 // shards) * shards * row for _, d0, row in tensors)

        return self.num_layers * stored(self._layer_tensors()) + stored(self._outside_tensors())

    def layer_units(self, granularity: str) -> list[tuple[str, int]]:
        """One layer's ``(kind, params)`` template at ``granularity`` (every layer is the same)."""
        _check_granularity(granularity)
        if granularity == "layer":
            return [("layer", self.params_per_layer)]
        return self.layer_module_params()

    def units(self, granularity: str) -> list[Unit]:
        """Every module group of the model in forward order, named by HF module path: the layers'
        sharding units and, apart, the embedding, final norm and lm_head, which the engine
        shards as ONE root unit (runtime/sync/units.py [Note: one root unit]; its collectives:
        issued.py ``unit_gathers``)."""
        _check_granularity(granularity)
        paths = {
            "layer": ("",), "norms": ("input_layernorm", "post_attention_layernorm"),
            "q": ("self_attn.q_proj",), "k": ("self_attn.k_proj",), "v": ("self_attn.v_proj",),
            "o": ("self_attn.o_proj",), "gate": ("mlp.gate_proj",), "up": ("mlp.up_proj",),
            "down": ("mlp.down_proj",),
        }
        outside = dict(self.outside_params())

        def unit(kind: str, modules: tuple[str, ...], n: int) -> Unit:
            return Unit(name="+".join(modules), kind=kind, modules=modules, num_params=n)

        units = [unit("embedding", ("model.embed_tokens",), outside["embedding"])]
        for li in range(self.num_layers):
            prefix = f"model.layers.{li}"
            for kind, n in self.layer_units(granularity):
                mods = tuple(f"{prefix}.{m}" if m else prefix for m in paths[kind])
                units.append(unit(kind, mods, n))
        units.append(unit("final_norm", ("model.norm",), outside["final_norm"]))
        if "lm_head" in outside:
            units.append(unit("lm_head", ("lm_head",), outside["lm_head"]))
        return units

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face Llama-style ``config.json`` dict."""
        if not isinstance(config, Mapping):
            raise ModelSpecError(f"model config must be a JSON object, got {type(config).__name__}")
        label = name or str(config.get("_name_or_path") or config.get("model_type") or "config")
        model_type = str(config.get("model_type", "llama"))
        if model_type not in _ATTN_BIAS_DEFAULT:
            raise ModelSpecError(
                f"model {label}: model_type {model_type!r} is not Llama-style; allowed: "
                f"{', '.join(_ATTN_BIAS_DEFAULT)}"
            )

        def need(key: str) -> int:
            if key not in config:
                raise ModelSpecError(f"model {label}: config.json has no {key!r}")
            return count(key)

        def count(key: str) -> int:  # checked under the name the config.json uses
            v = config[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelSpecError(f"model {label}: config.json {key} must be an integer >= 1, got {v!r}")
            return v

        h, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = count("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
        if config.get("head_dim") is not None:
            head_dim = count("head_dim")
        elif h % heads:
            raise ModelSpecError(f"model {label}: config.json hidden_size={h} must be a multiple of "
                                 f"num_attention_heads={heads} (or give head_dim)")
        else:
            head_dim = h // heads
        if heads % kv_heads:
            raise ModelSpecError(f"model {label}: config.json num_attention_heads={heads} must be a "
                                 f"multiple of num_key_value_heads={kv_heads}")
        qkv_b, o_b = _ATTN_BIAS_DEFAULT[model_type]
        if "attention_bias" in config:
            qkv_b = o_b = bool(config["attention_bias"])
        return cls(
            name=label,
            hidden_size=h,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_b,
            o_bias=o_b,
            mlp_bias=bool(config.get("mlp_bias", False)),
            max_positions=count("max_position_embeddings") if config.get("max_position_embeddings") is not None else None,
        )

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        if name not in MODEL_PRESETS:
            raise ModelSpecError(
                f"model must be one of {', '.join(MODEL_PRESETS)} (or --model-config PATH), "
                f"got {name!r}"
            )
        return cls.from_hf_config({**_PRESET_COMMON, **MODEL_PRESETS[name]}, name=name)


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ModelSpecError(
            f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"
        )


def load_model_spec(model: str | None = None, config_path: str | Path | None = None) -> ModelSpec:
    """A preset name or a path to a Hugging Face ``config.json`` (exactly one of the two)."""
    if (model is None) == (config_path is None):
        raise ModelSpecError("give exactly one of model (a preset) or model config path")
    if model is not None:
        return ModelSpec.preset(model)
    path = Path(config_path)
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise ModelSpecError(f"model config {path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSpecError(f"model config {path}: not valid JSON "
                             f"({getattr(e, 'msg', e)}, line {getattr(e, 'lineno', '?')})") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"model config {path}: must be a JSON object, got {type(config).__name__}")
    return ModelSpec.from_hf_config(config, name=path.parent.name or path.name)
