"""What ``amsp profile`` measures, and how a measurement becomes the planner's profile JSON.

Pure Python (no torch): the mesh list, the rank layout of each mesh, the message sizes, the
alpha-beta fit and the profile document are all unit-tested without launching ranks.
:mod:`amsp_ext.runtime.measure.profiler` runs the collectives.

[Note: which meshes]
The planner costs four collectives on these meshes (DESIGN.md, group table), with ``a | R`` and
``b | N``:

* AllGather / ReduceScatter on the parameter-shard mesh ``s0_p x s1_p``, which the cross-node
  rule (Eq. 7) confines to ``b == 1`` or ``a == R``;
* AllReduce on the replica mesh ``(R/s0_p) x (N/s1_p)`` and the gradient mesh, and Broadcast on
  the ``optim_bcast`` mesh ``(s0_os/s0_p) x (s1_os/s1_p)``. With ``s1_p = 1`` these reach meshes
  such as ``1 x N`` or ``(R/2) x N`` that Eq. 7 would forbid for a shard group, so AllReduce and
  Broadcast are measured on every ``a x b``.

``--all-meshes`` also measures the shard ops on the meshes Eq. 7 excludes (for costing a
hand-written plan that breaks it).

[Note: measuring the way training runs]
A shape is measured with every group of that shape active at once: all ``R*N/(a*b)`` groups run
the same collective at the same time, so groups that cross nodes share each node's link exactly
as they do in a training step (``"concurrency": "all_groups"``). The groups are the ones
:func:`amsp_ext.topology.groups.rank_groups` forms in training: shard ops on the contiguous
``param_shard`` layout, AllReduce/Broadcast on the strided ``param_replica`` layout (which is also
the broadcast layout when optimizer states span the world). With leaf switches, nodes are placed
in leaf order exactly as in training. One repetition takes as long as its slowest rank; the entry
is the median over repetitions of that time.

[Note: sizes]
``v`` follows the paper: AllGather v = gathered output bytes, ReduceScatter v = input bytes,
AllReduce and Broadcast v = buffer bytes; bandwidth w = v / t (algorithm bandwidth, GB/s = 1e9
B/s). A size is rounded down to a multiple of ``group size x element size`` so every rank holds
an equal shard; the recorded bytes are the ones moved.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field

from amsp_ext.engine_config import DEFAULT_TIMEOUT_S
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.prefilter import divisors, priced_meshes
from amsp_ext.planner.profile import OPS, SCHEMA
from amsp_ext.topology.groups import World, rank_groups

__all__ = [
    "OPS",
    "Case",
    "ProfileConfig",
    "ProfileError",
    "alpha_beta_fit",
    "cases",
    "message_sizes",
    "profile_document",
]

SHARD_OPS = ("allgather", "reducescatter")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1 << 20


class ProfileError(ValueError):
    """Bad profiler input (config, world shape); one line naming the field."""


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    min_bytes: int = MiB
    max_bytes: int = 64 * MiB
    size_factor: int = 2  # sizes are min_bytes * size_factor**k up to max_bytes
    ops: tuple[str, ...] = OPS
    num_warmup: int = 2
    num_reps: int = 5
    dtype: str = "bfloat16"
    all_meshes: bool = False
    priced_only: bool = False  # only the meshes the planner prices (prefilter.priced_meshes)
    timeout_s: float = DEFAULT_TIMEOUT_S  # per collective: the engine's

    def __post_init__(self) -> None:
        if self.min_bytes < 1024:
            raise ProfileError(f"min_bytes must be >= 1KiB, got {self.min_bytes}")
        if self.max_bytes < self.min_bytes:
            raise ProfileError(f"max_bytes ({self.max_bytes}) must be >= min_bytes ({self.min_bytes})")
        if self.max_bytes > 16 << 30:
            raise ProfileError(f"max_bytes must be <= 16GiB, got {self.max_bytes}")
        if self.size_factor < 2:
            raise ProfileError(f"size_factor must be an integer >= 2, got {self.size_factor}")
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ProfileError(f"ops must be a non-empty subset of {', '.join(OPS)}, got {list(self.ops)}")
        if self.num_warmup < 0:
            raise ProfileError(f"num_warmup must be >= 0, got {self.num_warmup}")
        if self.num_reps < 1:
            raise ProfileError(f"num_reps must be >= 1, got {self.num_reps}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.timeout_s <= 0:
            raise ProfileError(f"timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def quick(cls, **overrides) -> "ProfileConfig":
        """Three sizes a factor 4 apart, one warm-up, three repetitions."""
        base = dict(min_bytes=MiB, max_bytes=16 * MiB, size_factor=4, num_warmup=1, num_reps=3)
        base.update(overrides)
        return cls(**base)

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype]


def message_sizes(config: ProfileConfig) -> list[int]:
    out, v = [], config.min_bytes
    while v <= config.max_bytes:
        out.append(v)
        v *= config.size_factor
    if out[-1] != config.max_bytes:
        out.append(config.max_bytes)  # always measure the largest size asked for
    return out


@dataclass(frozen=True, kw_only=True)
class Case:
    op: str
    p0: int
    p1: int
    kind: str  # the group kind of topology.groups whose layout is used
    groups: tuple[tuple[int, ...], ...]  # every group of the shape; all run at once

    @property
    def size(self) -> int:
        return self.p0 * self.p1

    @property
    def label(self) -> str:
        return f"{self.op} {self.p0}x{self.p1}"


def mesh_layout(op: str, p0: int, p1: int, world: World) -> tuple[str, list[list[int]]]:
    """(kind, groups): the rank groups training runs ``op`` on for a ``p0 x p1`` mesh."""
    R, N = world.gpus_per_node, world.num_nodes
    if op in SHARD_OPS:
        plan = Plan(s0_p=p0, s1_p=p1, s0_g=p0, s1_g=p1, s0_os=R, s1_os=N)
        return "param_shard", rank_groups(plan, world)["param_shard"]
    sp0, sp1 = R // p0, N // p1
    plan = Plan(s0_p=sp0, s1_p=sp1, s0_g=sp0, s1_g=sp1, s0_os=R, s1_os=N)
    return "param_replica", rank_groups(plan, world)["param_replica"]


def cases(world: World, config: ProfileConfig) -> list[Case]:
    """Every (op, mesh) to measure, in a deterministic order every rank follows."""
    R, N = world.gpus_per_node, world.num_nodes
    priced = priced_meshes(R, N) if config.priced_only else None
    out = []
    for op in config.ops:
        for p1 in divisors(N):
            for p0 in divisors(R):
                if p0 * p1 == 1:
                    continue  # a group of one moves nothing
                if op in SHARD_OPS and not config.all_meshes and p1 > 1 and p0 != R:
                    continue  # Eq. 7: the planner never shards across nodes with part of a node
                if priced is not None and (p0, p1) not in priced[op]:
                    continue
                kind, groups = mesh_layout(op, p0, p1, world)
                out.append(Case(op=op, p0=p0, p1=p1, kind=kind, groups=tuple(tuple(g) for g in groups)))
    return out


def buffer_numel(op: str, nbytes: int, group_size: int, element_size: int) -> tuple[int, int]:
    """(numel of the full buffer v, bytes actually moved) for message size ``nbytes``.

    The full buffer is the all-gather output / reduce-scatter input; it is rounded down to a
    multiple of the group size so shards are equal.
    """
    numel = nbytes // element_size
    if op in SHARD_OPS:
        numel -= numel % group_size
    if numel < group_size:
        raise ProfileError(f"message size {nbytes} B is too small for a group of {group_size}")
    return numel, numel * element_size


def alpha_beta_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + v / bw`` over (bytes, seconds); returns (alpha_s, bw_Bps).

    Residuals are relative (weights 1/t) so the small messages that pin alpha count as much as
    the large ones that pin the bandwidth. alpha is clamped at 0; bw is inf when time does not
    grow with size.
    """
    if len(points) < 2:
        v, t = points[0]
        return 0.0, v / t
    ws = [1.0 / t for _, t in points]
    # weighted normal equations for t = a + b v
    s_w = sum(w * w for w in ws)
    s_v = sum(w * w * v for (v, _), w in zip(points, ws))
    s_vv = sum(w * w * v * v for (v, _), w in zip(points, ws))
    s_t = sum(w * w * t for (_, t), w in zip(points, ws))
    s_vt = sum(w * w * v * t for (v, t), w in zip(points, ws))
    det = s_w * s_vv - s_v * s_v
    b = (s_w * s_vt - s_v * s_t) / det
    a = (s_t - b * s_v) / s_w
    if a < 0:  # refit through the origin
        a = 0.0
        b = s_vt / s_vv
    return a, (math.inf if b <= 0 else 1.0 / b)


