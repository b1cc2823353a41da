"""Bandwidth profiles: the table ``w(op, bytes, p0 x p1)`` and the time of one collective.

The paper (Sec. IV-A) prices a collective as ``t(o, v, p0 x p1) = v / w(o, v, p0 x p1)`` with
``w`` profiled offline and interpolated linearly between measured sizes. This module loads and
validates such a table (schema ``amsp-profile/1``, see docs/DESIGN.md) and answers ``t``.

[Note: sizes outside the measured range]
Between two measured sizes the bandwidth ``w`` is interpolated linearly in bytes, as the paper
does. Below the smallest measured size the *time* is held at the smallest size's time: small
collectives are latency-bound, and assuming they run at the smallest size's bandwidth would make
them look almost free. Above the largest size the *bandwidth* is held at the largest size's:
large collectives are bandwidth-bound, so their time keeps growing linearly with size.

[Note: meshes missing from the table]
With ``missing="error"`` (the default) a mesh the table lacks is refused with a one-line error.
With ``missing="fit"`` it is estimated by an alpha-beta fit and flagged *extrapolated*. The fit
is made per op and per level (intra-node meshes, p1 = 1; cross-node meshes, p1 > 1) over every
measured point of that op and level:

    t = a + b * (p - 1) + c * v * g_op(p) * share(p0)

``a`` is the fixed cost of one collective, ``b`` the latency of one ring step, ``c`` seconds per
byte on the bottleneck link; ``g_op`` is the ring traffic factor ((p-1)/p for allgather and
reducescatter, 2(p-1)/p for allreduce, 1 for broadcast) and ``share(p0)`` is R/p0 for the
cross-node level of an ``all_groups`` table (R/p0 groups split the node's links), 1 otherwise.
The coefficients are non-negative least squares on relative error.

[Note: contention between the groups of one shape]
Training runs every group of a shape at once: with a ``p0 x p1`` mesh there are R/p0 such
groups per node (R GPUs per node), and for p1 > 1 all of them push their cross-node traffic
through the same node's NICs. A table measured that way (``metadata.concurrency =
"all_groups"``, what ``amsp profile`` does) is used as is. A table measured with one group
alone (``"single_group"``, e.g. an nccl-tests sweep over one communicator) lets that group use
every NIC of the node, so for p1 > 1 its time is multiplied by R/p0, the number of groups that
share the links in training. Intra-node meshes (p1 = 1) are not scaled: NVSwitch is non-blocking.
``p0 = 1`` is the worst case (R groups on one node's links); ``p0 = R`` is unaffected. Scaling the
whole time, latency included, slightly overcharges latency-bound sizes; it is the right order for
the bandwidth-bound sizes that dominate a step. Costed without it, a 1 x 128 all-reduce looks up
to R times cheaper than it is and the search drifts to MiCS-like plans.

[Note: a two-level all-reduce's time]
With ``all_reduce="two_level"`` the engine runs an all-reduce of v bytes on a p0 x p1 mesh
(p0, p1 > 1) as a reduce-scatter on p0 x 1, an all-reduce of v/p0 on 1 x p1 and an all-gather on
p0 x 1 (runtime/collectives.py [Note: two-level all-reduce]), one after the other, and the
table prices each: t(RS, v, p0x1) + t(AR, v/p0, 1xp1) + t(AG, v, p0x1). The 1 x p1 curve is
the right one for the middle phase: in training every rank of the node runs one such all-reduce
at once, which is how ``all_groups`` measures 1 x p1 (a ``single_group`` time is scaled by the
R groups that share the node's links, as for any 1 x p1 mesh).
A calibration (calibration.py) adds a cost per collective and per byte to each collective the
engine issues: gloo's work waiting for a core, on a CPU. The two-level all-reduce issues three,
over 2v + v/p0 bytes, so it is charged that much (``CommTimer.issued``): priced as one
all-reduce of v, the model got the sign wrong on the 2x2 lab at 1 Gbit, predicting DDP's plan
faster with two-level where the engine ran it slower (comparisons/results/design_history.md,
"Flat or two-level all-reduce").

Pure Python + NumPy.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from amsp_ext.choices import ALL_REDUCES, MISSING_MESH
from amsp_ext.planner.calibration import Calibration, CalibrationError, parse_calibration
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_ALL_REDUCE, DEFAULT_MISSING_MESH

__all__ = [
    "CONCURRENCY",
    "OPS",
    "BandwidthProfile",
    "CommTimer",
    "ProfileError",
    "bundled_profiles",
    "load_profile",
]

OPS = ("allreduce", "allgather", "reducescatter", "broadcast")
CONCURRENCY = ("all_groups", "single_group")
SCHEMA = "amsp-profile/1"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A malformed, partial or unusable profile. One line, naming the entry and field."""


