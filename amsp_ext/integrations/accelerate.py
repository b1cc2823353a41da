"""The explicit Accelerate route: ``amsp_ext.accelerate.Accelerator``.

    from amsp_ext.accelerate import Accelerator
    accelerator = Accelerator(amsp={"plan": "auto", "seq_len": 4096}, gradient_accumulation_steps=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the rest of the Accelerate loop is unchanged

[Note: one mechanism, two switches]
This class is ``accelerate.Accelerator`` in DeepSpeed mode with a ds_config that carries an
``"amsp"`` block, and with ``deepspeed.initialize`` routed to AMSP (``patch_deepspeed``) - the
same path as the config route (``accelerate launch --config_file configs/accelerate/amsp.yaml``),
switched on in code instead of by the launcher. So everything Accelerate does for DeepSpeed
holds: ``accelerator.backward`` calls ``engine.backward`` (1/GAS) and, at the accumulation
boundary, ``engine.step``; ``optimizer.step()``/``zero_grad()`` and ``scheduler.step()`` in the
script are no-ops; ``accelerator.clip_grad_norm_`` returns the engine's global norm, and the
clipping threshold is the config's ``gradient_clipping`` (Accelerate fills ``"auto"`` with
1.0), not the ``max_norm`` the script passes - as under DeepSpeed; ``save_state``/``load_state``
write and read the engine's sharded checkpoint (``engine.save_checkpoint``), so no main-process
optimizer state file is involved; ``get_state_dict`` returns the consolidated weights.

It works under ``accelerate launch`` (any config) and plain ``torchrun``. On CPU it relies on the
PartialState fix of patches/accelerate_deepspeed_cpu_state.py, which ``patch_deepspeed`` applies.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import accelerate

from amsp_ext.integrations.patching import patch_deepspeed
from amsp_ext.integrations.settings import AMSPSettings, load_ds_config

__all__ = ["Accelerator", "amsp_deepspeed_config"]

_DEFAULT_DS = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 0},  # Accelerate requires the block; AMSP's plan replaces it
}


def amsp_deepspeed_config(amsp: Mapping[str, Any] | None = None, deepspeed_config: Any = None) -> dict:
    """A ds_config for Accelerate's DeepSpeed plugin with ``amsp.enabled`` set (validated)."""
    cfg = load_ds_config(deepspeed_config) if deepspeed_config is not None else copy.deepcopy(_DEFAULT_DS)
    cfg.setdefault("zero_optimization", {"stage": 0})
    block = {**(cfg.get("amsp") or {}), **(amsp or {}), "enabled": True}
    AMSPSettings.from_dict(block)  # one-line errors now, not at prepare()
    cfg["amsp"] = block
    return cfg


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose DeepSpeed mode runs AMSP (see the module docstring).

    ``amsp``: the ``"amsp"`` block (``enabled`` is implied). ``deepspeed_config``: a ds_config
    dict or path for the DeepSpeed keys (batch, precision, clipping, optimizer, scheduler);
    default: everything ``"auto"``, filled by Accelerate from the dataloader and arguments.
    """

    def __init__(self, *args, amsp: Mapping[str, Any] | None = None, deepspeed_config: Any = None,
                 **kwargs) -> None:
        if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None:
            raise ValueError("amsp_ext.accelerate.Accelerator builds its own deepspeed_plugin; pass "
                             "amsp= and deepspeed_config= instead")
        cfg = amsp_deepspeed_config(amsp, deepspeed_config)
        patch_deepspeed()
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=cfg)
        super().__init__(*args, **kwargs)
