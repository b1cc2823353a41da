"""``from_pretrained`` under AMSP loads like it does under ZeRO-3: no rank holds the whole model.

Symptom (transformers 5.24.0): with a ds_config whose ``amsp.enabled`` is true, the ZeRO stage is
hidden from transformers (patches/accelerate_amsp_block.py), so ``from_pretrained`` no longer
builds inside ``deepspeed.zero.Init``: every rank read the whole checkpoint into host memory
(eight copies of a 65B model on one node) before ``deepspeed.initialize`` sharded it.

[Note: the fix]
While a ds_config with ``amsp.enabled`` is in play - the active ``HfDeepSpeedConfig`` (the HF
Trainer's ``TrainingArguments(deepspeed=...)``, or one the script builds, as the HF docs ask of
ZeRO-3 users), or the config ``accelerate launch`` handed this worker -
``PreTrainedModel.from_pretrained`` of a local folder of safetensors files runs with
``device_map="meta"``: the model is built with every tensor on meta, the configuration and the
tensors' names and shapes read as usual, no weight read. The folder is recorded on the model
(``_amsp_init_from``); ``amsp_ext.initialize`` (which ``deepspeed.initialize``, Accelerate's
``prepare`` and the Trainer reach) hands it to ``shard(init_from=...)``, and each rank reads
only the rows its plan keeps (runtime/materialize.py).

Left alone: a ``device_map`` the script passes, a Hub name (never downloaded here) and a folder
without safetensors weights (``.bin`` pickles: loaded the old way, with a one-line warning
naming the conversion).

Checked against transformers 5.24.0.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Mapping

NAME = "transformers_meta_load"
CHECKED_TRANSFORMERS_VERSIONS = ("5.24.0",)
_MARK = "_amsp_meta_load_patch"
INIT_FROM_ATTR = "_amsp_init_from"


def _amsp_config_in_play() -> bool:
    from amsp_ext.integrations.guard import config_from_env
    from amsp_ext.integrations.settings import amsp_enabled

    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        deepspeed_config = None
    cfg: Any = deepspeed_config() if deepspeed_config is not None else None  # the active dict
    cfg = getattr(cfg, "config", cfg)
    if not isinstance(cfg, Mapping):
        env = config_from_env()
        cfg = env[1] if env is not None else None
    return isinstance(cfg, Mapping) and isinstance(cfg.get("amsp"), Mapping) and amsp_enabled(cfg)


def _safetensors_folder(path: Any) -> Path | None:
    from amsp_ext.runtime.state.safetensors_folder import INDEX_NAME, WEIGHTS_NAME

    try:
        p = Path(path)
    except TypeError:
        return None
    if not p.is_dir():
        return None
    if (p / WEIGHTS_NAME).is_file() or (p / INDEX_NAME).is_file():
        return p.resolve()
    if any(p.glob("*.bin")):
        warnings.warn(f"amsp: {p} holds pickled (.bin) weights, so every rank loads them whole; "
                      f"save them once as safetensors (save_pretrained(..., safe_serialization="
                      f"True)) for each rank to read only its share", stacklevel=3)
    return None


def apply() -> str:
    import transformers
    from transformers import modeling_utils

    cls = modeling_utils.PreTrainedModel
    if getattr(cls.from_pretrained, _MARK, False):
        return "already applied"
    if transformers.__version__ not in CHECKED_TRANSFORMERS_VERSIONS:
        warnings.warn(f"{NAME}: transformers {transformers.__version__} is not among the checked "
                      f"versions {CHECKED_TRANSFORMERS_VERSIONS}; applying (it only adds "
                      f"device_map='meta' under an AMSP ds_config)")
    original = cls.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(klass, pretrained_model_name_or_path, *args, **kwargs):
        folder = None
        if "device_map" not in kwargs and _amsp_config_in_play():
            folder = _safetensors_folder(pretrained_model_name_or_path)
        if folder is None:
            return original(klass, pretrained_model_name_or_path, *args, **kwargs)
        model = original(klass, pretrained_model_name_or_path, *args, device_map="meta", **kwargs)
        setattr(model, INIT_FROM_ATTR, str(folder))
        return model

    setattr(from_pretrained, _MARK, True)
    cls.from_pretrained = classmethod(from_pretrained)
    return f"applied (transformers {transformers.__version__})"