@dataclass(frozen=True)
class _Curve:
    nbytes: tuple[float, ...]
    bps: tuple[float, ...]  # algorithm bandwidth, bytes/s


@dataclass(frozen=True, kw_only=True)
class BandwidthProfile:
    name: str
    concurrency: str
    metadata: Mapping[str, Any]
    curves: Mapping[tuple[str, int, int], _Curve]
    source: str = "<memory>"
    calibration: Calibration | None = None  # the step model's measured constants (calibration.py)

    @property
    def gpus_per_node(self) -> int | None:
        world = self.metadata.get("world") or {}
        r = world.get("gpus_per_node")
        return r if isinstance(r, int) and r > 0 else None

    def meshes(self, op: str) -> list[tuple[int, int]]:
        return sorted((p0, p1) for (o, p0, p1) in self.curves if o == op)

    # -- parsing ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "<memory>") -> "BandwidthProfile":
        where = f"profile {source}"
        if not isinstance(doc, Mapping):
            raise ProfileError(f"{where}: must be a JSON object, got {type(doc).__name__}")
        if doc.get("schema") != SCHEMA:
            raise ProfileError(f"{where}: schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            raise ProfileError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        where = f"profile {name}"
        meta = doc.get("metadata")
        if not isinstance(meta, Mapping):
            raise ProfileError(f"{where}: 'metadata' must be an object, got {type(meta).__name__}")
        conc = meta.get("concurrency")
        if conc not in CONCURRENCY:
            raise ProfileError(
                f"{where}: metadata.concurrency must be one of {', '.join(CONCURRENCY)}, got {conc!r}"
            )
        entries = doc.get("entries")
        if not isinstance(entries, list) or not entries:
            raise ProfileError(f"{where}: 'entries' must be a non-empty list")
        curves: dict[tuple[str, int, int], _Curve] = {}
        for i, e in enumerate(entries):
            key, curve = _parse_entry(e, f"{where}: entries[{i}]")
            if key in curves:
                raise ProfileError(
                    f"{where}: entries[{i}] repeats op={key[0]} mesh {key[1]}x{key[2]}"
                )
            curves[key] = curve
        calibration = None
        if "calibration" in doc:
            try:
                calibration = parse_calibration(doc["calibration"])
            except CalibrationError as e:
                raise ProfileError(f"{where}: {e}") from None
        return cls(name=name, concurrency=conc, metadata=dict(meta), curves=curves, source=source,
                   calibration=calibration)


def _parse_entry(e: Any, where: str) -> tuple[tuple[str, int, int], _Curve]:
    if not isinstance(e, Mapping):
        raise ProfileError(f"{where} must be an object")
    op = e.get("op")
    if op not in OPS:
        raise ProfileError(f"{where}.op must be one of {', '.join(OPS)}, got {op!r}")
    for k in ("p0", "p1"):
        v = e.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ProfileError(f"{where}.{k} must be an integer >= 1, got {v!r}")
    if e["p0"] * e["p1"] < 2:
        raise ProfileError(f"{where}: mesh {e['p0']}x{e['p1']} has one GPU; nothing to measure")
    points = e.get("points")
    if not isinstance(points, list) or not points:
        raise ProfileError(f"{where}.points must be a non-empty list")
    xs: list[float] = []
    ys: list[float] = []
    for j, pt in enumerate(points):
        pw = f"{where}.points[{j}]"
        if not isinstance(pt, Mapping):
            raise ProfileError(f"{pw} must be an object with 'bytes' and 'GBps'")
        b, w = pt.get("bytes"), pt.get("GBps")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ProfileError(f"{pw}.bytes must be an integer >= 1, got {b!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ProfileError(f"{pw}.GBps must be a positive number, got {w!r}")
        if xs and b <= xs[-1]:
            raise ProfileError(f"{pw}.bytes={b} must be larger than the previous point's {int(xs[-1])}")
        xs.append(float(b))
        ys.append(float(w) * 1e9)
    return (op, e["p0"], e["p1"]), _Curve(tuple(xs), tuple(ys))


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> BandwidthProfile:
    """A bundled profile by name (``paper-a800``) or a JSON file by path."""
    text = str(name_or_path)
    path = Path(text)
    if text == CLUSTER_PROFILE and not path.exists():
        raise ProfileError(
            f"profile {CLUSTER_PROFILE!r} is the profile of the cluster a job runs on, found or "
            f"measured by the job itself (amsp train, amsp compare, shard()); a command that "
            f"plans off the cluster needs a bundled name ({', '.join(bundled_profiles())}) or a "
            f"JSON file path")
    if not (text.endswith(".json") or path.exists()):
        if text not in bundled_profiles():
            raise ProfileError(
                f"profile must be a bundled name ({', '.join(bundled_profiles())}) or a JSON "
                f"file path, got {text!r}"
            )
        path = PROFILE_DIR / f"{text}.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"profile {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return BandwidthProfile.from_dict(doc, source=str(path))


# -- the time of one collective -----------------------------------------------------------------

def _traffic(op: str, p: int) -> float:
    if op == "broadcast":
        return 1.0
    return (2.0 if op == "allreduce" else 1.0) * (p - 1) / p


@dataclass
class CommTimer:
    """``t(op, bytes, p0, p1)`` for a cluster of ``gpus_per_node`` GPUs per node.

    ``missing`` is ``"error"`` or ``"fit"`` (see the module notes). ``intra_scale`` and
    ``inter_scale`` multiply the bandwidth of intra-node (p1 = 1) and cross-node meshes; the
    sensitivity analysis varies them. ``extrapolated`` collects the (op, p0, p1) answered by fit.
    """

    profile: BandwidthProfile
    gpus_per_node: int
    missing: str = DEFAULT_MISSING_MESH
    intra_scale: float = 1.0
    inter_scale: float = 1.0
    all_reduce: str = DEFAULT_ALL_REDUCE  # how the engine runs an all-reduce (EngineConfig.all_reduce)
    extrapolated: set[tuple[str, int, int]] = field(default_factory=set)
    _fits: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.missing not in MISSING_MESH:
            raise ProfileError(f"missing-mesh policy must be one of {', '.join(MISSING_MESH)}, "
                               f"got {self.missing!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise ProfileError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        for k in ("intra_scale", "inter_scale"):
            if not getattr(self, k) > 0:
                raise ProfileError(f"{k} must be > 0, got {getattr(self, k)!r}")

    def scaled(self, *, intra: float = 1.0, inter: float = 1.0) -> "CommTimer":
        return dataclasses.replace(self, intra_scale=self.intra_scale * intra,
                                   inter_scale=self.inter_scale * inter)

    def issued(self, op: str, nbytes: float, p0: int, p1: int) -> tuple[int, float]:
        """(collectives, bytes they move) of one ``op`` of ``nbytes`` as the engine runs it:
        a two-level all-reduce is three collectives over 2v + v/p0 bytes, the calibration's
        per-collective and per-byte costs apply to each ([Note: a two-level all-reduce's
        time])."""
        if op == "allreduce" and self.all_reduce == "two_level" and p0 > 1 and p1 > 1:
            return 3, nbytes * (2 + 1 / p0)
        return 1, float(nbytes)

    def contention(self, p0: int, p1: int) -> float:
        """How many groups of this shape share one node's cross-node links (see the Note)."""
        if self.profile.concurrency == "single_group" and p1 > 1:
            return max(1.0, self.gpus_per_node / p0)
        return 1.0

    def time(self, op: str, nbytes: float, p0: int, p1: int) -> float:
        """Seconds for one ``op`` of ``nbytes`` on a ``p0 x p1`` mesh, all groups active; an
        all-reduce as the engine runs it ([Note: a two-level all-reduce's time])."""
        if p0 * p1 <= 1 or nbytes <= 0:
            return 0.0
        if op == "allreduce" and self.all_reduce == "two_level" and p0 > 1 and p1 > 1:
            return (self.time("reducescatter", nbytes, p0, 1) + self.time("allreduce", nbytes / p0, 1, p1)
                    + self.time("allgather", nbytes, p0, 1))
        curve = self.profile.curves.get((op, p0, p1))
        if curve is not None:
            t = _interpolate(curve, nbytes)
        elif self.missing == "fit":
            self.extrapolated.add((op, p0, p1))
            t = self._fitted(op, nbytes, p0, p1)
        else:
            have = ", ".join(f"{a}x{b}" for a, b in self.profile.meshes(op)) or "none"
            raise ProfileError(
                f"profile {self.profile.name} has no {op} entry for mesh {p0}x{p1} (measured: "
                f"{have}); profile it, or allow an alpha-beta estimate (--missing-mesh fit)"
            )
        scale = self.intra_scale if p1 == 1 else self.inter_scale
        return t * self.contention(p0, p1) / scale

    # -- alpha-beta fit ----------------------------------------------------------------------
    def _share(self, p0: int, p1: int) -> float:
        if p1 > 1 and self.profile.concurrency == "all_groups":
            r = self.profile.gpus_per_node or self.gpus_per_node
            return max(1.0, r / p0)
        return 1.0

    def _fitted(self, op: str, nbytes: float, p0: int, p1: int) -> float:
        level = "intra" if p1 == 1 else "inter"
        coef = self._fits.get((op, level))
        if coef is None:
            coef = self._fits[(op, level)] = self._fit(op, level)
        p = p0 * p1
        a, b, c = coef
        return a + b * (p - 1) + c * nbytes * _traffic(op, p) * self._share(p0, p1)

    def _fit(self, op: str, level: str) -> tuple[float, float, float]:
        rows, ts = [], []
        for (o, p0, p1), curve in self.profile.curves.items():
            if o != op or (p1 == 1) != (level == "intra"):
                continue
            p = p0 * p1
            for v, w in zip(curve.nbytes, curve.bps):
                rows.append((1.0, p - 1.0, v * _traffic(op, p) * self._share(p0, p1)))
                ts.append(v / w)
        meshes = {(p0, p1) for (o, p0, p1) in self.profile.curves
                  if o == op and (p1 == 1) == (level == "intra")}
        if len(rows) < 3 or len(meshes) < 2:
            raise ProfileError(
                f"profile {self.profile.name}: cannot estimate {op} on {level}-node meshes; the "
                f"fit needs at least 2 measured {level}-node meshes, has {len(meshes)}"
            )
        x = np.asarray(rows)
        t = np.asarray(ts)
        return _nnls_relative(x, t)


def _interpolate(curve: _Curve, v: float) -> float:
    xs, ws = curve.nbytes, curve.bps
    if v <= xs[0]:
        return xs[0] / ws[0]  # latency floor: not faster than the smallest measured size
    if v >= xs[-1]:
        return v / ws[-1]
    j = bisect.bisect_right(xs, v)
    x0, x1, w0, w1 = xs[j - 1], xs[j], ws[j - 1], ws[j]
    w = w0 + (w1 - w0) * (v - x0) / (x1 - x0)
    return v / w


def _nnls_relative(x: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Non-negative least squares of ``x @ c ~ t`` in relative error, by trying every support
    (3 coefficients: 7 subsets); small enough that exactness beats an iterative solver."""
    xw = x / t[:, None]
    ones = np.ones_like(t)
    best, best_err = None, math.inf
    n = x.shape[1]
    for k in range(1, n + 1):
        for support in combinations(range(n), k):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(xw[:, cols], ones, rcond=None)
            if np.any(sol < 0):
                continue
            c = np.zeros(n)
            c[cols] = sol
            err = float(np.sum((xw @ c - ones) ** 2))
            if err < best_err:
                best, best_err = c, err
    assert best is not None  # a single non-negative column always fits
    return float(best[0]), float(best[1]), float(best[2])
