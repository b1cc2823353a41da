"""``amsp_ext.patch_deepspeed()``: route ``deepspeed.initialize`` to AMSP for configs whose
``amsp.enabled`` is true; with Accelerate installed, also make its DeepSpeed mode see the real
world on CPU and leave the ``amsp`` block's values (``"plan": "auto"``) alone.

The patches themselves live under ``patches/`` (each states the versions it was checked against).
"""

from __future__ import annotations

__all__ = ["patch_deepspeed", "unpatch_deepspeed"]


def patch_deepspeed() -> dict[str, str]:
    """Apply the routing (and, when Accelerate is installed, its two fixes); idempotent.

    Returns ``{patch name: what happened}``.
    """
    from patches import deepspeed_initialize

    done = {deepspeed_initialize.NAME: deepspeed_initialize.apply()}
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return done
    from patches import accelerate_amsp_block, accelerate_deepspeed_cpu_state

    for mod in (accelerate_deepspeed_cpu_state, accelerate_amsp_block):
        done[mod.NAME] = mod.apply()
    return done


def unpatch_deepspeed() -> None:
    """Put the original ``deepspeed.initialize`` back (the Accelerate state fix stays)."""
    from patches import deepspeed_initialize

    deepspeed_initialize.restore()
