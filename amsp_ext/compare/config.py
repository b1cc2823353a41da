"""What one comparison holds fixed across systems, as a kw-only dataclass.

Every system in a comparison gets the same ``RunSpec``: model and seed (so the same initial
weights), data (``amsp_ext.common.data``: the same tokens per step, micro-batch and rank), global batch
(``micro_batch_size x num_micro_batches x world``), number of steps, optimizer and precision.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from amsp_ext import choices
from amsp_ext.choices import ALL_REDUCE_SETTINGS, GRANULARITIES, OVERLAP_OPS
from amsp_ext.engine_config import engine_default
from amsp_ext.planner.specs import StepShape
from amsp_ext.schema import check_options, name_of, option
from amsp_ext.common.models import MODEL_CONFIGS

__all__ = ["GRANULARITIES", "OVERLAPS", "OVERLAP_LABELS", "OVERLAP_SWITCHES", "PRECISIONS", "REDUCE_DTYPES", "RunSpec", "SpecError"]

# no fp16: the comparison's training steps (systems/*.py) do no loss scaling
PRECISIONS = tuple(p for p in choices.PRECISIONS if p != "fp16")
REDUCE_DTYPES = ("fp32", "bf16")
# The paper's Table V, cumulative: all on, no Broadcast overlap, no Broadcast and no AllReduce
# overlap, no overlap at all (AG/RS too), as the engine's OverlapConfig switches.
_OFF = {"all": (), "no_bc": ("broadcast",), "no_bc_ar": ("broadcast", "allreduce"),
        "none": OVERLAP_OPS}
OVERLAP_SWITCHES = {name: {op: op not in off for op in OVERLAP_OPS} for name, off in _OFF.items()}
OVERLAPS = tuple(OVERLAP_SWITCHES)
OVERLAP_LABELS = {"all": "all on", "no_bc": "no BC", "no_bc_ar": "no BC+AR", "none": "none"}
# a mesh the planner's profile lacks (--amsp-plan auto): estimated by an alpha-beta fit, not
# refused as `amsp plan` does (planner/defaults.py): a profile measured on a small lab never
# has every mesh the systems' plans use
COMPARE_MISSING_MESH = "fit"
# Wall clock for one system's whole run (start-up, warm-up, steps, trace), not a collective's
# timeout: a stuck system is stopped (compare/launch.py) and reported as failed, and the table
# goes on with the next one.
SYSTEM_TIMEOUT_S = 600.0
# The workers' collective timeout, below the engine's default: a hung collective must fail
# inside the system's wall clock (SYSTEM_TIMEOUT_S) so that the row says which
# collective hung instead of only that the system was stopped.
WORKER_TIMEOUT_S = 300.0


class SpecError(ValueError):
    """A comparison setting that cannot run. One line, names the field and the allowed values."""


@dataclass(frozen=True, kw_only=True)
class RunSpec(StepShape):
    """The step's shape (StepShape: seq_len, micro_batch_size, num_micro_batches per rank) and
    the comparison's settings. Its options are ``amsp compare``'s flags (schema.py; cli/compare.py picks which and
    fills the --quick / full-table presets); the others are fixed for every comparison. A bad
    value is a one-line SpecError naming the flag (command line) or ``spec.<field>``."""

    SCHEMA_NAME = "spec"

    model: str = option("tiny-llama", choices=MODEL_CONFIGS, help="the model every system trains")
    num_steps: int = option(10, minimum=1, flag="--steps",
                            help="optimizer steps whose loss and time are recorded")
    num_warmup_steps: int = option(3, minimum=0, flag="--warmup-steps",
                                   help="steps left out of the throughput median")
    seed: int = option(0, help="model initialisation and data seed, the same for every system")
    precision: str = option("bf16", choices=PRECISIONS,
                            help="compute dtype of every system (default bf16, or fp32 on a CPU "
                                 "without native bf16, which says so before the run)")
    # [Note: one wire dtype for every system]
    # The gradient reduction dtype is set for every row the way that system's users set it (DDP:
    # the bf16 compression comm hook; FSDP2/HSDP: MixedPrecisionPolicy(reduce_dtype); DeepSpeed:
    # communication_data_type; AMSP: EngineConfig.reduce_dtype), so that a throughput ratio
    # compares engines and plans, not 4-byte against 2-byte gradients: left to their defaults,
    # AMSP and DeepSpeed would reduce bf16 where DDP and FSDP2 reduce fp32.
    # Default fp32, the engine's default. bf16 needs --precision bf16: a bf16 wire under fp32
    # compute is a configuration the AMSP engine does not offer (EngineConfig refuses it), so no
    # like-for-like AMSP row could exist; refused here before any launch. What each row really
    # sent is measured from its trace (compare/wire.py), not taken from this setting.
    reduce_dtype: str = option(engine_default("reduce_dtype"), choices=REDUCE_DTYPES,
                               help="gradient reduction dtype of every system (default fp32; bf16 "
                                    "needs --precision bf16)")
    lr: float = option(1e-3, above=0)
    weight_decay: float = option(0.1, minimum=0)
    grad_clip: float = option(1.0, above=0)
    # Logical GPUs per node. None: the launcher's local world size (LOCAL_WORLD_SIZE). Smaller
    # values let one machine pose as several nodes (no slower link between them, though).
    gpus_per_node: int | None = option(None, minimum=1,
                                       help="logical GPUs per node (default: ranks per launched node)")
    mics_shard_size: int | None = option(None, minimum=1, help="default: one node (the paper's MiCS setting)")
    hpz_partition_size: int | None = option(None, minimum=1,
                                            help="default: one node (ZeRO++'s recommended setting)")
    amsp_plan: str = option("auto", help="plan of the 'AMSP (planner's plan)' row: auto | ddp | zero1 "
                                         "| mics:K | p=AxB,g=..,os=..")
    amsp_overlap: str = option("all", choices=OVERLAPS)  # the ablation mode sets it per row
    # The AMSP rows' sharding unit; the engine's default ("layer", as the FSDP2 rows wrap: like
    # for like). "module": every Linear its own unit (the paper's module-level AG/RS).
    amsp_granularity: str = option(engine_default("granularity"), choices=GRANULARITIES,
                                   help="sharding unit of the AMSP rows: one per decoder layer, as "
                                        "the FSDP2 rows wrap, or every Linear (the paper's "
                                        "module-level AG/RS)")
    amsp_all_reduce: str = option(engine_default("all_reduce"), choices=ALL_REDUCE_SETTINGS,
                                  help="how the AMSP rows run a gradient all-reduce that spans "
                                       "nodes with several ranks on each (EngineConfig.all_reduce; "
                                       "auto: the launcher decides it per row with the planner)")
    trace: bool = option(True, help="profile extra steps for the exposed-communication figure")
    trace_steps: int = option(1, minimum=1,
                              help="steps profiled per round (after one more that is not read); "
                                   "the breakdown is the one whose exposed time is the median")
    limit_rounds: int = option(1, minimum=0,
                               help="rounds (the first N) in which each row's steps also run under "
                                    "the fake process group for its compute-only time "
                                    "(compare/limit.py); 0: none")
    dist_timeout_s: float = option(WORKER_TIMEOUT_S, above=0)

    def __post_init__(self) -> None:
        try:
            check_options(self)
            max_pos = MODEL_CONFIGS[self.model]["max_position_embeddings"]
            if self.seq_len > max_pos:
                raise SpecError(f"{name_of(self, 'seq_len')} must be in 1..{max_pos} for {self.model}, "
                                f"got {self.seq_len}")
            allowed = choices.reduce_dtypes(self.precision)  # the engine's rule (engine_config.py)
            if self.reduce_dtype not in allowed:
                raise SpecError(f"{name_of(self, 'reduce_dtype')} must be one of {', '.join(allowed)} with "
                                f"precision {self.precision} (bf16 needs precision bf16), got {self.reduce_dtype}")
            if self.num_warmup_steps >= self.num_steps:
                raise SpecError(f"{name_of(self, 'num_warmup_steps')} must be in 0..num_steps-1 "
                                f"({self.num_steps - 1}), got {self.num_warmup_steps}")
        except SpecError:
            raise
        except ValueError as e:  # the schema's one-line error, as the comparison's error type
            raise SpecError(str(e)) from None

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
