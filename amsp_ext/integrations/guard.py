"""Never a silent fallback: which ds_config with an ``"amsp"`` block this process runs, and the
one-line stop when AMSP is asked for but cannot run.

[Note: which configs are "in play"]
The Accelerate fixes (patches/accelerate_*.py) act only for a ds_config that carries an
``"amsp"`` block, so that amsp_ext being installed changes nothing for other DeepSpeed jobs.
Such a config reaches a process in one of two ways:
- ``accelerate launch`` with a DEEPSPEED-type YAML exports ``ACCELERATE_USE_DEEPSPEED=true`` and
  ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` to every worker (``config_from_env``);
- a script, the HF Trainer (``TrainingArguments(deepspeed=...)``) or ``amsp_ext.accelerate``
  builds an ``HfDeepSpeedConfig`` from it; the patched ``set_stage_and_offload`` calls ``note``.

[Note: why SystemExit]
Where AMSP is asked for but the framework has already decided against DeepSpeed (e.g.
``ACCELERATE_USE_CPU=true``: Accelerate's CPU mode drops the DeepSpeed plugin and trains DDP),
the only honest outcome is to stop. ``stop`` raises ``SystemExit`` with one line on rank 0
(Python prints it without a traceback); the other ranks exit 1 a moment later, so the launcher
shows rank 0's line and not N copies of it. The launcher-side check (``accelerate launch``)
runs before any worker starts.

Pure Python (no torch).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Mapping

__all__ = ["amsp_block_in_play", "config_from_env", "cpu_forced", "note", "on_note", "stop"]

_noted: list[dict[str, Any]] = []  # amsp blocks of the HfDeepSpeedConfig objects built here
_listeners: list = []  # called after each note (a state built before the config is fixed then)


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def config_from_env() -> tuple[str, dict[str, Any]] | None:
    """``(path, config)`` that ``accelerate launch`` handed this worker, if DEEPSPEED-type."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or not _truthy(os.environ.get("ACCELERATE_USE_DEEPSPEED")):
        return None
    cfg = _read(path)
    return (path, cfg) if cfg is not None else None


@functools.lru_cache(maxsize=8)
def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # Accelerate reports a missing or broken file itself
    return cfg if isinstance(cfg, dict) else None


def note(config: Mapping[str, Any]) -> None:
    """Remember a ds_config with an ``"amsp"`` block built into an HfDeepSpeedConfig here."""
    block = config.get("amsp") if isinstance(config, Mapping) else None
    if isinstance(block, Mapping):
        _noted.append(dict(block))
        for fn in list(_listeners):
            fn()


def on_note(fn) -> None:
    """Call ``fn()`` whenever a config with an amsp block is noted (e.g. the HF Trainer builds
    its Accelerate state before it reads the ds_config: the state is fixed afterwards)."""
    if fn not in _listeners:
        _listeners.append(fn)


def amsp_block_in_play() -> bool:
    """True when this process runs a ds_config that has an ``"amsp"`` block (enabled or not)."""
    if _noted:
        return True
    env = config_from_env()
    return env is not None and isinstance(env[1].get("amsp"), Mapping)


def cpu_forced(cpu_flag: bool = False) -> str | None:
    """What forces Accelerate's CPU mode (which drops DeepSpeed), as the user would name it."""
    if _truthy(os.environ.get("ACCELERATE_USE_CPU")):
        return f"ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']}"
    if cpu_flag:
        return "cpu=True (use_cpu / --cpu)"
    return None


def stop(message: str) -> None:
    """End this process with one line (rank 0) - see [Note: why SystemExit]."""
    rank = os.environ.get("RANK")
    if rank not in (None, "", "0"):
        time.sleep(2.0)  # rank 0's line first; the launcher then stops every worker
        raise SystemExit(1)
    raise SystemExit(f"[amsp] error: {message}")