@dataclass(kw_only=True)
class Measurement:
    op: str
    p0: int
    p1: int
    points: list[tuple[int, float]] = field(default_factory=list)  # (bytes, median seconds)


def profile_document(measurements: list[Measurement], *, name: str, backend: str, torch_version: str,
                     world: World, link: dict, config: ProfileConfig, notes: str = "",
                     date: str | None = None) -> dict:
    """The planner's profile JSON (schema amsp-profile/1, see docs/DESIGN.md)."""
    entries = []
    for m in measurements:
        pts = sorted(m.points)
        entries.append({
            "op": m.op, "p0": m.p0, "p1": m.p1,
            "points": [{"bytes": int(v), "GBps": float(f"{v / t / 1e9:.6g}")} for v, t in pts],
        })
    how = (
        f"amsp profile: {config.dtype}, sizes {config.min_bytes}..{config.max_bytes} B (x{config.size_factor}), "
        f"{config.num_warmup} warm-up + {config.num_reps} timed repetitions; each repetition is timed "
        f"by its slowest rank after a barrier, GBps = v / median time with the paper's v "
        f"(allgather: output bytes, reducescatter: input bytes); all groups of a mesh run at once."
    )
    return {
        "schema": SCHEMA,
        "name": name,
        "metadata": {
            "source": "measured",
            "backend": backend,
            "date": date or _dt.date.today().isoformat(),
            "torch": torch_version,
            "world": {"nodes": world.num_nodes, "gpus_per_node": world.gpus_per_node},
            "link": link,
            "concurrency": "all_groups",
            "notes": (how + (" " + notes if notes else "")).strip(),
        },
        "entries": entries,
    }
