"""Route ``deepspeed.initialize`` to ``amsp_ext.initialize`` when the config asks for AMSP
(an ``"amsp"`` block whose ``enabled`` is not false: settings.amsp_enabled).

Checked against DeepSpeed 0.18.9 (torch 2.13.0, accelerate 1.15.0, transformers 5.24.0).

[Note: what is replaced, and who sees it]
``deepspeed.initialize`` (the module attribute) is replaced by a wrapper with the same signature.
Callers that look it up at call time see the wrapper: Accelerate's ``_prepare_deepspeed`` (which
the HF Trainer goes through) does ``import deepspeed; deepspeed.initialize(...)``, and scripts
calling ``deepspeed.initialize(...)`` do too. A name imported with ``from deepspeed import
initialize`` *before* the patch keeps the original; the start-up hook (amsp_ext.integrations.
startup) patches right after ``deepspeed`` is imported, so that case is covered there.

The wrapper finds the config as DeepSpeed does (``config``, ``config_params``, or
``args.deepspeed_config``; dict, path or JSON string). When it asks for AMSP it initialises
DeepSpeed's comm layer (so ``deepspeed.comm`` works in the user's script, as after a real
``deepspeed.initialize``) and returns ``amsp_ext.initialize(...)``; otherwise it calls the original,
untouched. ``restore()`` puts the original back.
"""

from __future__ import annotations

import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "deepspeed_initialize"
CHECKED_DEEPSPEED_VERSIONS = ("0.18.9",)
_MARK = "_amsp_routed"


def _route(original):
    @functools.wraps(original)
    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                   collate_fn=None, config=None, mesh_param=None, config_params=None):
        from amsp_ext.integrations.ds_initialize import resolve_config
        from amsp_ext.integrations.settings import amsp_enabled

        kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                      training_data=training_data, lr_scheduler=lr_scheduler,
                      distributed_port=distributed_port, mpu=mpu,
                      dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                      mesh_param=mesh_param, config_params=config_params)
        try:
            cfg = resolve_config(args, config, config_params)
        except ValueError:
            return original(**kwargs)  # DeepSpeed reports its own config errors
        if not amsp_enabled(cfg):
            return original(**kwargs)
        import torch.distributed as tdist
        from deepspeed import comm as ds_comm
        from deepspeed.accelerator import get_accelerator

        if not tdist.is_initialized() and dist_init_required is not False:
            ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                     distributed_port=distributed_port,
                                     dist_init_required=dist_init_required)
        elif tdist.is_initialized() and not ds_comm.is_initialized():
            ds_comm.init_distributed(dist_backend=tdist.get_backend(), dist_init_required=False)
        from amsp_ext.integrations.ds_initialize import initialize as amsp_initialize

        # as given (a path stays a path): AMSP reads it again and names it in its messages
        return amsp_initialize(**kwargs)

    setattr(initialize, _MARK, original)
    return initialize


def apply() -> str:
    import deepspeed

    if getattr(deepspeed.initialize, _MARK, None) is not None:
        return "already applied"
    warn_unchecked(NAME, "DeepSpeed", deepspeed.__version__, CHECKED_DEEPSPEED_VERSIONS,
                   "routing deepspeed.initialize anyway (same "
                   "signature checked at call time)")
    deepspeed.initialize = _route(deepspeed.initialize)
    return f"applied (DeepSpeed {deepspeed.__version__})"


def restore() -> None:
    import deepspeed

    original = getattr(deepspeed.initialize, _MARK, None)
    if original is not None:
        deepspeed.initialize = original
