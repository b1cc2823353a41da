"""The planner-input flags that several commands take (``--profile``, ``--gpu-memory``,
``--memory-reserve``, ``--missing-mesh``), one definition each: their names, metavars and
defaults come from planner/defaults.py, so ``amsp plan``, ``dryrun``, ``simulate``, ``migrate``,
``config`` and ``compare`` cannot drift apart. A command says only what differs for it: whether
the flag is required, a default of its own with its reason, and what the flag is for."""

from __future__ import annotations

from amsp_ext.choices import MISSING_MESH
from amsp_ext.planner.defaults import (DEFAULT_GPU_MEMORY, DEFAULT_MEMORY_RESERVE, DEFAULT_MISSING_MESH,
                                       DEFAULT_PROFILE)

__all__ = ["add_gpu_memory", "add_memory_reserve", "add_missing_mesh", "add_profile", "check_counts"]


def add_profile(group, *, what: str = "bandwidth profile") -> None:
    group.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                       help=f"{what}: a bundled name or a JSON file, e.g. from `amsp profile` "
                            f"(default {DEFAULT_PROFILE})")


def add_gpu_memory(group, *, required: bool = False, default: str | None = DEFAULT_GPU_MEMORY,
                   what: str = "memory per GPU") -> None:
    """``default`` None: the command fills it (the device's memory); say so in ``what``."""
    if required:
        group.add_argument("--gpu-memory", required=True, metavar="SIZE",
                           help=f"{what}, with a unit, e.g. 80GiB or 40GB")
        return
    shown = f"default {default}" if default is not None else "default: the device's"
    group.add_argument("--gpu-memory", default=default, metavar="SIZE",
                       help=f"{what}, with a unit, e.g. 80GiB or 40GB ({shown})")


def add_memory_reserve(group) -> None:
    group.add_argument("--memory-reserve", default=DEFAULT_MEMORY_RESERVE, metavar="SIZE",
                       help="memory the model cannot use per GPU: CUDA context, NCCL buffers, "
                            f"allocator slack (default {DEFAULT_MEMORY_RESERVE})")


def add_missing_mesh(group, *, default: str = DEFAULT_MISSING_MESH) -> None:
    group.add_argument("--missing-mesh", choices=MISSING_MESH, default=default,
                       help=f"a mesh the profile lacks: refuse (error) or estimate it by an "
                            f"alpha-beta fit (fit) (default {default})")


def check_counts(args, dests: tuple[str, ...]) -> None:
    """The integer flags ``dests`` (argparse dests; None: not given) are >= 1, else the one-line
    error names the flag as the user typed it (a config built from them would name its field)."""
    for dest in dests:
        v = getattr(args, dest)
        if v is not None and v < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be an integer >= 1, got {v}")
