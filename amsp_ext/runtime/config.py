"""ShardConfig: how the engine runs a plan (kw-only, validated in ``__post_init__``)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field

import torch

from amsp_ext import choices
from amsp_ext.choices import GRANULARITIES, INIT_WEIGHTS, OWNERSHIPS, check_int, check_one_of
from amsp_ext.planner.adaptive import AdaptiveConfig  # torch-free: the launcher validates with it
from amsp_ext.planner.auto import AutoPlanConfig  # torch-free, so the planner owns it

__all__ = ["AdaptiveConfig", "AutoPlanConfig", "FP16Config", "OverlapConfig", "ShardConfig", "PRECISIONS"]

# the torch dtype of each precision name (amsp_ext.choices.PRECISIONS)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = {name: _DTYPES[name] for name in choices.PRECISIONS}


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """The paper's Table V switches. Off = the collective is waited for right where it is issued."""

    allgather: bool = True  # AG/RS of sp > 1: prefetch one unit ahead, async gathers
    allreduce: bool = True  # bucketed gradient AllReduce overlapped with backward
    broadcast: bool = True  # parameter Broadcast overlapped with the next forward

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"overlap.{f.name} must be True or False, got {getattr(self, f.name)!r}")


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """Dynamic loss scaling for ``precision="fp16"``."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.initial_scale > 0:
            raise ValueError(f"fp16.initial_scale must be > 0, got {self.initial_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"fp16.growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"fp16.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"fp16.growth_interval must be >= 1, got {self.growth_interval}")
        if not self.min_scale > 0:
            raise ValueError(f"fp16.min_scale must be > 0, got {self.min_scale}")


def _local_world_size() -> int | None:
    v = os.environ.get("LOCAL_WORLD_SIZE")
    return int(v) if v and v.isdigit() else None


# [Note: reduce_dtype defaults to fp32]
# A careful user wants gradients that are the sum they claim to be. In bf16 the sum of R*N/sp
# per-rank gradients (and of M micro-batches) is rounded at every addition to 8 mantissa bits,
# so its error grows with the number of summands: for tiny-llama's bf16 gradients the relative
# error of a rank-by-rank bf16 sum is 2.5e-3 over 4 ranks, 7.8e-3 over 64 and 1.7e-2 over 256,
# against 1e-10..2e-8 in fp32 (comparisons/bf16_sum_error.py). torchtitan reduces in fp32 by
# default (MixedPrecisionPolicy(reduce_dtype=float32)), Megatron-LM accumulates and all-reduces
# in fp32 under bf16, and DeepSpeed's bf16 optimizer keeps an fp32 gradient accumulator. The
# cost is bytes: Tg and T0_os move 4 bytes per gradient instead of 2 and kept gradients take 4
# bytes per element; the planner charges both (so plan "auto" accounts for it) and
# comparisons/results/reduce_dtype.md measures it (+3-6% per step on loopback, +20-31% across
# the lab's 1 Gbit/s link for all-reduce-bound plans). At the parity tests' scale (4 ranks,
# M = 2) both dtypes stay far inside the tests' bounds; the difference grows with the world.
# Who wants the paper's 2-byte gradient traffic asks for it: reduce_dtype="bf16" (or "fp16").


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Everything but the plan. ``gpus_per_node`` None = the launcher's ``LOCAL_WORLD_SIZE``."""

    gpus_per_node: int | None = None
    nodes_per_leaf: int | None = None
    precision: str = "fp32"  # compute dtype of params/grads; masters and states are fp32
    # dtype gradients are reduced and accumulated in: "fp32" or the precision (see the Note)
    reduce_dtype: str = "fp32"
    grad_bucket_bytes: int = 25 * 2**20  # U in the paper (T0_os, Tg)
    # packed parameter broadcasts in flight (see param_sync.py); None = U, 0 = one per tensor
    broadcast_bucket_bytes: int | None = None
    granularity: str = "module"  # FSDP unit = each Linear of a layer ("module") or the layer
    recompute: bool = False  # activation checkpointing per decoder layer
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    ownership: str = "greedy"  # inter-tensor optimizer-state ownership (see ownership.py)
    timeout: float = 600.0  # seconds a wait may take before CollectiveTimeout
    fp16: FP16Config = field(default_factory=FP16Config)
    auto: AutoPlanConfig | None = None  # needed by plan="auto"
    # rank 0's initial weights broadcast to all ("broadcast", as DDP) or compared ("check")
    init_weights: str = "broadcast"
    # consecutive non-finite steps (skipped on every rank) before the job stops; 0: guard off
    max_bad_steps: int = 3
    # re-plan and switch plans mid-run when the network changes (planner/adaptive.py); None: off
    adaptive: AdaptiveConfig | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", _local_world_size())
        if self.gpus_per_node is not None and (
            isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int)
            or self.gpus_per_node < 1
        ):
            raise ValueError(f"config.gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if self.nodes_per_leaf is not None and (
            not isinstance(self.nodes_per_leaf, int) or self.nodes_per_leaf < 1
        ):
            raise ValueError(f"config.nodes_per_leaf must be an integer >= 1 or None, got {self.nodes_per_leaf!r}")
        check_one_of(self.precision, PRECISIONS, "config.precision")
        check_one_of(self.reduce_dtype, choices.reduce_dtypes(self.precision), "config.reduce_dtype")
        if not isinstance(self.grad_bucket_bytes, int) or self.grad_bucket_bytes < 1:
            raise ValueError(f"config.grad_bucket_bytes must be an integer >= 1, got {self.grad_bucket_bytes!r}")
        if self.broadcast_bucket_bytes is not None and (
            isinstance(self.broadcast_bucket_bytes, bool)
            or not isinstance(self.broadcast_bucket_bytes, int) or self.broadcast_bucket_bytes < 0
        ):
            raise ValueError(f"config.broadcast_bucket_bytes must be an integer >= 0 or None, "
                             f"got {self.broadcast_bucket_bytes!r}")
        check_one_of(self.granularity, GRANULARITIES, "config.granularity")
        check_one_of(self.ownership, OWNERSHIPS, "config.ownership")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"config.recompute must be True or False, got {self.recompute!r}")
        if not isinstance(self.overlap, OverlapConfig):
            raise ValueError(f"config.overlap must be an OverlapConfig, got {type(self.overlap).__name__}")
        if not isinstance(self.fp16, FP16Config):
            raise ValueError(f"config.fp16 must be an FP16Config, got {type(self.fp16).__name__}")
        if self.auto is not None and not isinstance(self.auto, AutoPlanConfig):
            raise ValueError(f"config.auto must be an AutoPlanConfig or None, got {type(self.auto).__name__}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise ValueError(f"config.adaptive must be an AdaptiveConfig or None, got {type(self.adaptive).__name__}")
        if self.adaptive is not None and self.auto is None:
            raise ValueError("config.adaptive needs config.auto=AutoPlanConfig(seq_len=..., "
                             "micro_batch_size=..., num_micro_batches=..., profile=...), also with "
                             "an explicit plan: the monitor predicts each step's collectives from it")
        check_int(self.max_bad_steps, "config.max_bad_steps (0: no guard)", minimum=0)
        check_one_of(self.init_weights, INIT_WEIGHTS, "config.init_weights")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not (
                0 < self.timeout < float("inf")):
            raise ValueError(f"config.timeout must be a number of seconds > 0, got {self.timeout!r}")

    @property
    def broadcast_staging_bytes(self) -> int:
        return self.grad_bucket_bytes if self.broadcast_bucket_bytes is None else self.broadcast_bucket_bytes

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return PRECISIONS[self.reduce_dtype]

    def fingerprint_fields(self) -> dict:
        """Every field that must agree across ranks (all of them but the timeout)."""
        d = dataclasses.asdict(self)
        d.pop("timeout")
        return d

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(sorted(self.fingerprint_fields().items())).encode()).hexdigest()[:16]
