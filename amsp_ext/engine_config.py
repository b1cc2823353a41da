"""EngineConfig: how the engine runs a plan, defined once for every route.

``amsp_ext.shard(model, plan, factory, config=ShardConfig(...))`` (ShardConfig is this class),
``amsp train``'s ``--precision``/``--grad-bucket-bytes``/... flags (``TrainConfig.engine``), the
engine keys of a ds_config's ``"amsp"`` block and of the Accelerate route, the AMSP rows of
``amsp compare`` and ``amsp plan``'s engine flags all read these fields: each setting, its
default, its help and its validation exist here and nowhere else. The planner gets the settings
it charges as a TrainingSpec made by :func:`training_spec`, the one translation.

Pure Python (no torch): the launchers validate with it before any rank starts. The engine
derives torch dtypes from the names (runtime/config.py).

[Note: one default per setting]
Where the routes used to differ, the default is what a DeepSpeed or FSDP user expects:
- ``timeout`` 600 s: torch.distributed's own default process-group timeout (10 minutes);
- ``grad_bucket_bytes`` 25 MiB: DDP's ``bucket_cap_mb=25`` (the paper's U). Small models
  overlap better with smaller buckets (``--grad-bucket-bytes 1MiB``): one 25 MiB bucket holds
  all of tiny-llama's gradients, so its all-reduce waits for the end of backward;
- ``granularity`` "layer": one sharding unit per decoder layer, as FSDP2 users wrap
  (torchtitan) and as ``amsp compare``'s FSDP2 rows do; the paper's per-Linear units are
  ``granularity="module"`` (tiny-llama on 4 CPU ranks trained 2.4x slower with them);
- ``reduce_dtype`` fp32: see [Note: reduce_dtype defaults to fp32] below; the planner charges the
  same bytes (training_spec), so plan "auto" fits the gradients the engine really holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from amsp_ext.choices import (ALL_REDUCE_SETTINGS, GRANULARITIES, INIT_WEIGHTS, OPTIMIZER_KINDS, OVERLAP_OPS,
                              OWNERSHIPS, PRECISIONS, check_one_of, reduce_dtypes)
from amsp_ext.planner.adaptive import AdaptiveConfig
from amsp_ext.planner.auto import AutoPlanConfig
from amsp_ext.planner.defaults import (DEFAULT_ALL_REDUCE, DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_GRANULARITY,
                                       DEFAULT_PRECISION, DEFAULT_REDUCE_DTYPE)
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.specs import StepShape, TrainingSpec
from amsp_ext.schema import check_options, name_of, option, section

__all__ = ["AdaptiveConfig", "AutoPlanConfig", "DEFAULT_TIMEOUT_S", "EngineConfig", "FP16Config",
           "OverlapConfig", "training_spec"]

# seconds a collective may take before it counts as hung, for every route and tool that issues
# collectives (the engine, amsp profile's measurements); see [Note: one default per setting]
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """The paper's Table V switches. Off = the collective is waited for right where it is issued."""

    SCHEMA_NAME = "overlap"  # errors of a Python-built one name overlap.<field> (schema.py)

    allgather: bool = option(True, flag="--overlap-allgather",
                             help="AG/RS of sp > 1: prefetch one unit ahead, async gathers")
    allreduce: bool = option(True, flag="--overlap-allreduce",
                             help="bucketed gradient AllReduce overlapped with backward")
    broadcast: bool = option(True, flag="--overlap-broadcast",
                             help="parameter Broadcast overlapped with the next forward")

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def without(cls, ops) -> "OverlapConfig":
        """All switches on but ``ops`` (names from choices.OVERLAP_OPS)."""
        for op in ops:
            check_one_of(op, OVERLAP_OPS, "overlap")
        return cls(**{op: op not in ops for op in OVERLAP_OPS})

    @property
    def off(self) -> tuple[str, ...]:
        return tuple(op for op in OVERLAP_OPS if not getattr(self, op))


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """Dynamic loss scaling for ``precision="fp16"``."""

    SCHEMA_NAME = "fp16"

    initial_scale: float = option(2.0**16, flag="--fp16-initial-scale", above=0,
                                  help="first loss scale")
    growth_factor: float = option(2.0, flag="--fp16-growth-factor", above=1,
                                  help="scale x this after growth_interval good steps")
    backoff_factor: float = option(0.5, flag="--fp16-backoff-factor", above=0, below=1,
                                   help="scale x this after an overflow")
    growth_interval: int = option(1000, flag="--fp16-growth-interval", minimum=1,
                                  help="good steps before the scale grows")
    min_scale: float = option(1.0, flag="--fp16-min-scale", above=0, help="lowest loss scale")

    def __post_init__(self) -> None:
        check_options(self)


