"""``accelerator.unwrap_model(engine)`` gives the user's model back when the engine is AMSP's.

Symptom (accelerate 1.15.0, transformers 5.24.0): under AMSP, ``accelerator.prepare`` returns the
``AMSPDeepSpeedEngine``; ``accelerator.unwrap_model`` (and transformers' ``unwrap_model``)
returned that engine itself, not the model, so ``isinstance(unwrapped, PreTrainedModel)`` was
false and ``unwrapped.save_pretrained`` only reached the model through attribute pass-through.

[Note: cause]
``accelerate.utils.other.extract_model_from_parallel`` peels wrappers it knows by class
(DDP, DataParallel, ``deepspeed.DeepSpeedEngine``, FSDP). AMSP's engine is not a
``DeepSpeedEngine`` (it has none of its internals).

[Note: the fix]
``extract_model_from_parallel`` is wrapped: when the original returns an ``AMSPDeepSpeedEngine``
(the one case it cannot peel), its ``.module`` - the user's model, whose ``state_dict`` under
the DeepSpeed route is the full one (amsp_ext.runtime.engine [Note: state dicts on the
integration routes]) - is returned. The name is rebound where it was imported by name:
``accelerate.utils``, ``accelerate.accelerator`` and, when already imported,
``transformers.modeling_utils`` (imported later, it picks up the wrapped one from
``accelerate.utils``). Every other result is returned unchanged.

Checked against accelerate 1.15.0, transformers 5.24.0.
"""

from __future__ import annotations

import functools
import sys

NAME = "accelerate_unwrap"
_MARK = "_amsp_unwrap_patch"
_WHERE = ("accelerate.utils.other", "accelerate.utils", "accelerate.accelerator",
          "transformers.modeling_utils")


def _unwrap(original):
    @functools.wraps(original)
    def extract_model_from_parallel(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        if type(out).__name__ == "AMSPDeepSpeedEngine":
            from amsp_ext.integrations.engine import AMSPDeepSpeedEngine

            if isinstance(out, AMSPDeepSpeedEngine):
                return out.module
        return out

    setattr(extract_model_from_parallel, _MARK, True)
    return extract_model_from_parallel


def apply() -> str:
    import accelerate.utils.other as other

    if getattr(other.extract_model_from_parallel, _MARK, False):
        return "already applied"
    wrapped = _unwrap(other.extract_model_from_parallel)
    for name in _WHERE:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "extract_model_from_parallel"):
            setattr(mod, "extract_model_from_parallel", wrapped)
    return "applied"
