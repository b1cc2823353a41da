"""What one comparison holds fixed across systems, as a kw-only dataclass.

Every system in a comparison gets the same ``RunSpec``: model and seed (so the same initial
weights), data (``amsp_ext.train.data``: the same tokens per step, micro-batch and rank), global batch
(``micro_batch_size x num_micro_batches x world``), number of steps, optimizer and precision.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from amsp_ext import choices
from amsp_ext.choices import GRANULARITIES, OVERLAP_OPS, check_one_of
from amsp_ext.engine_config import engine_default
from amsp_ext.train.models import MODEL_CONFIGS

__all__ = ["GRANULARITIES", "OVERLAPS", "OVERLAP_LABELS", "OVERLAP_SWITCHES", "PRECISIONS", "RunSpec", "SpecError"]

# no fp16: the comparison's training steps (systems/*.py) do no loss scaling
PRECISIONS = tuple(p for p in choices.PRECISIONS if p != "fp16")
# The paper's Table V, cumulative: all on, no Broadcast overlap, no Broadcast and no AllReduce
# overlap, no overlap at all (AG/RS too), as the engine's OverlapConfig switches.
_OFF = {"all": (), "no_bc": ("broadcast",), "no_bc_ar": ("broadcast", "allreduce"),
        "none": OVERLAP_OPS}
OVERLAP_SWITCHES = {name: {op: op not in off for op in OVERLAP_OPS} for name, off in _OFF.items()}
OVERLAPS = tuple(OVERLAP_SWITCHES)
OVERLAP_LABELS = {"all": "all on", "no_bc": "no BC", "no_bc_ar": "no BC+AR", "none": "none"}


class SpecError(ValueError):
    """A comparison setting that cannot run. One line, names the field and the allowed values."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    model: str = "tiny-llama"
    seq_len: int = 128
    micro_batch_size: int = 2  # sequences per rank per micro-batch
    num_micro_batches: int = 2  # M, gradient accumulation steps
    num_steps: int = 10  # optimizer steps whose loss and time are recorded
    num_warmup_steps: int = 3  # first steps left out of the throughput median
    seed: int = 0
    precision: str = "bf16"
    lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # Logical GPUs per node. None: the launcher's local world size (LOCAL_WORLD_SIZE). Smaller
    # values let one machine pose as several nodes (no slower link between them, though).
    gpus_per_node: int | None = None
    mics_shard_size: int | None = None  # None: one node (the paper's MiCS setting)
    hpz_partition_size: int | None = None  # None: one node (ZeRO++'s recommended setting)
    amsp_plan: str = "auto"  # plan for the "amsp-plan" system: factors, a name, or "auto"
    amsp_overlap: str = "all"  # one of OVERLAPS
    # The AMSP rows' sharding unit; the engine's default ("layer", as the FSDP2 rows wrap: like
    # for like). "module": every Linear its own unit (the paper's module-level AG/RS).
    amsp_granularity: str = engine_default("granularity")
    trace: bool = True  # profile one extra step for the exposed-communication figure
    dist_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.model not in MODEL_CONFIGS:
            raise SpecError(f"model must be one of {', '.join(MODEL_CONFIGS)}, got {self.model!r}")
        max_pos = MODEL_CONFIGS[self.model]["max_position_embeddings"]
        if not 1 <= self.seq_len <= max_pos:
            raise SpecError(f"seq_len must be in 1..{max_pos} for {self.model}, got {self.seq_len}")
        for name in ("micro_batch_size", "num_micro_batches", "num_steps"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_warmup_steps < self.num_steps:
            raise SpecError(f"num_warmup_steps must be in 0..num_steps-1 ({self.num_steps - 1}), "
                            f"got {self.num_warmup_steps}")
        check_one_of(self.precision, PRECISIONS, "precision", error=SpecError)
        check_one_of(self.amsp_granularity, GRANULARITIES, "amsp_granularity", error=SpecError)
        check_one_of(self.amsp_overlap, OVERLAPS, "amsp_overlap", error=SpecError)
        for name in ("gpus_per_node", "mics_shard_size", "hpz_partition_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise SpecError(f"{name} must be >= 1 or unset, got {v}")
        if self.lr <= 0 or self.grad_clip <= 0 or self.weight_decay < 0:
            raise SpecError("lr and grad_clip must be > 0 and weight_decay >= 0, got "
                            f"{self.lr}, {self.grad_clip}, {self.weight_decay}")
        if self.dist_timeout_s <= 0:
            raise SpecError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")

    @property
    def tokens_per_rank_per_step(self) -> int:
        return self.micro_batch_size * self.seq_len * self.num_micro_batches

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown RunSpec field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**data)


def resolve_topology(spec: RunSpec, *, world_size: int, local_world_size: int) -> tuple[int, int]:
    """``(num_nodes, gpus_per_node)`` of the run; a one-line SpecError if it does not tile."""
    gpn = spec.gpus_per_node or local_world_size
    if world_size % gpn:
        raise SpecError(f"gpus_per_node={gpn} must divide the world size {world_size}")
    if gpn > local_world_size or local_world_size % gpn:
        raise SpecError(f"gpus_per_node={gpn} must divide the ranks per launched node "
                        f"({local_world_size}); logical nodes cannot straddle real ones")
    for name in ("mics_shard_size", "hpz_partition_size"):
        v = getattr(spec, name)
        if v is not None and world_size % v:
            raise SpecError(f"{name}={v} must divide the world size {world_size}")
    return world_size // gpn, gpn


__all__.append("resolve_topology")