_MAX_TIMEOUT_S = 365 * 86400.0  # a year: beyond it datetime.timedelta and the stores overflow


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
# the lab's 1 Gbit/s link for all-reduce-bound plans). Who wants the paper's 2-byte gradient
# traffic asks for it: reduce_dtype="bf16" (or "fp16").


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything but the plan. ``gpus_per_node`` None = the launcher's ``LOCAL_WORLD_SIZE``."""

    SCHEMA_NAME = "config"

    gpus_per_node: int | None = option(
        None, minimum=1, help="ranks per (virtual) node; default: the launcher's local world size")
    nodes_per_leaf: int | None = option(None, minimum=1, help="nodes under one leaf switch")
    tensor_parallel: int = option(
        1, minimum=1, help="tensor-parallel degree T inside the node: the model's blocks are split T ways "
                           "(runtime/tensor_parallel.py) and the plan shards over the data-parallel "
                           "ranks (gpus_per_node / T per node)")
    precision: str = option(DEFAULT_PRECISION, choices=PRECISIONS,
                            help="compute dtype of parameters and gradients (masters and optimizer "
                                 "states are fp32)")
    reduce_dtype: str = option(DEFAULT_REDUCE_DTYPE, choices=PRECISIONS,
                               help="dtype gradients are reduced and accumulated in: fp32 or the "
                                    "--precision (the paper's 2-byte gradients)")
    grad_bucket_bytes: int = option(DEFAULT_GRAD_BUCKET_BYTES, minimum=1, size=True,
                                    help="gradient bucket size U (e.g. 25MiB, or bytes)")
    grad_bucket_close_bytes: int | None = option(
        None, minimum=1, size=True,
        help="a gradient bucket closes at a unit boundary once it holds this much; default: from "
             "the profile's all-reduce curve of the plan's replica group where the job has one "
             "(the size at 80%% of the U-byte bandwidth), else 1 MiB")
    broadcast_bucket_bytes: int | None = option(
        None, minimum=0, size=True,
        help="packed parameter broadcasts in flight; default: the gradient bucket size; 0: one "
             "broadcast per tensor")
    all_reduce: str = option(DEFAULT_ALL_REDUCE, choices=ALL_REDUCE_SETTINGS,
                             help="gradient all-reduce over a group with several ranks on each of "
                                  "several nodes: one collective (flat, as DDP) or reduce-scatter in "
                                  "the node, all-reduce across, all-gather in the node (two_level: "
                                  "2/3 of the bytes on the node links; wins where they are slow); "
                                  "auto: the one the planner's step model prices lower for the plan")
    granularity: str = option(DEFAULT_GRANULARITY, choices=GRANULARITIES,
                              help="sharding unit: the decoder layer (layer, as FSDP2 users wrap) or "
                                   "each Linear of it (module, the paper's)")
    recompute: bool = option(False, help="activation checkpointing per decoder layer")
    overlap: OverlapConfig = section(OverlapConfig)
    ownership: str = option("greedy", choices=OWNERSHIPS,
                            help="inter-tensor optimizer-state ownership policy")
    optimizer_kind: str = option(
        "detect", choices=OPTIMIZER_KINDS,
        help="how the optimizer reads a tensor: elementwise (Adam, SGD, ...: steps row shards), "
             "whole_tensor (Muon, Adafactor, Shampoo: each tensor stepped whole by one owner), or "
             "detect from its class (unknown classes, subclasses included, are whole_tensor)")
    timeout: float = option(DEFAULT_TIMEOUT_S, above=0, below=_MAX_TIMEOUT_S,
                            help="seconds a collective may take before CollectiveTimeout")
    fp16: FP16Config = section(FP16Config)
    init_weights: str = option("broadcast", choices=INIT_WEIGHTS,
                               help="rank 0's initial weights broadcast to all (as DDP) or compared")
    init_from: str | None = option(
        None, metavar="PATH",
        help="initial weights: a Hugging Face safetensors folder (model.safetensors or an index) or "
             "an amsp checkpoint; each rank reads only the rows it keeps")
    max_bad_steps: int = option(
        3, minimum=0, help="consecutive steps with a non-finite loss or gradient norm (each skipped "
                           "on every rank) before the job stops; 0: no guard")
    # not flags: the routes fill them from their own job shape (train: --seq-len ...)
    auto: AutoPlanConfig | None = None  # needed by plan="auto"
    adaptive: AdaptiveConfig | None = None  # re-plan mid-run (planner/adaptive.py); None: off
    # the seed of a meta-built model's weights (runtime/materialize.py); `amsp train`: its --seed
    init_seed: int = 0

    def __post_init__(self) -> None:
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", _local_world_size())
        check_options(self)
        check_one_of(self.reduce_dtype, reduce_dtypes(self.precision),
                     f"{name_of(self, 'reduce_dtype')} (with {name_of(self, 'precision')} {self.precision})")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int) or not 0 <= self.init_seed < 2**63:
            raise ValueError(f"{name_of(self, 'init_seed')} must be an integer in [0, 2**63), got {self.init_seed!r}")
        auto, adaptive = name_of(self, "auto"), name_of(self, "adaptive")
        if self.auto is not None and not isinstance(self.auto, AutoPlanConfig):
            raise ValueError(f"{auto} must be an AutoPlanConfig or None, got {type(self.auto).__name__}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise ValueError(f"{adaptive} must be an AdaptiveConfig or None, got {type(self.adaptive).__name__}")
        if self.adaptive is not None and self.auto is None:
            raise ValueError(f"{adaptive} needs {auto}=AutoPlanConfig(seq_len=..., micro_batch_size=..., "
                             "num_micro_batches=..., profile=...), also with an explicit plan: the "
                             "monitor predicts each step's collectives from it")

    @property
    def broadcast_staging_bytes(self) -> int:
        return self.grad_bucket_bytes if self.broadcast_bucket_bytes is None else self.broadcast_bucket_bytes

    def fingerprint_fields(self) -> dict:
        """Every field that must agree across ranks (all of them but the timeout)."""
        d = dataclasses.asdict(self)
        d.pop("timeout")
        return d

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(sorted(self.fingerprint_fields().items())).encode()).hexdigest()[:16]


