"""The planner-input options that several commands take (``--profile``, ``--gpu-memory``,
``--memory-reserve``, ``--missing-mesh``), one definition each: their names, metavars and
defaults come from planner/defaults.py, so ``amsp plan``, ``dryrun``, ``simulate``, ``migrate``,
``config`` and ``compare`` cannot drift apart. A command says only what differs for it: whether
the flag is required, a default of its own with its reason, and what the flag is for.

The ``*_option`` functions are fields of a command's options dataclass (schema.option); the
``add_*`` functions give the same flags to a command whose other flags are not a dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from amsp_ext import schema
from amsp_ext.choices import MISSING_MESH
from amsp_ext.common.models import MODEL_CONFIGS
from amsp_ext.planner.model_spec import MODEL_PRESETS
from amsp_ext.planner.defaults import (CLUSTER_PROFILE, DEFAULT_GPU_MEMORY, DEFAULT_MEMORY_RESERVE,
                                       DEFAULT_MISSING_MESH, DEFAULT_PROFILE)
from amsp_ext.schema import check_options, option

__all__ = ["ModelChoice", "World", "add_gpu_memory", "add_memory_reserve", "add_missing_mesh", "add_profile",
           "gpu_memory_option", "memory_reserve_option", "missing_mesh_option", "profile_option"]


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """The model a command plans for: a preset or a Hugging Face config.json, exactly one."""

    model: str | None = option(None, one_of="model", required=True,
                               help=f"preset: {', '.join([*MODEL_PRESETS, *MODEL_CONFIGS])} (the last "
                                    "ones are amsp train's built-in models)")
    model_config: str | None = option(None, one_of="model", required=True, metavar="PATH",
                                      help="a Hugging Face config.json of a Llama-style model")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class World:
    """The cluster a command plans for without running on it."""

    nodes: int | None = option(None, required=True, minimum=1, help="N, number of nodes")
    gpus_per_node: int | None = option(None, required=True, minimum=1, help="R, GPUs per node")

    def __post_init__(self) -> None:
        check_options(self)


def profile_option(*, what: str = "bandwidth profile", default: str = DEFAULT_PROFILE) -> Any:
    """``default``: DEFAULT_PROFILE where the command plans off the cluster, CLUSTER_PROFILE
    where the job it plans runs on the cluster (defaults.py [Note: which profile auto plans with])."""
    here = (f"'{CLUSTER_PROFILE}' (default: the cluster's own, cached or measured in the job), "
            if default == CLUSTER_PROFILE else "")
    return option(default, metavar="NAME|PATH",
                  help=f"{what}: {here}a bundled name or a JSON file, e.g. from `amsp profile`")


def gpu_memory_option(*, required: bool = False, default: str | None = DEFAULT_GPU_MEMORY,
                      what: str = "memory per GPU") -> Any:
    """``default`` None: the command fills it (the device's memory); the help says so."""
    unset = "" if required or default is not None else " (default: the device's)"
    return option(None if required else default, metavar="SIZE", required=required,
                  help=f"{what}, with a unit, e.g. 80GiB or 40GB{unset}")


def memory_reserve_option() -> Any:
    return option(DEFAULT_MEMORY_RESERVE, metavar="SIZE",
                  help="memory the model cannot use per GPU: CUDA context, NCCL buffers, allocator slack")


def missing_mesh_option(*, default: str = DEFAULT_MISSING_MESH) -> Any:
    return option(default, choices=MISSING_MESH,
                  help="a mesh the profile lacks: refuse (error) or estimate it by an alpha-beta fit (fit)")


def tensor_parallel_option(*, what: str, flag: str | None = None) -> Any:
    """The planner's TP degree: one of choices.TENSOR_PARALLEL_DEGREES, or auto (searched with
    the six factors, planner/joint.py)."""
    from amsp_ext.choices import TENSOR_PARALLEL_DEGREES

    return option("1", flag=flag, choices=(*map(str, TENSOR_PARALLEL_DEGREES), "auto"), help=what)


def frozen_models_option() -> Any:
    """Frozen models of the trained model's shape on the same GPUs (planner/specs.py [Note:
    frozen models]): `amsp plan` prices them, `amsp dryrun` runs them beside the trained one."""
    return option(0, minimum=0, help="frozen models of this shape on the same GPUs (a DPO/GRPO reference, "
                                     "a same-size reward model): their shards, forward gathers and "
                                     "forward compute count")


def max_global_batch_tokens_option(*, what: str) -> Any:
    return option(None, minimum=1, metavar="N", help=f"the largest global batch accepted: {what}")


def _add(group, name: str, opt: Any) -> None:
    """One option's flag, generated as a dataclass field's is (schema.add_arguments)."""
    kind = str | None if opt.default is None else str
    cls = dataclasses.make_dataclass("Flags", [(name, kind, opt)], frozen=True, kw_only=True)
    schema.add_arguments(group, cls)


def add_profile(group, *, what: str = "bandwidth profile", default: str = DEFAULT_PROFILE) -> None:
    _add(group, "profile", profile_option(what=what, default=default))


def add_gpu_memory(group, *, default: str | None = DEFAULT_GPU_MEMORY, what: str = "memory per GPU") -> None:
    _add(group, "gpu_memory", gpu_memory_option(default=default, what=what))


def add_memory_reserve(group) -> None:
    _add(group, "memory_reserve", memory_reserve_option())


def add_missing_mesh(group, *, default: str = DEFAULT_MISSING_MESH) -> None:
    _add(group, "missing_mesh", missing_mesh_option(default=default))
