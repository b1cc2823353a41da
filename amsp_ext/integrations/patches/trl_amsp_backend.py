"""TRL under AMSP: the ZeRO stage of the DeepSpeed plugin is not what runs.

Symptom (trl 1.16.0): with a ds_config whose ``amsp.enabled`` is true next to the user's
``"zero_optimization": {"stage": 3}``, TRL's ``DistributedBackend`` reads the plugin's stage (3)
and takes DeepSpeed ZeRO-3's paths: GRPO's generation runs inside
``deepspeed.zero.GatheredParameters`` after removing DeepSpeed's hooks from the engine
(``AttributeError: 'AMSPOptimizer' object has no attribute 'module'``), and ``gather_params``
wraps adapter merges and reference syncs in DeepSpeed's gather, which knows nothing of AMSP's
shards.

[Note: the fix]
``DistributedBackend`` records stage 0 when the accelerator's DeepSpeed config has
``amsp.enabled``: AMSP's plan replaces ZeRO, as transformers is told through
``is_deepspeed_zero3_enabled()`` (patches/accelerate_amsp_block.py). TRL then generates with the
unwrapped AMSP model and its ``gather_params`` is a no-op: the policy and its reference share
a plan, so a parameter's local shards line up one to one.

[Note: generation gathers once]
At stage 0 TRL's ``unwrap_model_for_generation`` yields the model as it is, and with sp > 1
every unit's forward gathers its parameters again: one all-gather per unit per generated token
(GRPO, 4 new tokens: 20 all-gathers for 4 units where DeepSpeed ZeRO-3 gathers once). Under
AMSP, with ``gather_deepspeed3_params`` true (TRL's default, ``ds3_gather_for_generation``), the
generation runs inside ``GatheredParameters`` over the policy's parameters
(integrations/gathered.py): each unit is gathered once for the whole ``generate`` and
resharded after it, as ZeRO-3's route does, holding the whole model on every rank meanwhile.
With it false, the model is yielded as it is (DeepSpeed's choice too: less memory, a gather
per unit per token).

The same holds for ``SyncRefModelCallback.sync_target_model`` (DPO's ``sync_ref_model``), which
reads the plugin's stage itself: at stage 3 it wraps the write in DeepSpeed's
``GatheredParameters(..., modifier_rank=0)`` and lets rank 0 alone write, counting on DeepSpeed
to broadcast rank 0's full tensors afterwards. AMSP parameters are not DeepSpeed's, so nothing
was broadcast: rank 0's shards were synced and the others not, and the step-2 loss came out
0.698156 where DDP's is 0.695772, with no error. Under AMSP every rank writes its own shards
(the non-ZeRO-3 branch): the policy's parameters are current when ``step()`` returns, and its
shards line up with the reference's.

Checked against trl 1.16.0.
"""

from __future__ import annotations

import contextlib
import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "trl_amsp_backend"
CHECKED_TRL_VERSIONS = ("1.16.0",)
_MARK = "_amsp_trl_backend_patch"
_UNWRAP = "_unwrap_model_for_generation"  # in trl.models.utils


def apply() -> str:
    import trl
    from trl.distributed import DistributedBackend

    if getattr(DistributedBackend.__init__, _MARK, False):
        return "already applied"
    warn_unchecked(NAME, "trl", trl.__version__, CHECKED_TRL_VERSIONS,
                   "applying (it only reports ZeRO stage 0 under AMSP)")
    original = DistributedBackend.__init__

    @functools.wraps(original)
    def __init__(self, accelerator, *args, **kwargs):
        original(self, accelerator, *args, **kwargs)
        from amsp_ext.integrations.settings import amsp_enabled

        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and amsp_enabled(plugin.deepspeed_config):
            self.zero_stage = 0

    setattr(__init__, _MARK, True)
    DistributedBackend.__init__ = __init__
    return f"applied (trl {trl.__version__})"


def _mix_into(target, source, alpha: float) -> None:
    """TR-DPO's reference update, target <- (1 - alpha) target + alpha source, on every rank's
    own shards (the two models share a plan: their local shards line up)."""
    import torch

    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters(), strict=True):
            t.mul_(1.0 - alpha).add_(s, alpha=alpha)


def apply_sync_ref() -> str:
    """``SyncRefModelCallback.sync_target_model``: every rank writes its shards under AMSP (see
    the module docstring); its own hook, on ``trl.trainer.callbacks`` (DPO never imports
    ``trl.distributed``)."""
    from accelerate.state import AcceleratorState
    from trl.trainer.callbacks import SyncRefModelCallback

    original = SyncRefModelCallback.sync_target_model
    if getattr(original, _MARK, False):
        return "already applied"

    @functools.wraps(original)
    def sync_target_model(model, target_model, alpha):
        from amsp_ext.integrations.settings import amsp_enabled

        plugin = AcceleratorState().deepspeed_plugin
        if plugin is not None and amsp_enabled(plugin.deepspeed_config):
            _mix_into(target_model, model, alpha)
            return
        original(model, target_model, alpha)

    setattr(sync_target_model, _MARK, True)
    SyncRefModelCallback.sync_target_model = staticmethod(sync_target_model)
    return "applied"


def apply_generation() -> str:
    """``trl.models.utils._unwrap_model_for_generation`` under AMSP: the generation inside one
    ``GatheredParameters`` over the policy ([Note: generation gathers once]); its own hook, on
    ``trl.models.utils`` (every trainer's ``unwrap_model_for_generation`` calls it there)."""
    import trl.models.utils as trl_utils

    # TRL's own (private) helper: the public unwrap_model_for_generation calls it through the
    # module, so replacing it there reaches every trainer that imported the public name
    original = getattr(trl_utils, _UNWRAP)
    if getattr(original, _MARK, False):
        return "already applied"

    @contextlib.contextmanager
    def unwrap(model, accelerator, gather_deepspeed3_params: bool = True, gradient_checkpointing_kwargs=None):
        from amsp_ext.integrations.gathered import amsp_gathered

        with original(model, accelerator, gather_deepspeed3_params=gather_deepspeed3_params,
                      gradient_checkpointing_kwargs=gradient_checkpointing_kwargs) as unwrapped:
            gathered = amsp_gathered(list(unwrapped.parameters()), None) if gather_deepspeed3_params else None
            if gathered is None:  # not AMSP's parameters, or TRL asked for no gather
                yield unwrapped
                return
            gathered.enter()
            failed = True
            try:
                yield unwrapped
                failed = False
            finally:
                gathered.exit(failed=failed)

    functools.update_wrapper(unwrap, original)
    setattr(unwrap, _MARK, True)
    setattr(trl_utils, _UNWRAP, unwrap)
    return "applied"