def training_spec(config: EngineConfig, shape: StepShape, *, all_reduce: str | None = None,
                  optimizer: str | None = None, frozen_models: int | None = None) -> TrainingSpec:
    """The job as the planner charges it: ``shape``'s step run by an engine with ``config``'s
    settings, every route's one translation, so a plan is costed for the bytes its engine moves
    and holds. ``shape`` may be an AutoPlanConfig, whose optimizer and frozen models are then
    read unless given. ``all_reduce``: the mode to price (None: the config's; a config asking
    for "auto" must be given one, resolve_auto prices each)."""
    mode = config.all_reduce if all_reduce is None else all_reduce
    if is_auto(mode):
        raise ValueError("training_spec: config.all_reduce is 'auto'; pass the all-reduce mode to price "
                         "(flat or two_level)")
    if optimizer is None:
        optimizer = getattr(shape, "optimizer", None)
    if frozen_models is None:
        frozen_models = getattr(shape, "frozen_models", None) or 0
    kw = {} if optimizer is None else {"optimizer": optimizer}
    return TrainingSpec(**vars(shape.shape()), recompute=config.recompute, precision=config.precision,
                        reduce_dtype=config.reduce_dtype, bucket_bytes=config.grad_bucket_bytes,
                        bucket_close_bytes=config.grad_bucket_close_bytes, granularity=config.granularity, all_reduce=mode, frozen_models=frozen_models, **kw)


def engine_default(name: str) -> Any:
    """The default of one EngineConfig field (for a route that must state it, e.g. `amsp migrate`
    costing the bucket the engine will run with)."""
    f = EngineConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
