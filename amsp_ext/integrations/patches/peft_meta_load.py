"""PEFT wraps a model that ``from_pretrained`` left on meta: the base is filled first.

Symptom (peft 0.21.2): under an AMSP ds_config, ``get_peft_model(model, LoraConfig(...))`` or
``PeftModel.from_pretrained(base, adapter)`` of a model built on meta and not yet taken by an
engine (patches/transformers_meta_load.py) creates every adapter weight on meta, the base
layer's device; the forward then adds those empty tensors to the real base output and returns
wrong logits, with no error.

The fix: ``BaseTuner.inject_adapter`` (which both reach) fills a pending model whole from its
folder first ([Note: which from_pretrained loads on meta], rule 2), so the adapters are created
beside real weights and the wrapped model is the one PEFT builds without AMSP. Such a model
reaches ``initialize`` whole and is broadcast like any model built on a device.

Checked against peft 0.21.2.
"""

from __future__ import annotations

import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "peft_meta_load"
CHECKED_PEFT_VERSIONS = ("0.21.2",)
_MARK = "_amsp_peft_meta_load_patch"


def apply() -> str:
    import peft
    from peft.tuners.tuners_utils import BaseTuner

    if getattr(BaseTuner.inject_adapter, _MARK, False):
        return "already applied"
    warn_unchecked(NAME, "peft", peft.__version__, CHECKED_PEFT_VERSIONS,
                   "applying (it only fills a model left on meta "
                   "before adapters are injected)")
    original = BaseTuner.inject_adapter

    @functools.wraps(original)
    def inject_adapter(self, model, *args, **kwargs):
        from amsp_ext.integrations.patches.transformers_meta_load import fill_whole

        fill_whole(model)
        return original(self, model, *args, **kwargs)

    setattr(inject_adapter, _MARK, True)
    BaseTuner.inject_adapter = inject_adapter
    return f"applied (peft {peft.__version__})"
