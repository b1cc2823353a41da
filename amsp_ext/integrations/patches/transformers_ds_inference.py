"""``Trainer.evaluate()`` / ``predict()`` before ``train()`` under AMSP.

Symptom (transformers 5.24.0): with a ds_config whose ``amsp.enabled`` is true, an evaluation
before any training stops in ``deepspeed_init(trainer, 0, inference=True)`` with
``ValueError: ZeRO inference only makes sense with ZeRO Stage 3``: AMSP's plan replaces ZeRO,
so the config answers stage 0 (patches/accelerate_amsp_block.py).

[Note: the fix]
Under AMSP the inference branch runs without the stage check: the training-only blocks leave
the config, as there, and no optimizer or scheduler is made, so the Trainer's
``accelerator.prepare`` reaches ``deepspeed.initialize`` without an optimizer and gets a
forward-only engine sharded by the plan's p factors (runtime/sync/grad_sync.py [Note: a model
without an optimizer]). When the same Trainer trains later, ``amsp_ext.initialize`` takes that
engine off the model (runtime/replan/switch.py ``release_forward_only``) and shards it for
training. ``deepspeed_init`` is rebound where the Trainer imported it too.

Checked against transformers 5.24.0.
"""

from __future__ import annotations

import functools
import sys

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "transformers_ds_inference"
CHECKED_TRANSFORMERS_VERSIONS = ("5.24.0",)
_MARK = "_amsp_ds_inference_patch"


def _wrap(original):
    @functools.wraps(original)
    def deepspeed_init(trainer, num_training_steps, inference=False):
        from amsp_ext.integrations.settings import amsp_enabled

        hf = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
        if not (inference and amsp_enabled(hf.config)):
            return original(trainer, num_training_steps, inference=inference)
        hf.trainer_config_finalize(trainer.args, trainer.model, num_training_steps)
        hf.del_config_sub_tree("optimizer")  # as the inference branch does: no training blocks
        hf.del_config_sub_tree("lr_scheduler")
        return None, None

    setattr(deepspeed_init, _MARK, original)
    return deepspeed_init


def rebind_trainer(module=None) -> None:
    """The Trainer module's own name for ``deepspeed_init`` (it imported the function)."""
    import transformers.integrations.deepspeed as ds

    trainer = module or sys.modules.get("transformers.trainer")
    if trainer is not None and getattr(trainer, "deepspeed_init", None) is not ds.deepspeed_init:
        trainer.deepspeed_init = ds.deepspeed_init


def apply() -> str:
    import transformers
    import transformers.integrations.deepspeed as ds

    if getattr(ds.deepspeed_init, _MARK, None) is not None:
        rebind_trainer()
        return "already applied"
    warn_unchecked(NAME, "transformers", transformers.__version__, CHECKED_TRANSFORMERS_VERSIONS,
                   "applying (it only lets evaluation "
                   "before training prepare a forward-only engine under AMSP)")
    ds.deepspeed_init = _wrap(ds.deepspeed_init)
    rebind_trainer()
    return f"applied (transformers {transformers.__version__})"
