"""The systems a comparison can run: name -> label and runner module.

Each runner module exposes ``setup(name, model, ctx) -> SystemRun`` (see :mod:`.base`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["DDP_BUCKETS_MB", "DEFAULT_SYSTEMS", "SYSTEMS", "SystemInfo", "ddp_bucket_system",
           "default_systems", "peer_family", "runner"]


@dataclass(frozen=True, kw_only=True)
class SystemInfo:
    label: str
    module: str  # under amsp_ext.compare.systems
    uses_deepspeed: bool = False
    # DDP's bucket_cap_mb given explicitly (None: torch's default, 25)
    bucket_cap_mb: int | None = None
    # in a mode's rows when no --systems names them (the sweep rows are asked for)
    default: bool = True


# [Note: DDP at its best]
# Invariant: where the report puts AMSP against DDP with several DDP settings timed, the ratio
# is against the fastest of them (compare/peers.py), never one a reader could call hobbled.
# DDP's tuning knob for overlap is bucket_cap_mb (how much gradient one all-reduce carries, so
# how soon the first one starts under the backward and how many there are); torch's default
# is 25, and which size suits a gloo lab's links is measured, not assumed: `--ddp-buckets` runs
# DDP at sizes from DDP_BUCKETS_MB in the same rounds. The sizes are a fixed set, not any
# number, so that each is a registered system: a row's key names its setting and rows of two
# runs with the same key ran the same configuration. FSDP2/HSDP run at their defaults.
DDP_BUCKETS_MB = (1, 5, 25)


def ddp_bucket_system(mb: int) -> str:
    return f"ddp-b{mb}"


SYSTEMS: dict[str, SystemInfo] = {
    "ddp": SystemInfo(label="DDP", module="ddp"),
    **{ddp_bucket_system(mb): SystemInfo(label=f"DDP, bucket_cap_mb {mb}", module="ddp",
                                         bucket_cap_mb=mb, default=False)
       for mb in DDP_BUCKETS_MB},
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
DEFAULT_SYSTEMS = tuple(name for name, info in SYSTEMS.items() if info.default)


def default_systems(mode: str) -> list[str]:
    """The rows a mode runs when no --systems names them (ablation: the peers beside its rows)."""
    return {"baselines": list(DEFAULT_SYSTEMS), "dissociation": ["mics", "amsp-mics", "amsp-plan"]}.get(mode, [])


def peer_family(system: str) -> str:
    """Rows of one family are one peer at different settings: DDP and its bucket sweep are
    "ddp"; every other system (ddp-bf16 too, a different recipe) is its own."""
    info = SYSTEMS.get(system)
    return "ddp" if system == "ddp" or (info is not None and info.bucket_cap_mb is not None) else system


def runner(name: str):
    if name not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {name!r}")
    return importlib.import_module(f"amsp_ext.compare.systems.{SYSTEMS[name].module}")
