"""The allowed values of every enumerated option, and the small validators that check options, in
one torch-free place.

ShardConfig (runtime/config.py), TrainConfig (train/config.py, ``amsp train``), the planner's
specs, the DeepSpeed ``"amsp"`` block (integrations/settings.py), ``amsp compare``
(compare/config.py) and the CLIs all take their choices from here; none keeps a copy. Each
validator raises one line that names the field and the allowed values, as the caller's error
class (SpecError, ConfigError, ... are all ValueErrors).

This module imports nothing from amsp_ext (the planner, the bottom layer, imports it).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

__all__ = [
    "ALL_REDUCES", "ALL_REDUCE_SETTINGS", "DRYRUN_DEVICES", "DRYRUN_OPTIMIZERS", "DRYRUN_TENSORS", "GRANULARITIES",
    "INIT_WEIGHTS", "MISSING_MESH", "OBJECTIVES", "OPTIMIZERS", "OVERLAP_OPS", "WHOLE_TENSOR_OPTIMIZERS",
    "OPTIMIZER_KINDS", "OWNERSHIPS",
    "PLANNER_OVERLAP_OF", "PRECISIONS", "check_bool", "check_int", "check_number", "check_one_of", "is_int",
    "parse_size", "reduce_dtypes",
    "TENSOR_PARALLEL_DEGREES", "OPTION_KEY", "described",
]

# compute dtype of parameters and gradients (masters and optimizer states are always fp32)
PRECISIONS = ("fp32", "bf16", "fp16")

# FSDP unit: each Linear of a decoder layer ("module", the paper's) or the whole layer
GRANULARITIES = ("module", "layer")
# inter-tensor optimizer-state ownership (runtime/optim/ownership.py)
OWNERSHIPS = ("greedy", "blocks")
# how an optimizer reads a tensor: element by element, or whole (runtime/optim/kinds.py); detect:
# from its class, never guessing "elementwise" for a class it does not know
OPTIMIZER_KINDS = ("detect", "elementwise", "whole_tensor")
# initial weights: rank 0's broadcast to all (as DDP), or compared and refused when they differ
INIT_WEIGHTS = ("broadcast", "check")
# what plan "auto" minimises: the paper's Eq. 1 communication time or the modelled step time
OBJECTIVES = ("comm", "step")
# a mesh the bandwidth profile lacks: refuse, or fit it from the profile's other meshes
MISSING_MESH = ("error", "fit")
# a dry run's tensors: without storage (any model, any device) or allocated (a GPU's allocator),
# and where they live (tools/dryrun.py [Note: real tensors on a GPU])
DRYRUN_TENSORS = ("fake", "real")
# the optimizers a dry run builds (tools/dryrun.py _optimizer_factory), by the planner's names
DRYRUN_OPTIMIZERS = ("adamw", "muon", "adafactor")
DRYRUN_DEVICES = ("cpu", "cuda")
# optimizers the planner's memory model knows the state size of
OPTIMIZERS = ("adamw", "sgd-momentum", "lion", "adam8bit", "muon", "adafactor")
# of those, the ones that read each tensor whole (runtime/optim/kinds.py; priced in planner/cost.py)
WHOLE_TENSOR_OPTIMIZERS = ("muon", "adafactor")
# how a gradient all-reduce over several ranks on each of several nodes runs: one flat
# collective, or reduce-scatter in the node / all-reduce across / all-gather in the node
# (runtime/collectives.py [Note: two-level all-reduce])
ALL_REDUCES = ("flat", "two_level")
# what a user may ask for: one of those, or "auto", the one the planner's step model prices
# lower for the plan (planner/auto.py [Note: all_reduce "auto"])
ALL_REDUCE_SETTINGS = (*ALL_REDUCES, "auto")
# the overlaps that can be switched off (the paper's Table V; OverlapConfig's fields)
OVERLAP_OPS = ("allgather", "allreduce", "broadcast")
# the same switches in the planner's step model (planner/step.py OverlapRules, `amsp plan`)
PLANNER_OVERLAP_OF = {"allgather": "ag_rs", "allreduce": "ar", "broadcast": "bc"}

# tensor-parallel degrees `amsp plan --tensor-parallel` takes and "auto" searches: inside one
# node of up to 8 GPUs (planner/tensor_parallel.py)
TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)


# [Note: a field described below the schema]
# A field the planner declares (planner/specs.py StepShape) is also a flag of every command that
# takes it, and the planner may not import the schema (docs/DESIGN.md). So the planner describes
# it with ``described`` (help and bounds as plain values, under the key the schema reads) and
# the schema turns the description into an Option like its own ``option(...)``: one declaration,
# one default, on every surface.
OPTION_KEY = "amsp_option"


def described(default: Any, *, help: str = "", **meta: Any) -> Any:
    """A dataclass field with a default and the flag's description (schema.Option's keywords:
    ``help``, ``minimum``, ``flag``, ...), for a module below the schema."""
    import dataclasses

    return dataclasses.field(default=default, metadata={OPTION_KEY: {"help": help, **meta}})


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_one_of(value: Any, allowed: Iterable[str], name: str, *, error: type = ValueError) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise error(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def reduce_dtypes(precision: str) -> tuple[str, ...]:
    """The dtypes gradients may be reduced and accumulated in under ``precision``: fp32, or the
    precision itself (the paper's 2-byte gradients). ShardConfig.reduce_dtype's Note says why
    fp32 is the default."""
    return ("fp32",) if precision == "fp32" else ("fp32", precision)


def check_bool(value: Any, name: str, *, error: type = ValueError) -> None:
    if not isinstance(value, bool):
        raise error(f"{name} must be true or false, got {value!r}")


def check_int(value: Any, name: str, *, minimum: int | None = 1, allow_none: bool = False,
              error: type = ValueError) -> None:
    """An integer >= ``minimum`` (None: any); bools are refused (``True`` is not a count)."""
    if value is None and allow_none:
        return
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise error(f"{name} must be an integer{bound}{' or unset' if allow_none else ''}, "
                    f"got {value!r}")


def check_number(value: Any, name: str, *, minimum: float | None = None,
                 above: float | None = None, below: float | None = None,
                 allow_none: bool = False, error: type = ValueError) -> None:
    """A finite number with optional bounds: ``minimum`` <= v, ``above`` < v, v < ``below``."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value >= minimum
    if ok and above is not None:
        ok = value > above
    if ok and below is not None:
        ok = value < below
    if not ok:
        bounds = [f">= {minimum:g}" if minimum is not None else "",
                  f"> {above:g}" if above is not None else "",
                  f"< {below:g}" if below is not None else ""]
        what = " and ".join(b for b in bounds if b) or "finite"
        raise error(f"{name} must be a number {what}, got {value!r}")


_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")
_MAX_SIZE = 2**63 - 1  # what an int64 byte count holds


def parse_size(text: Any, *, field: str = "size", allow_zero: bool = False,
               error: type = ValueError) -> int:
    """``"80GiB"``, ``"40GB"``, ``"81920MiB"`` -> bytes. A number without a unit is refused:
    ``80`` could mean GB or GiB (a 7% difference, enough to flip a plan)."""
    allowed = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    if isinstance(text, bool) or not isinstance(text, str):
        raise error(f"{field} needs a unit ({allowed}), e.g. '80GiB'; got {text!r}")
    m = _SIZE_RE.match(text)
    if not m:
        raise error(f"{field} needs a number and a unit ({allowed}), e.g. '80GiB'; got {text!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise error(f"{field}: unknown unit {m.group(2)!r}; allowed: {allowed}")
    if value < 0 or (value == 0 and not allow_zero):
        raise error(f"{field} must be {'>= 0' if allow_zero else 'positive'}, got {text!r}")
    num_bytes = value * _UNITS[unit]
    if not math.isfinite(num_bytes) or num_bytes > _MAX_SIZE:
        raise error(f"{field} must be at most 8 EiB (2^63 - 1 bytes), got {text!r}")
    return int(round(num_bytes))
