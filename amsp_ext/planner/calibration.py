"""The step model's measured constants: the ``calibration`` section of a profile JSON.

A bandwidth profile says how long a collective takes when it runs alone. The step model
(step.py) also needs what no bandwidth table holds: how fast *this model* computes on *this
device*, how fast the optimizer step runs, and how much of each collective kind really overlaps
with compute on this backend. Uncalibrated, it assumes the paper's testbed (compute at 0.65 of
the given peak, optimizer steps at the given HBM bandwidth, every overlap perfect). ``amsp tune
--calibrate-out`` measures them on the real cluster and writes them into a copy of the profile;
``amsp plan --profile calibrated.json --objective step`` then uses them.

Schema (one object, every field validated; an error is one line naming the field)::

    "calibration": {
      "source": "amsp tune on ...",            # what was measured, non-empty
      "date": "2025-06-30",                    # YYYY-MM-DD
      "device": "cpu",                         # the device it was measured on
      "peak_flops": 3.1e10,                    # MFU denominator of that run (common/metrics.py)
      "forward_flops_per_s": 2.0e10,           # model FLOPs / forward time, per GPU
      "backward_flops_per_s": 2.2e10,          # 2 x model FLOPs / backward time, per GPU
      "optimizer_bytes_per_s": 9.0e9,          # optimizer traffic / optimizer-step time
      "step_overhead_s": 0.01,                 # per step, outside compute and communication
      "micro_batch_overhead_s": 0.02,          # per micro-batch, on the compute thread
      "ar_buckets_in_flight": 2,               # the engine's in-flight cap, x U bytes
      "blocking": ["RS"],                      # kinds that block the compute thread here
      "comm_time_scale": {"AG": 1.0, "RS": 1.0, "AR": 1.0, "BC": 1.0},
      "comm_s_per_byte": {"AG": 0.0, ...},     # extra duration per byte under load
      "comm_latency_s": {"AG": 0.0, ...},      # extra duration per collective under load
      "compute_s_per_byte": {"AG": 0.0, ...},  # compute-thread time per byte in flight
      "fit": {...}                             # optional, free-form: what the fit saw
    }

A per-kind object needs all four kinds (AG, RS, AR, BC); a field left out takes its neutral
value (scale 1, the rest 0: the paper's rules on the profile's times).

[Note: what the constants mean in the step model]
* ``forward_flops_per_s`` / ``backward_flops_per_s`` replace ``peak x efficiency``: a unit's
  forward takes its forward FLOPs / the first, its backward twice those / the second. Both are
  *per GPU while every GPU computes* (on a shared CPU: a rank's share of the cores).
* ``optimizer_bytes_per_s`` replaces the HBM bandwidth in the optimizer-step time.
* A kind-k collective of v bytes whose profile time is t lasts
  ``comm_time_scale[k] t + comm_s_per_byte[k] v + comm_latency_s[k]`` in training: a profile
  is measured with nothing else running, and during training a collective meets the compute of
  every rank (on a CPU, gloo's copies and reductions and every step of its ring wait for a core:
  costs per byte and per collective that do not depend on the link's speed), other collectives
  and ranks that arrive late. The calibrated model prices the collectives the engine really
  issues, one by one (issued.py).
* ``compute_s_per_byte[k]``: the compute-thread time a kind-k collective takes, per byte (on a
  CPU, the cycles gloo's threads take from the cores the ranks compute on; on a GPU, the SMs
  the communication kernels occupy), at most its duration. 0 is the paper's rule (a stream of
  its own); a collective whose overlap is switched off (``--no-overlap``) takes all its time.
* ``blocking``: kinds whose collectives the engine waits for right where it issues them on
  this backend (a trace shows their exposed time equal to their busy time): they take the
  compute thread for their whole duration. On CPU, FSDP2's reduce-scatter is synchronous
  (runtime/sync/param_shard.py), so RS is blocking there and not on a GPU.
* ``micro_batch_overhead_s``: compute-thread time per micro-batch that no collective explains
  (the engine's hooks and bucket copies); ``step_overhead_s``: once per step (Python, the loss
  all-reduce, ranks waiting for the slowest).

Pure Python.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = ["KINDS", "Calibration", "CalibrationError", "parse_calibration"]

KINDS = ("AG", "RS", "AR", "BC")
# per-kind fields -> (lower bound, bound is open)
_PER_KIND = {"comm_time_scale": (0.0, True), "comm_s_per_byte": (0.0, False),
             "comm_latency_s": (0.0, False), "compute_s_per_byte": (0.0, False)}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class CalibrationError(ValueError):
    """A malformed calibration section. One line, naming the field."""


def _per_kind(value: Mapping[str, float] | None, default: float) -> dict[str, float]:
    return {k: float((value or {}).get(k, default)) for k in KINDS}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    source: str
    date: str
    device: str
    peak_flops: float
    forward_flops_per_s: float
    backward_flops_per_s: float
    optimizer_bytes_per_s: float
    step_overhead_s: float = 0.0
    micro_batch_overhead_s: float = 0.0
    ar_buckets_in_flight: int | None = None  # in-flight cap in U bytes (planner/buckets.py IN_FLIGHT_BUCKETS)
    blocking: tuple[str, ...] = ()  # kinds whose collectives block the compute thread here
    comm_time_scale: Mapping[str, float] = field(default_factory=lambda: _per_kind(None, 1.0))
    comm_s_per_byte: Mapping[str, float] = field(default_factory=lambda: _per_kind(None, 0.0))
    comm_latency_s: Mapping[str, float] = field(default_factory=lambda: _per_kind(None, 0.0))
    compute_s_per_byte: Mapping[str, float] = field(default_factory=lambda: _per_kind(None, 0.0))
    fit: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.as_dict(), "calibration")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _PER_KIND:
            d[k] = dict(getattr(self, k))
        d["blocking"] = list(self.blocking)
        d["fit"] = dict(self.fit)
        return d

    def under_load(self, kind: str, profile_s: float, count: int, moved: float) -> float:
        """One collective of ``kind`` under load: the profile's ``profile_s`` scaled, plus its
        ``moved`` bytes and ``count`` issued collectives (a two-level all-reduce issues three)
        at their fitted costs."""
        return (self.comm_time_scale[kind] * profile_s + self.comm_s_per_byte[kind] * moved
                + self.comm_latency_s[kind] * count)

    def describe(self) -> str:
        sc = ", ".join(f"{k} {self.comm_time_scale[k]:.2f}x+{self.comm_s_per_byte[k] * 1e9:.2f}"
                       f"ns/B+{self.comm_latency_s[k] * 1e3:.1f}ms" for k in KINDS)
        cpu = ", ".join(f"{k} {self.compute_s_per_byte[k] * 1e9:.2f}" for k in KINDS)
        return (f"calibrated ({self.source}, {self.date}, {self.device}): forward "
                f"{self.forward_flops_per_s / 1e9:.2f} / backward {self.backward_flops_per_s / 1e9:.2f}"
                f" GFLOP/s per GPU, optimizer {self.optimizer_bytes_per_s / 1e9:.2f} GB/s, overhead "
                f"{self.micro_batch_overhead_s * 1e3:.1f} ms/micro-batch + "
                f"{self.step_overhead_s * 1e3:.1f} ms/step; collective time under load ({sc}); "
                f"compute time per byte in flight, ns/B ({cpu}); blocking: "
                f"{', '.join(self.blocking) or 'none'}")


def _number(d: Mapping[str, Any], key: str, where: str, *, low: float, high: float = math.inf,
            low_open: bool = False) -> None:
    v = d.get(key)
    bound = f"{'>' if low_open else '>='} {low:g}" + ("" if high == math.inf else f" and <= {high:g}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < low or (low_open and v == low) or v > high:
        raise CalibrationError(f"{where}.{key} must be a number {bound}, got {v!r}")


def _check(d: Any, where: str) -> None:
    if not isinstance(d, Mapping):
        raise CalibrationError(f"{where} must be an object, got {type(d).__name__}")
    known = {"source", "date", "device", "peak_flops", "forward_flops_per_s",
             "backward_flops_per_s", "optimizer_bytes_per_s", "step_overhead_s",
             "micro_batch_overhead_s", "ar_buckets_in_flight", "blocking", *_PER_KIND, "fit"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CalibrationError(f"{where}.{unknown[0]} is not a calibration field; allowed: "
                               f"{', '.join(sorted(known))}")
    for key in ("source", "device"):
        v = d.get(key)
        if not isinstance(v, str) or not v.strip():
            raise CalibrationError(f"{where}.{key} must be a non-empty string, got {v!r}")
    date = d.get("date")
    if not isinstance(date, str) or not _DATE.match(date):
        raise CalibrationError(f"{where}.date must be a date 'YYYY-MM-DD', got {date!r}")
    for key in ("peak_flops", "forward_flops_per_s", "backward_flops_per_s",
                "optimizer_bytes_per_s"):
        _number(d, key, where, low=0.0, low_open=True)
    for key in ("step_overhead_s", "micro_batch_overhead_s"):
        if key in d:
            _number(d, key, where, low=0.0)
    blocking = d.get("blocking", [])
    if not isinstance(blocking, (list, tuple)) or any(k not in KINDS for k in blocking):
        raise CalibrationError(f"{where}.blocking must be a list of kinds among {', '.join(KINDS)}, "
                               f"got {blocking!r}")
    v = d.get("ar_buckets_in_flight")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise CalibrationError(f"{where}.ar_buckets_in_flight must be an integer >= 1 or null, got {v!r}")
    for key, (low, low_open) in _PER_KIND.items():
        high = math.inf
        if key not in d:
            continue
        sub = d[key]
        if not isinstance(sub, Mapping):
            raise CalibrationError(f"{where}.{key} must be an object with keys {', '.join(KINDS)}, "
                                   f"got {type(sub).__name__}")
        for k in sub:
            if k not in KINDS:
                raise CalibrationError(f"{where}.{key}.{k} is not a collective kind; allowed: "
                                       f"{', '.join(KINDS)}")
        for k in KINDS:
            if k not in sub:
                raise CalibrationError(f"{where}.{key}.{k} is missing (give all of {', '.join(KINDS)})")
            _number(sub, k, f"{where}.{key}", low=low, high=high, low_open=low_open)
    if "fit" in d and not isinstance(d["fit"], Mapping):
        raise CalibrationError(f"{where}.fit must be an object, got {type(d['fit']).__name__}")


def parse_calibration(doc: Any, *, where: str = "calibration") -> Calibration:
    """Validate a JSON ``calibration`` object (raising a one-line CalibrationError naming the
    field) and build the Calibration."""
    _check(doc, where)
    return Calibration(
        source=doc["source"].strip(), date=doc["date"], device=doc["device"].strip(),
        peak_flops=float(doc["peak_flops"]),
        forward_flops_per_s=float(doc["forward_flops_per_s"]),
        backward_flops_per_s=float(doc["backward_flops_per_s"]),
        optimizer_bytes_per_s=float(doc["optimizer_bytes_per_s"]),
        step_overhead_s=float(doc.get("step_overhead_s", 0.0)),
        micro_batch_overhead_s=float(doc.get("micro_batch_overhead_s", 0.0)),
        ar_buckets_in_flight=doc.get("ar_buckets_in_flight"),
        blocking=tuple(doc.get("blocking", ())),
        **{k: _per_kind(doc.get(k), 1.0 if k == "comm_time_scale" else 0.0) for k in _PER_KIND},
        fit=dict(doc.get("fit") or {}),
    )
