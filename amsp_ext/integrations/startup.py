"""The interpreter start-up hook: activate AMSP in a worker whose script never imports amsp_ext.

``amsp_ext_startup.pth`` (installed into site-packages by ``pip install``, editable or not; see
setup.py) runs one line at every interpreter start:

    import os; (os.environ.get("AMSP_PATCH_DEEPSPEED") or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")) and __import__(...).activate()

so a process whose environment has neither variable only pays two dictionary look-ups.

[Note: when it activates]
- ``accelerate launch`` with a DEEPSPEED-type config exports ``ACCELERATE_USE_DEEPSPEED=true`` and
  ``ACCELERATE_DEEPSPEED_CONFIG_FILE=<deepspeed_config_file>`` to every worker (accelerate
  1.15.0, utils/launch.py ``prepare_deepspeed_cmd_env``). If that file's ``amsp.enabled`` is
  true, we activate.
- ``AMSP_PATCH_DEEPSPEED=1`` activates in any launcher (torchrun, deepspeed, a Trainer script):
  the routing still looks at each config's ``amsp.enabled``, so DeepSpeed jobs without it run
  DeepSpeed.

Activating installs post-import hooks (import_hooks.py): when the script imports ``deepspeed``,
``deepspeed.initialize`` is routed (patches/deepspeed_initialize.py); when it imports
``accelerate``, its CPU state fix and amsp-block fix are applied (patches/accelerate_*.py).
Nothing heavy is imported at start-up. ``AMSP_STARTUP_VERBOSE=1`` prints what was decided.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["ENV_PATCH", "activate", "reason"]

ENV_PATCH = "AMSP_PATCH_DEEPSPEED"
ENV_DS_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def reason() -> str | None:
    """Why this process should activate AMSP, or None."""
    if os.environ.get(ENV_PATCH, "").strip().lower() in ("1", "true", "yes", "on"):
        return f"{ENV_PATCH}={os.environ[ENV_PATCH]}"
    path = os.environ.get(ENV_DS_FILE)
    if not path or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # DeepSpeed/Accelerate will report a missing or broken config themselves
    from amsp_ext.integrations.settings import amsp_enabled

    return f"{ENV_DS_FILE}={path} has amsp.enabled" if amsp_enabled(config) else None


def _patch_deepspeed(_module) -> None:
    from patches import deepspeed_initialize

    deepspeed_initialize.apply()


def _patch_accelerate(_module) -> None:
    from patches import accelerate_amsp_block, accelerate_deepspeed_cpu_state

    accelerate_deepspeed_cpu_state.apply()
    accelerate_amsp_block.apply()


_active: str | None = None


def activate() -> bool:
    """Install the post-import hooks if this process asked for AMSP. Idempotent: site processes a
    venv's ``lib`` and its ``lib64`` symlink as two site directories, so .pth lines run twice."""
    global _active
    if _active is not None:
        return True
    why = reason()
    verbose = os.environ.get("AMSP_STARTUP_VERBOSE") == "1"
    if why is None:
        if verbose:
            print("[amsp] start-up hook: not activated", file=sys.stderr)
        return False
    from amsp_ext.integrations.import_hooks import when_imported

    _active = why
    when_imported("deepspeed", _patch_deepspeed)
    when_imported("accelerate", _patch_accelerate)
    if verbose:
        print(f"[amsp] start-up hook: activated ({why})", file=sys.stderr)
    return True
