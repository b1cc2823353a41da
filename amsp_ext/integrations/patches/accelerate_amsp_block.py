"""Accelerate's DeepSpeed config under AMSP: leave the ``"amsp"`` block alone, and do not act on
the ZeRO stage that AMSP's plan replaces.

Symptoms (accelerate 1.15.0, transformers 5.24.0):
1. ``accelerator.prepare`` (and so the HF Trainer) fails with ``ValueError: `amsp.plan` not found
   in kwargs. Please specify `amsp.plan` without `auto` ...`` for a ds_config whose amsp block
   has ``"plan": "auto"``.
2. A ds_config that keeps ``"zero_optimization": {"stage": 3}`` next to ``amsp.enabled`` (what
   ``amsp migrate`` writes, so that ``"enabled": false`` runs ZeRO-3 again) makes
   ``is_deepspeed_zero3_enabled()`` true: transformers then builds models inside
   ``deepspeed.zero.Init`` (parameters partitioned by DeepSpeed before AMSP sees them) and
   Accelerate turns on its ZeRO-3 init.

[Note: cause]
``DeepSpeedPlugin.deepspeed_config_process`` walks the *whole* config and treats every
``"auto"`` value as a slot Accelerate must fill from the model, dataloader or arguments. The
``amsp`` block is AMSP's: its ``"auto"`` means "the AMSP planner chooses at start-up", and
Accelerate has nothing to fill there.

[Note: the fix]
1. ``DeepSpeedPlugin.deepspeed_config_process`` runs with the top-level ``amsp`` entry taken out
   of the config and puts it back afterwards (also on error).
2. ``HfDeepSpeedConfig.set_stage_and_offload`` (accelerate's, which transformers' subclasses and
   which answers ``is_zero3()`` / ``is_offload()``) records stage 0 and no offload when the
   config's ``amsp.enabled`` is true. The config dict itself keeps its ZeRO keys.

Checked against accelerate 1.15.0.
"""

from __future__ import annotations

import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "accelerate_amsp_block"
CHECKED_ACCELERATE_VERSIONS = ("1.15.0",)
_MARK = "_amsp_block_patch"


def _patch_stage() -> None:
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    original = HfDeepSpeedConfig.set_stage_and_offload

    @functools.wraps(original)
    def set_stage_and_offload(self):
        original(self)
        from amsp_ext.integrations.guard import note
        from amsp_ext.integrations.settings import amsp_enabled

        note(self.config)  # the Accelerate fixes act for this config (guard.amsp_block_in_play)
        if amsp_enabled(self.config):
            self._stage, self._offload = 0, False  # AMSP's plan replaces ZeRO: no zero.Init

    setattr(set_stage_and_offload, _MARK, True)
    HfDeepSpeedConfig.set_stage_and_offload = set_stage_and_offload


def apply() -> str:
    import accelerate
    from accelerate.utils import DeepSpeedPlugin

    if getattr(DeepSpeedPlugin.deepspeed_config_process, _MARK, False):
        return "already applied"
    _patch_stage()
    warn_unchecked(NAME, "accelerate", accelerate.__version__, CHECKED_ACCELERATE_VERSIONS,
                   "applying (it only hides the amsp "
                   "block from deepspeed_config_process)")
    original = DeepSpeedPlugin.deepspeed_config_process

    @functools.wraps(original)
    def deepspeed_config_process(self, prefix="", mismatches=None, config=None, must_match=True,
                                 **kwargs):
        top = config is None and prefix == ""
        cfg = self.deepspeed_config if top else None
        block = cfg.pop("amsp", None) if isinstance(cfg, dict) else None
        try:
            return original(self, prefix=prefix, mismatches=mismatches, config=config,
                            must_match=must_match, **kwargs)
        finally:
            if block is not None:
                cfg["amsp"] = block

    setattr(deepspeed_config_process, _MARK, True)
    DeepSpeedPlugin.deepspeed_config_process = deepspeed_config_process
    return f"applied (accelerate {accelerate.__version__})"
