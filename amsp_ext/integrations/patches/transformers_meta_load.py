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

[Note: which from_pretrained loads on meta]
Only a model on its way to an engine may be an empty shell; every other model a script loads
(a reload of what it saved, a model it evaluates, a teacher or reward model it calls itself)
must be the model transformers loads. ``from_pretrained`` cannot see where its model goes, so:
1. Once this process has built an AMSP engine, ``from_pretrained`` loads as usual: a job loads
   the models it trains and the frozen ones beside them (TRL's reference and reward models)
   before training starts, and what it loads after - the reloads after ``save_pretrained``,
   ``save_model``, ``load_best_model_at_end``, a PEFT base to attach a saved adapter to - is
   used directly.
2. A model built on meta stays pending until ``amsp_ext.initialize`` takes it (``adopt``).
   Used before that, it is first filled whole from its folder: its forward (a forward pre-hook:
   ``model(...)``, and ``generate``, which reads the model's device before its first forward),
   ``.to()``/``.cuda()``/dtype casts (``_apply``) and ``state_dict()`` (and so
   ``save_pretrained``). The fill is transformers' own load of the same folder with the same
   arguments; its tensors replace the meta ones module by module (ties kept, ``requires_grad``
   kept), and the model is an ordinary model from then on. ``parameters()`` and
   ``named_parameters()`` are not a use: frameworks walk them to build optimizer groups before
   ``initialize`` (the HF Trainer does), and filling there would load every trained model whole.
   Their values stay meta until a use above; reading one fails loudly (``meta tensors``).

Checked against transformers 5.24.0.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping
from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "transformers_meta_load"
CHECKED_TRANSFORMERS_VERSIONS = ("5.24.0",)
_MARK = "_amsp_meta_load_patch"
INIT_FROM_ATTR = "_amsp_init_from"
_PENDING = "_amsp_pending_load"  # (load, hook handle): how to fill the model whole


def _engine_built() -> bool:
    """An AMSP engine exists or existed in this process ([Note: which from_pretrained loads on
    meta], rule 1); the engine module is not imported for the question."""
    engine = sys.modules.get("amsp_ext.runtime.engine")
    return engine is not None and engine.Engine.built > 0


class PendingLoad:
    """Mixed into a meta-loaded model's class until an engine adopts it or it is used (rule 2)."""

    def _apply(self, *args, **kwargs):
        fill_whole(self)
        return self._apply(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        fill_whole(self)
        return self.state_dict(*args, **kwargs)

    def generate(self, *args, **kwargs):
        fill_whole(self)
        return self.generate(*args, **kwargs)


def _fill_before_forward(module, args) -> None:
    fill_whole(module)


def _make_pending(model, load) -> None:
    cls = type(model)
    handle = model.register_forward_pre_hook(_fill_before_forward, prepend=True)
    model.__dict__[_PENDING] = (load, handle)
    # the class keeps its name: transformers writes type(model).__name__ into config.json
    model.__class__ = type(cls.__name__, (PendingLoad, cls), {"__qualname__": cls.__qualname__})


def _stop_pending(model) -> Any:
    load, handle = model.__dict__.pop(_PENDING)
    handle.remove()
    model.__class__ = next(c for c in type(model).__mro__ if not issubclass(c, PendingLoad))
    return load


def adopt(model) -> str | None:
    """``amsp_ext.initialize`` takes ``model``: no fill from here on (the engine reads each rank's
    share); returns the folder to read, or None for a model that was not loaded on meta."""
    if _PENDING in getattr(model, "__dict__", {}):
        _stop_pending(model)
    return getattr(model, INIT_FROM_ATTR, None)


def fill_whole(model) -> None:
    """Rule 2: the tensors transformers loads from the model's folder, in place of the meta ones."""
    import torch

    if _PENDING not in model.__dict__:
        return
    load = _stop_pending(model)
    loaded = load()
    source = dict(loaded.named_modules(remove_duplicate=False))
    with torch.no_grad():
        for name, m in model.named_modules(remove_duplicate=False):
            lm = source.get(name)
            if lm is None:  # a module added after the load (it was never in the folder)
                continue
            new_params = dict(lm.named_parameters(recurse=False, remove_duplicate=False))
            for k, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
                if k in new_params:
                    new_params[k].requires_grad_(p.requires_grad)
                    setattr(m, k, new_params[k])  # the same object where the load tied it
            new_buffers = dict(lm.named_buffers(recurse=False, remove_duplicate=False))
            for k, _ in list(m.named_buffers(recurse=False, remove_duplicate=False)):
                if k in new_buffers:
                    setattr(m, k, new_buffers[k])  # keeps the buffer's persistence
    model.__dict__.pop(INIT_FROM_ATTR, None)


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
    warn_unchecked(NAME, "transformers", transformers.__version__, CHECKED_TRANSFORMERS_VERSIONS,
                   "applying (it only adds "
                   "device_map='meta' under an AMSP ds_config)")
    original = cls.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(klass, pretrained_model_name_or_path, *args, **kwargs):
        folder = None
        if "device_map" not in kwargs and not _engine_built() and _amsp_config_in_play():
            folder = _safetensors_folder(pretrained_model_name_or_path)
        if folder is None:
            return original(klass, pretrained_model_name_or_path, *args, **kwargs)
        model = original(klass, pretrained_model_name_or_path, *args, device_map="meta", **kwargs)
        setattr(model, INIT_FROM_ATTR, str(folder))
        _make_pending(model, functools.partial(original, klass, pretrained_model_name_or_path,
                                               *args, **kwargs))
        return model

    setattr(from_pretrained, _MARK, True)
    cls.from_pretrained = classmethod(from_pretrained)
    return f"applied (transformers {transformers.__version__})"
