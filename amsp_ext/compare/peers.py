"""Peers at their best: the DDP bucket sweep's rows (``amsp compare --ddp-buckets``) and which
row of a swept peer the ratios are taken against (systems/__init__.py [Note: DDP at its best])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from amsp_ext.compare.systems import (
    DDP_BUCKETS_MB,
    SYSTEMS,
    ddp_bucket_system,
    peer_family,
)

__all__ = ["at_best", "parse_ddp_buckets", "sweeps", "with_ddp_sweep"]

FLAG = "--ddp-buckets"


def parse_ddp_buckets(text: str) -> tuple[int, ...]:
    """``"1,5,25"`` -> ``(1, 5, 25)`` (order kept, repeats dropped); a one-line ValueError naming
    the flag and the allowed sizes otherwise."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    sizes = tuple(int(p) for p in parts if p.isdigit())
    if not parts or len(sizes) != len(parts) or any(mb not in DDP_BUCKETS_MB for mb in sizes):
        allowed = ", ".join(map(str, DDP_BUCKETS_MB))
        raise ValueError(f"{FLAG} must be comma-separated bucket_cap_mb sizes from {allowed}, got {text!r}")
    return tuple(dict.fromkeys(sizes))


def with_ddp_sweep(systems: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """``systems`` with one DDP row per bucket size, where ``ddp`` stands (first if it is absent).

    ``ddp`` is torch's default bucket_cap_mb, 25: with 25 in the sweep ``ddp-b25`` replaces it
    (the same configuration would run twice); without, ``ddp`` stays beside the swept sizes. No
    row is named twice."""
    sweep = [ddp_bucket_system(mb) for mb in sizes]
    out = list(systems)
    at = out.index("ddp") if "ddp" in out else 0
    drop = 1 if "ddp" in out and 25 in sizes else 0
    out[at:at + drop] = sweep
    return list(dict.fromkeys(out))


def _bucket_mb(row: dict[str, Any]) -> float | None:
    """The bucket cap the row ran with (its settings, read from the module), else its system's."""
    ran = (row.get("settings") or {}).get("bucket_cap_mb")
    if ran is not None:
        return ran
    info = SYSTEMS.get(row.get("system"))
    return 25 if row.get("system") == "ddp" else (info.bucket_cap_mb if info else None)


def sweeps(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer family with more than one row (DDP and its bucket sweep): ``{"best": key, "rows":
    [{"key", "label", "bucket_cap_mb", "median_step_s", "status"}...]}``, the best the ok row with
    the lowest median step time over the rounds (the first of equals). Families with no ok row
    have no best (``None``).

    [Note: the best by the same rounds]
    Every swept row runs in the same rounds as the AMSP rows (rounds.py alternates all of them),
    so the best is picked from what those rounds measured: each row's median over its ok rounds
    of the step time (rounds.combine_rounds). Step time, not tokens/GPU/s, because the rows
    train the same tokens per step and the step is what the bucket size changes; the ratio is
    then taken round by round against that one row, as against any peer."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if not str(r.get("system", "")).startswith("amsp"):
            by.setdefault(peer_family(r.get("system", "")), []).append(r)
    out = {}
    for family, members in by.items():
        if len(members) < 2:
            continue
        ok = [r for r in members if r.get("status") == "ok" and r.get("median_step_s") is not None]
        best = min(ok, key=lambda r: r["median_step_s"]) if ok else None
        out[family] = {"best": best["key"] if best else None,
                       "rows": [{"key": r["key"], "label": r["label"], "bucket_cap_mb": _bucket_mb(r),
                                 "median_step_s": r.get("median_step_s"), "status": r.get("status")}
                                for r in members]}
    return out


def at_best(ok_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The non-AMSP rows a ratio is taken against: every peer's row, but of a swept family only
    its best (``sweeps``), in the rows' order."""
    swept = sweeps(ok_rows)
    return [r for r in ok_rows if not str(r.get("system", "")).startswith("amsp")
            and swept.get(peer_family(r["system"]), {"best": r["key"]})["best"] == r["key"]]
