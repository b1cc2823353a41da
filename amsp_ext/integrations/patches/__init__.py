"""Small, targeted fixes that let the DeepSpeed baselines run on gloo (CPU).

Each module states the DeepSpeed versions it was checked against, detects whether the running
versions need it (a local probe, never an assumption from the backend's name alone) and changes
nothing otherwise. ``apply_needed()`` applies every patch that is needed and returns what it did,
so a benchmark report can list exactly which fixes were active.

The integration patches (``deepspeed_initialize``: route ``deepspeed.initialize`` to AMSP;
``accelerate_deepspeed_cpu_state``, ``accelerate_amsp_block``: Accelerate's DeepSpeed mode under
AMSP) are not in ``apply_needed``: ``amsp_ext.patch_deepspeed()`` and the start-up hook apply them.
"""

from __future__ import annotations

__all__ = ["apply_needed"]


def apply_needed() -> dict[str, str]:
    """Apply every needed patch; ``{patch name: what happened}`` (applied / not needed: why)."""
    from amsp_ext.integrations.patches import deepspeed_mics_gloo, deepspeed_zero12_flat_buffer

    return {
        mod.NAME: mod.apply()
        for mod in (deepspeed_zero12_flat_buffer, deepspeed_mics_gloo)
    }
