"""StepShape, ClusterSpec and TrainingSpec: the planner's inputs besides the model and the profile.

kw-only dataclasses that validate themselves in ``__post_init__``; every error is one line that
names the field and the allowed values. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType

from amsp_ext.choices import (ALL_REDUCES, GRANULARITIES, OPTIMIZERS, PRECISIONS, check_one_of, described,
                              reduce_dtypes)
from amsp_ext.planner.defaults import (DEFAULT_ALL_REDUCE, DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_GRANULARITY,
                                       DEFAULT_MICRO_BATCH_SIZE, DEFAULT_MICRO_BATCHES, DEFAULT_OPTIMIZER,
                                       DEFAULT_PEAK_FLOPS, DEFAULT_PRECISION, DEFAULT_REDUCE_DTYPE,
                                       DEFAULT_SEQ_LEN)
from amsp_ext.choices import parse_size as _parse_size

__all__ = [
    "ClusterSpec",
    "SpecError",
    "PAPER_JOB",
    "STEP_SHAPE_FIELDS",
    "StepShape",
    "TrainingSpec",
    "paper_job",
    "parse_size",
]


class SpecError(ValueError):
    """Bad cluster or training input. One line, naming the field."""


def parse_size(text: str | int | float, *, field: str = "size", allow_zero: bool = False) -> int:
    """``"80GiB"`` -> bytes (amsp_ext.choices.parse_size), as a SpecError."""
    return _parse_size(text, field=field, allow_zero=allow_zero, error=SpecError)


def format_size(num_bytes: int | float) -> str:
    """Bytes as the largest binary unit that keeps the number >= 1 (``parse_size`` reads it back)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def _positive_int(obj: object, name: str) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"{name} must be an integer >= 1, got {v!r}")


def _positive_number(obj: object, name: str) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SpecError(f"{name} must be a positive number, got {v!r}")


# [Note: a step's shape, declared once]
# seq_len, micro_batch_size and num_micro_batches are declared here and nowhere else: the
# planner's TrainingSpec and AutoPlanConfig, `amsp train`'s and `amsp compare`'s batch, `amsp
# plan` / `amsp dryrun` / `amsp simulate` / `amsp config` / `amsp migrate`'s flags and the ds_config's
# "amsp" keys all inherit or read these fields (the flags through choices.described, the schema
# below the planner cannot be imported here), so a field has one name, one help, one bound and
# one default on every surface. A surface that must not assume a value (a ds_config planned
# with "auto" names no sequence length of its own) asks for it at the surface, by name; it does
# not declare a second default.
@dataclass(frozen=True, kw_only=True)
class StepShape:
    """One step on one data-parallel rank: ``num_micro_batches`` (M) micro-batches of
    ``micro_batch_size`` sequences of ``seq_len`` tokens ([Note: a step's shape, declared once])."""

    seq_len: int = described(DEFAULT_SEQ_LEN, help="tokens per sequence", minimum=1)
    micro_batch_size: int = described(DEFAULT_MICRO_BATCH_SIZE, minimum=1,
                                      help="sequences per micro-batch on each data-parallel rank")
    num_micro_batches: int = described(DEFAULT_MICRO_BATCHES, minimum=1, flag="--micro-batches",
                                       help="M micro-batches per step (gradient accumulation)")

    def __post_init__(self) -> None:
        for name in STEP_SHAPE_FIELDS:
            _positive_int(self, name)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    def shape(self) -> "StepShape":
        """The step's shape alone (a subclass's other fields dropped)."""
        return StepShape(**{n: getattr(self, n) for n in STEP_SHAPE_FIELDS})


