"""The interpreter start-up hook: AMSP in a worker whose script never imports amsp_ext.

``amsp_ext_startup.pth`` (installed into site-packages by ``pip install``, editable or not; see
setup.py) runs one line at every interpreter start:

    import os; os.environ.get("AMSP_STARTUP") != "0" and __import__(...startup...).activate()

``activate`` installs post-import hooks (import_hooks.py, no heavy import: about a millisecond):

- when the script imports ``deepspeed``: ``deepspeed.initialize`` is routed
  (patches/deepspeed_initialize.py), and ``deepspeed.zero.GatheredParameters`` gathers and
  writes AMSP parameters (patches/deepspeed_gathered_parameters.py). The routing reads each call's config: ``amsp.enabled``
  true runs AMSP, anything else calls DeepSpeed's own ``initialize`` untouched;
- when it imports ``accelerate``: the fixes of patches/accelerate_*.py, each acting only for a
  ds_config that carries an ``"amsp"`` block (amsp_ext.integrations.guard): the block hidden
  from Accelerate's "auto" filling, no ZeRO-3 ``zero.Init`` under AMSP, the real world on CPU,
  ``unwrap_model`` of the AMSP engine, and a one-line stop where Accelerate would drop DeepSpeed
  (and so AMSP) silently; ``accelerate launch`` checks the YAML's ds_config before any worker;
- when it imports ``transformers.modeling_utils``: ``from_pretrained`` builds on meta while an
  AMSP ds_config is in play, and each rank later reads only its share
  (patches/transformers_meta_load.py); when it imports ``peft``'s tuners, a model left on meta
  is filled before adapters are injected into it (patches/peft_meta_load.py); when it imports
  ``trl.distributed``, TRL sees AMSP's plan, not ZeRO-3, and when it imports
  ``trl.trainer.callbacks``, ``sync_ref_model`` writes every rank's shards, and when it imports
  ``trl.models.utils``, a generation gathers the policy once (patches/trl_amsp_backend.py); when it imports ``transformers.trainer``, an evaluation before training prepares a forward-only engine
  (patches/transformers_ds_inference.py).

[Note: why always, and no environment variable]
Whether a job runs AMSP is the ds_config's ``amsp.enabled`` and nothing else: plain DeepSpeed
scripts, the HF Trainer and Accelerate reach ``deepspeed.initialize`` from different places, and
only the config is common to them. An environment switch that one route needs and another does
not is a trap (a job silently ran ZeRO-3 although its config said AMSP). ``AMSP_STARTUP=0``
turns the hook off entirely (then ``amsp_ext.patch_deepspeed()`` is the explicit way).
``AMSP_STARTUP_VERBOSE=1`` prints what was patched.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV_OFF", "activate"]

ENV_OFF = "AMSP_STARTUP"

_active = False


def _say(what: str) -> None:
    if os.environ.get("AMSP_STARTUP_VERBOSE") == "1":
        print(f"[amsp] start-up hook: {what}", file=sys.stderr)


def _patch_deepspeed(_module) -> None:
    from amsp_ext.integrations.patches import deepspeed_gathered_parameters, deepspeed_initialize

    _say(f"deepspeed.initialize routing {deepspeed_initialize.apply()}")
    _say(f"deepspeed.zero.GatheredParameters on AMSP parameters {deepspeed_gathered_parameters.apply()}")


def _patch_accelerate(_module) -> None:
    from amsp_ext.integrations.patching import patch_accelerate

    _say(f"accelerate {patch_accelerate()}")


def _patch_transformers(_module) -> None:
    from amsp_ext.integrations.patches import transformers_meta_load

    _say(f"transformers from_pretrained {transformers_meta_load.apply()}")


def _patch_peft(_module) -> None:
    from amsp_ext.integrations.patches import peft_meta_load

    _say(f"peft inject_adapter {peft_meta_load.apply()}")


def _patch_trainer(module) -> None:
    from amsp_ext.integrations.patches import transformers_ds_inference

    _say(f"transformers deepspeed_init {transformers_ds_inference.apply()}")
    transformers_ds_inference.rebind_trainer(module)


def _patch_trl(_module) -> None:
    from amsp_ext.integrations.patches import trl_amsp_backend

    _say(f"trl DistributedBackend {trl_amsp_backend.apply()}")


def _patch_trl_callbacks(_module) -> None:
    from amsp_ext.integrations.patches import trl_amsp_backend

    _say(f"trl SyncRefModelCallback {trl_amsp_backend.apply_sync_ref()}")


def _patch_trl_generation(_module) -> None:
    from amsp_ext.integrations.patches import trl_amsp_backend

    _say(f"trl unwrap_model_for_generation {trl_amsp_backend.apply_generation()}")


def activate() -> bool:
    """Install the post-import hooks (idempotent: site processes a venv's ``lib`` and its
    ``lib64`` symlink as two site directories, so .pth lines may run twice)."""
    global _active
    if os.environ.get(ENV_OFF) == "0":
        return False
    if _active:
        return True
    from amsp_ext.integrations.import_hooks import when_imported

    _active = True
    when_imported("deepspeed", _patch_deepspeed)
    when_imported("accelerate", _patch_accelerate)
    when_imported("transformers.modeling_utils", _patch_transformers)
    when_imported("peft.tuners.tuners_utils", _patch_peft)
    when_imported("trl.distributed", _patch_trl)
    when_imported("trl.trainer.callbacks", _patch_trl_callbacks)
    when_imported("trl.models.utils", _patch_trl_generation)
    when_imported("transformers.trainer", _patch_trainer)
    return True
