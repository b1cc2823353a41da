"""The systems a comparison can run: name -> label and runner module.

Each runner module exposes ``setup(name, model, ctx) -> SystemRun`` (see :mod:`.base`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["SYSTEMS", "SystemInfo", "runner"]


@dataclass(frozen=True, kw_only=True)
class SystemInfo:
    label: str
    module: str  # under amsp_ext.compare.systems
    uses_deepspeed: bool = False


SYSTEMS: dict[str, SystemInfo] = {
    "ddp": SystemInfo(label="DDP", module="ddp"),
    "ddp-bf16": SystemInfo(label="DDP, bf16 parameters + fp32 masters", module="ddp"),
    "zero1": SystemInfo(label="DeepSpeed ZeRO-1", module="deepspeed_zero", uses_deepspeed=True),
    "zero2": SystemInfo(label="DeepSpeed ZeRO-2", module="deepspeed_zero", uses_deepspeed=True),
    "zero3": SystemInfo(label="DeepSpeed ZeRO-3", module="deepspeed_zero", uses_deepspeed=True),
    "zeropp": SystemInfo(label="ZeRO++ (hpZ, no quantisation)", module="deepspeed_zero",
                         uses_deepspeed=True),
    "zeropp-q": SystemInfo(label="ZeRO++ (hpZ + qwZ + qgZ)", module="deepspeed_zero",
                           uses_deepspeed=True),
    "mics": SystemInfo(label="DeepSpeed-MiCS", module="deepspeed_zero", uses_deepspeed=True),
    "fsdp2": SystemInfo(label="FSDP2 full shard", module="fsdp2"),
    "hsdp": SystemInfo(label="FSDP2 HSDP (2-D mesh)", module="fsdp2"),
    "amsp-mics": SystemInfo(label="AMSP (MiCS config)", module="amsp"),
    "amsp-plan": SystemInfo(label="AMSP (planner's plan)", module="amsp"),
}


def runner(name: str):
    if name not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {name!r}")
    return importlib.import_module(f"amsp_ext.compare.systems.{SYSTEMS[name].module}")