STEP_SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """N nodes x R GPUs. Defaults describe the paper's A800-80GB nodes.

    ``peak_flops`` (dense 16-bit FLOP/s per GPU) and ``memory_bandwidth`` (HBM bytes/s) only feed
    the step-time objective and MFU; ``nodes_per_leaf`` lets the report say which groups cross
    leaf switches (the adapter keeps a group under one leaf when it fits).
    """

    num_nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    peak_flops: float = DEFAULT_PEAK_FLOPS
    memory_bandwidth: float = 2.039e12  # A800 80GB HBM2e
    nodes_per_leaf: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node", "gpu_memory_bytes"):
            _positive_int(self, name)
        for name in ("peak_flops", "memory_bandwidth"):
            _positive_number(self, name)
        if self.nodes_per_leaf is not None:
            _positive_int(self, "nodes_per_leaf")
            if self.num_nodes % self.nodes_per_leaf and self.nodes_per_leaf % self.num_nodes:
                raise SpecError(
                    f"nodes_per_leaf={self.nodes_per_leaf} must divide num_nodes={self.num_nodes}"
                )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class TrainingSpec(StepShape):
    """One training step: M micro-batches of ``micro_batch_size`` sequences of ``seq_len`` tokens
    (the StepShape), and what the engine runs it with.

    M is ``num_micro_batches``, or, where ``global_batch_tokens`` or ``global_batch_size``
    (sequences) is given (at most one, and ``num_micro_batches`` then left at its default), it
    follows from the data-parallel world size and must be exact.
    ``bucket_bytes`` is the gradient all-reduce bucket size U of Eq. Tg / T0_os.
    ``reduce_dtype`` is the dtype gradients are reduced and accumulated in (the engine's
    ShardConfig.reduce_dtype); None = the precision, the paper's 2-byte gradients in bf16.
    Each default is the engine's (planner/defaults.py), so a spec describes what the engine
    runs unless told otherwise.
    ``all_reduce`` is how the engine runs a gradient all-reduce (ShardConfig.all_reduce; the
    timer prices it, profile.py [Note: a two-level all-reduce's time]).
    """

    global_batch_tokens: int | None = None
    global_batch_size: int | None = None
    recompute: bool = False
    precision: str = DEFAULT_PRECISION
    optimizer: str = DEFAULT_OPTIMIZER
    bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES
    # where a gradient bucket closes at a unit boundary; None: from the link the plan's boundary
    # all-reduce runs on (planner/buckets.py [Note: where a bucket closes, from the link])
    bucket_close_bytes: int | None = None
    granularity: str = DEFAULT_GRANULARITY
    reduce_dtype: str | None = DEFAULT_REDUCE_DTYPE
    all_reduce: str = DEFAULT_ALL_REDUCE
    # frozen models of this model's shape on the same ranks (a DPO / GRPO reference, a same-size
    # reward model), each a forward-only engine sharded by the plan's p ([Note: frozen models])
    frozen_models: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(self, "bucket_bytes")
        if self.bucket_close_bytes is not None:
            _positive_int(self, "bucket_close_bytes")
        given = [n for n in ("global_batch_tokens", "global_batch_size") if getattr(self, n) is not None]
        if given and self.num_micro_batches != DEFAULT_MICRO_BATCHES:
            given.append("num_micro_batches")
        if len(given) > 1:
            raise SpecError(
                "give at most one of global_batch_tokens, global_batch_size or num_micro_batches"
                f", got {', '.join(given)}"
            )
        for name in given:
            _positive_int(self, name)
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_len:
            raise SpecError(
                f"global_batch_tokens={self.global_batch_tokens} is not a multiple of "
                f"seq_len={self.seq_len}"
            )
        if not isinstance(self.recompute, bool):
            raise SpecError(f"recompute must be true or false, got {self.recompute!r}")
        if isinstance(self.frozen_models, bool) or not isinstance(self.frozen_models, int) or self.frozen_models < 0:
            raise SpecError(f"frozen_models must be an integer >= 0, got {self.frozen_models!r}")
        for name, allowed in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS),
                              ("granularity", GRANULARITIES), ("all_reduce", ALL_REDUCES)):
            check_one_of(getattr(self, name), allowed, name, error=SpecError)
        if self.reduce_dtype is not None:
            check_one_of(self.reduce_dtype, reduce_dtypes(self.precision), "reduce_dtype", error=SpecError)

    @property
    def grad_dtype(self) -> str:
        """The dtype gradients are reduced and accumulated in."""
        return self.reduce_dtype or self.precision

    def micro_batches(self, world_size: int) -> int:
        """M, the micro-batches per step on each of ``world_size`` data-parallel ranks."""
        if self.global_batch_tokens is None and self.global_batch_size is None:
            return self.num_micro_batches
        seqs = self.global_batch_size
        if seqs is None:
            seqs = self.global_batch_tokens // self.seq_len
        per_step = self.micro_batch_size * world_size
        if seqs % per_step:
            what = (f"global_batch_size={seqs}" if self.global_batch_size is not None
                    else f"global_batch_tokens={self.global_batch_tokens} ({seqs} sequences)")
            raise SpecError(
                f"{what} must be a multiple of micro_batch_size x world size = "
                f"{self.micro_batch_size} x {world_size} = {per_step}"
            )
        return seqs // per_step


# [Note: frozen models]
# Post-training jobs run frozen models beside the trained one on the same ranks: DPO's and
# GRPO's reference, a reward model, a teacher. Each is a forward-only engine (runtime/sync/
# grad_sync.py [Note: a model without an optimizer]) sharded by the same plan's p factors. The
# planner charges ``frozen_models`` copies of the trained model's shape: their parameter shards
# (e*Phi/sp each, memory.py), their forward all-gathers (one per unit per micro-batch, no
# reduce-scatter, cost.py) and their forward compute (step.py). A frozen model of another size
# is not priced apart: count it as the number of trained-model sizes it covers, rounded up.

# [Note: the paper's job]
# The paper's equations and results (Eq. 1-7, Table IV, Fig. 16) are for bf16 training with
# 2-byte gradients, one sharding unit per Linear (its module-level prefetch) and a gradient
# bucket U of 128 MB (review section 3: "U of typically 64-128 MB"). TrainingSpec's defaults
# are the engine's instead (planner/defaults.py: fp32, fp32 reduction, a unit per layer, DDP's
# 25 MiB), as every entry point that plans a run of the engine needs; what reproduces the
# paper asks for the paper's job by name: a plan costed for a job the engine does not run is
# wrong (comparisons/results/design_history.md, "TrainingSpec's defaults").
PAPER_JOB = MappingProxyType({"precision": "bf16", "reduce_dtype": None, "granularity": "module",
                              "bucket_bytes": 128 * 2**20})


def paper_job(**kw) -> TrainingSpec:
    """A TrainingSpec of the paper's job ([Note: the paper's job]); ``kw`` overrides any field."""
    return TrainingSpec(**{**PAPER_JOB, **kw})
