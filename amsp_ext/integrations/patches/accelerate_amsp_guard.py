"""AMSP asked for but Accelerate about to run without DeepSpeed: stop with one line, never fall
back silently.

Symptoms (accelerate 1.15.0, transformers 5.24.0, CPU):
1. ``ACCELERATE_USE_CPU=true accelerate launch --config_file amsp.yaml train.py`` (a DEEPSPEED-type
   YAML whose ds_config has ``amsp.enabled``) trained plain DDP, printed no plan line and exited 0.
2. The HF Trainer with ``TrainingArguments(deepspeed=<that ds_config>)`` and ``ACCELERATE_USE_CPU``
   silently wrapped the model in DDP (FIELD_NOTES).
3. A YAML whose ``deepspeed_config_file`` is relative and the launch made from another directory
   failed in every worker with Accelerate's chained file/base64/JSON traceback.

[Note: cause]
``AcceleratorState.__init__`` switches to DEEPSPEED only ``if ACCELERATE_USE_DEEPSPEED and not
cpu``; with ``cpu`` (the argument, or ``ACCELERATE_USE_CPU``) it keeps the DeepSpeed plugin
unused and sets up MULTI_CPU. ``deepspeed.initialize`` is then never called, so AMSP's routing
never sees the config.

[Note: the fix, in two places]
- Launcher (``accelerate launch``, DEEPSPEED type): ``prepare_deepspeed_cmd_env`` is wrapped to
  check the YAML's ``deepspeed_config_file`` before any worker starts: a missing file, an
  invalid ``amsp`` block, or ``amsp.enabled`` with the CPU mode forced each stop the launch with
  one line. The name is rebound in ``accelerate.utils`` (where ``accelerate.commands.launch``
  imports it from, also under ``python -m``) and ``accelerate.utils.launch``.
- Workers (any launcher, e.g. torchrun + the HF Trainer): ``AcceleratorState.__init__`` is
  wrapped; if it was given a DeepSpeed plugin whose config has ``amsp.enabled`` and the state
  came out as anything but DEEPSPEED, the process stops with the reason (amsp_ext.integrations.
  guard.stop: rank 0 prints the line).
Configs without ``amsp.enabled`` are never touched.

Checked against accelerate 1.15.0.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys

NAME = "accelerate_amsp_guard"
_MARK = "_amsp_guard_patch"

FIX_CPU = ("unset it (AMSP runs on CPU with gloo without Accelerate's CPU mode), or set "
           "\"amsp\": {\"enabled\": false} to train without AMSP")


def check_launch(args) -> None:
    """The launcher's check of a DEEPSPEED-type YAML's ds_config (see the module Note)."""
    from amsp_ext.integrations.guard import cpu_forced, stop
    from amsp_ext.integrations.settings import AMSPSettings, ConfigError, amsp_enabled

    path = getattr(args, "deepspeed_config_file", None)
    if not path:
        return
    yaml = getattr(args, "config_file", None) or "the accelerate config"
    if not os.path.isfile(path):
        where = "" if os.path.isabs(path) else f" (a relative path is read from the current directory {os.getcwd()})"
        stop(f"{yaml}: deepspeed_config_file {path!r} does not exist{where}; give an absolute path, "
             f"or write a ready pair with `amsp config accelerate -o amsp.yaml`")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError:
        return  # not JSON: Accelerate's own error
    if not isinstance(cfg, dict) or not amsp_enabled(cfg):
        return  # no amsp block, or "enabled": false: DeepSpeed's job, untouched
    try:
        AMSPSettings.from_dict(cfg["amsp"])
    except ConfigError as e:
        stop(f"{path}: {e}")
    forced = cpu_forced(bool(getattr(args, "cpu", False) or getattr(args, "use_cpu", False)))
    if forced:
        stop(f"{path} has amsp.enabled, but {forced} puts Accelerate in CPU mode, which drops "
             f"DeepSpeed and with it AMSP (it would train plain DDP): {FIX_CPU}")


def _plugins(bound: dict):
    p = bound.get("deepspeed_plugin")
    if p is None:
        return []
    return list(p.values()) if isinstance(p, dict) else [p]


def check_state(state, bound: dict) -> None:
    """Stop when an AMSP-enabled DeepSpeed plugin was given and the state is not DEEPSPEED."""
    from accelerate.utils import DistributedType

    from amsp_ext.integrations.guard import config_from_env, cpu_forced, stop
    from amsp_ext.integrations.settings import amsp_enabled

    configs = [getattr(getattr(p, "hf_ds_config", None), "config", None) for p in _plugins(bound)]
    if not any(isinstance(c, dict) and amsp_enabled(c) for c in configs):
        return
    if state.distributed_type == DistributedType.DEEPSPEED:
        return
    env = config_from_env()
    where = env[0] if env is not None else "the ds_config"
    forced = cpu_forced(bool(bound.get("cpu")))
    if forced:
        stop(f"{where} has amsp.enabled, but {forced} puts Accelerate in CPU mode, which drops "
             f"DeepSpeed and with it AMSP (it would train {state.distributed_type.value}): {FIX_CPU}")
    stop(f"{where} has amsp.enabled, but Accelerate set up {state.distributed_type.value} instead of "
         f"DeepSpeed, so AMSP would not run: launch with a DEEPSPEED-type accelerate config, or set "
         f"\"amsp\": {{\"enabled\": false}}")


def _patch_state() -> None:
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    sig = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs).arguments
        except TypeError:
            return
        check_state(self, bound)

    setattr(__init__, _MARK, True)
    AcceleratorState.__init__ = __init__


def _patch_launcher() -> None:
    import accelerate.utils as utils
    import accelerate.utils.launch as launch

    original = launch.prepare_deepspeed_cmd_env

    @functools.wraps(original)
    def prepare_deepspeed_cmd_env(args):
        check_launch(args)
        return original(args)

    setattr(prepare_deepspeed_cmd_env, _MARK, True)
    for mod in (launch, utils, sys.modules.get("accelerate.commands.launch")):
        if mod is not None and hasattr(mod, "prepare_deepspeed_cmd_env"):
            mod.prepare_deepspeed_cmd_env = prepare_deepspeed_cmd_env


def apply() -> str:
    from accelerate.state import AcceleratorState

    if getattr(AcceleratorState.__init__, _MARK, False):
        return "already applied"
    _patch_state()
    _patch_launcher()
    return "applied"
