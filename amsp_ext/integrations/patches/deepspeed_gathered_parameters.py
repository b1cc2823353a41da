"""``deepspeed.zero.GatheredParameters`` on AMSP parameters.

Symptom (DeepSpeed 0.18.9): the class acts only on ZeRO parameters (those with ``ds_id``) and is
a silent no-op on anything else, so over an AMSP model (plan p=2x1) a read inside met the
sharded DTensor (``torch.equal`` with a full tensor: "got mixed torch.Tensor and DTensor"), a
write by ``modifier_rank`` reached that rank's shard alone, never the other ranks nor the fp32
masters, and ``model.generate`` inside one context over every parameter gathered every unit
again for each token.

[Note: the fix]
The class's own ``__init__`` / ``__enter__`` / ``__exit__`` are wrapped in place, so every name
it was imported under (``deepspeed.zero.GatheredParameters``, a ``from ... import`` made before
the patch, transformers' and TRL's references) takes the same route: when any listed parameter
belongs to a live AMSP engine, integrations/gathered.py runs the context ([Note:
GatheredParameters under AMSP]); otherwise DeepSpeed's code runs untouched (a generator of
parameters is listed once and handed on as that list).

Checked against DeepSpeed 0.18.9.
"""

from __future__ import annotations

import functools

import torch

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "deepspeed_gathered_parameters"
CHECKED_DEEPSPEED_VERSIONS = ("0.18.9",)
_MARK = "_amsp_gathered_patch"


def _listed(params) -> list:
    # as DeepSpeed reads its argument: one tensor, or an iterable (a generator is read once)
    if isinstance(params, torch.Tensor) or params is None:
        return [params] if params is not None else []
    return list(params)


def _wrap(cls) -> None:
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__

    @functools.wraps(init)
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        from amsp_ext.integrations.gathered import amsp_gathered

        self._amsp = None
        if enabled:
            params = _listed(params)
            self._amsp = amsp_gathered(params, modifier_rank, fwd_module)
        if self._amsp is None:
            init(self, params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)

    @functools.wraps(enter)
    def __enter__(self):
        if getattr(self, "_amsp", None) is None:
            return enter(self)
        self._amsp.enter()
        return None

    @functools.wraps(exit_)
    def __exit__(self, *exc):
        if getattr(self, "_amsp", None) is None:
            return exit_(self, *exc)
        self._amsp.exit(failed=exc[0] is not None)
        return None

    setattr(__init__, _MARK, (init, enter, exit_))
    cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__


def apply() -> str:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    if getattr(GatheredParameters.__init__, _MARK, None) is not None:
        return "already applied"
    warn_unchecked(NAME, "DeepSpeed", deepspeed.__version__, CHECKED_DEEPSPEED_VERSIONS,
                   "applying (it acts only on parameters of a live AMSP engine)")
    _wrap(GatheredParameters)
    return f"applied (DeepSpeed {deepspeed.__version__})"
