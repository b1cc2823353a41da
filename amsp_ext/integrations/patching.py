"""``amsp_ext.patch_deepspeed()``: route ``deepspeed.initialize`` to AMSP for configs whose
``amsp.enabled`` is true, and, with Accelerate installed, apply its AMSP fixes.

The start-up hook (startup.py) does the same on import of ``deepspeed`` / ``accelerate``; this
is the explicit way (a dev checkout on ``PYTHONPATH``, or ``AMSP_STARTUP=0``). The patches live
under ``patches/`` (each states the versions it was checked against) and each acts only for a
ds_config that carries an ``"amsp"`` block.
"""

from __future__ import annotations

import importlib

__all__ = ["patch_accelerate", "patch_deepspeed", "unpatch_deepspeed"]


def patch_accelerate() -> dict[str, str]:
    """Accelerate's fixes under AMSP (idempotent); ``{patch name: what happened}``."""
    from amsp_ext.integrations.patches import (accelerate_amsp_block, accelerate_amsp_guard, accelerate_deepspeed_cpu_state,
                         accelerate_unwrap)

    return {mod.NAME: mod.apply()
            for mod in (accelerate_deepspeed_cpu_state, accelerate_amsp_block, accelerate_unwrap,
                        accelerate_amsp_guard)}


def patch_deepspeed() -> dict[str, str]:
    """Apply the routing (and, when Accelerate is installed, its fixes); idempotent.

    Returns ``{patch name: what happened}``.
    """
    from amsp_ext.integrations.patches import deepspeed_gathered_parameters, deepspeed_initialize

    done = {deepspeed_initialize.NAME: deepspeed_initialize.apply(),
            deepspeed_gathered_parameters.NAME: deepspeed_gathered_parameters.apply()}
    try:
        from amsp_ext.integrations.patches import transformers_meta_load

        done[transformers_meta_load.NAME] = transformers_meta_load.apply()
    except ImportError:
        pass
    for name in ("peft_meta_load", "trl_amsp_backend", "transformers_ds_inference"):
        try:
            module = importlib.import_module(f"amsp_ext.integrations.patches.{name}")
            done[module.NAME] = module.apply()
            if name == "trl_amsp_backend":
                done["trl_sync_ref_model"] = module.apply_sync_ref()
                done["trl_generation"] = module.apply_generation()
        except ImportError:  # peft / trl / transformers not installed
            pass
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return done
    done.update(patch_accelerate())
    return done


def unpatch_deepspeed() -> None:
    """Put the original ``deepspeed.initialize`` back (the Accelerate fixes stay)."""
    from amsp_ext.integrations.patches import deepspeed_initialize

    deepspeed_initialize.restore()
