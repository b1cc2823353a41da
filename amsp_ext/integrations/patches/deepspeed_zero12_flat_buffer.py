"""DeepSpeed ZeRO-1/2 on gloo: the flat bit16 parameter buffer must carry no autograd history.

Symptom (DeepSpeed 0.18.9, torch 2.13 CPU, gloo, ``LlamaForCausalLM``, fp32 *and* bf16):
the first ``engine.step()`` fails in ``all_gather_dp_groups`` with
``RuntimeError: Output 0 of Split is a view and is being modified inplace``.

[Note: cause]
When the accelerator reports enough free memory, ``DeepSpeedZeroOptimizer.__init__`` flattens the
parameters themselves (``use_cpu_data=False``) outside ``torch.no_grad()``, so
``bit16_groups_flat[i]`` is a non-leaf with ``CatBackward0`` and every partition is a view of it.
NCCL's ``all_gather_into_tensor`` writes the output buffer directly; gloo's splits the output into
per-rank views and copies into them on its worker thread, where grad mode is on, so autograd
rejects the in-place write into a multi-output view. The buffer is only storage - DeepSpeed never
differentiates through it - and later DeepSpeed releases build it from ``param.data`` or call
``.detach()`` on it. The fix here does the same: ``flatten_dense_tensors_aligned`` returns a
detached tensor (same storage, no history). Numerics are unchanged.

Checked against DeepSpeed 0.18.9 (needed) with torch 2.13.0+cpu. Applied only when a local probe
shows the flattening keeps autograd history.
"""

from __future__ import annotations

import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "deepspeed_zero12_flat_buffer"
CHECKED_DEEPSPEED_VERSIONS = ("0.18.9",)
_MARK = "_amsp_detach_patch"


def needed() -> str | None:
    """Why the patch is needed, or None. Local probe only (no collectives)."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from amsp_ext.runtime import _torch_compat as compat

    fn = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned
    if getattr(fn, _MARK, False):
        return None

    class _Probe:  # what the method reads from ``self``
        flatten = staticmethod(compat.flatten_dense_tensors)

    with torch.enable_grad():
        flat = fn(_Probe(), [torch.zeros(2, requires_grad=True)], 1)
    if flat.grad_fn is None:
        return None
    return "flatten_dense_tensors_aligned returns a tensor with autograd history"


def apply() -> str:
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    why = needed()
    if why is None:
        return "not needed: the flat buffer has no autograd history"
    warn_unchecked(NAME, "DeepSpeed", deepspeed.__version__, CHECKED_DEEPSPEED_VERSIONS,
                   f"applying because the probe says: {why}")
    original = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned

    @functools.wraps(original)
    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False):
        return original(self, tensor_list, alignment, use_cpu_data=use_cpu_data).detach()

    setattr(flatten_dense_tensors_aligned, _MARK, True)
    DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned
    return f"applied (DeepSpeed {deepspeed.__version__}): {why}"
