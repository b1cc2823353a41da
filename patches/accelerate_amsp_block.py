"""Accelerate's DeepSpeed plugin: leave the ds_config's ``"amsp"`` block alone.

Symptom (accelerate 1.15.0): ``accelerator.prepare`` (and so the HF Trainer) fails with
``ValueError: `amsp.plan` not found in kwargs. Please specify `amsp.plan` without `auto` ...``
for a ds_config whose amsp block has ``"plan": "auto"``.

[Note: cause]
``DeepSpeedPlugin.deepspeed_config_process`` walks the *whole* config and treats every
``"auto"`` value as a slot Accelerate must fill from the model, dataloader or arguments. The
``amsp`` block is AMSP's: its ``"auto"`` means "the AMSP planner chooses at start-up", and
Accelerate has nothing to fill there.

[Note: the fix]
``deepspeed_config_process`` runs with the top-level ``amsp`` entry taken out of the config and
puts it back afterwards (also on error). Nothing else changes.

Checked against accelerate 1.15.0.
"""

from __future__ import annotations

import functools
import warnings

NAME = "accelerate_amsp_block"
CHECKED_ACCELERATE_VERSIONS = ("1.15.0",)
_MARK = "_amsp_block_patch"


def apply() -> str:
    import accelerate
    from accelerate.utils import DeepSpeedPlugin

    if getattr(DeepSpeedPlugin.deepspeed_config_process, _MARK, False):
        return "already applied"
    if accelerate.__version__ not in CHECKED_ACCELERATE_VERSIONS:
        warnings.warn(f"{NAME}: accelerate {accelerate.__version__} is not among the checked "
                      f"versions {CHECKED_ACCELERATE_VERSIONS}; applying (it only hides the amsp "
                      f"block from deepspeed_config_process)")
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
