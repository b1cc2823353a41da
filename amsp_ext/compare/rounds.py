"""Repeat-and-alternate (``amsp compare --repeats N``): the run order of each round, one row per
system from its rounds, and ratios as the median of per-round ratios.

[Note: why rounds, and why ratios are taken per round]
One comparison runs its systems one after another on a shared machine. Load from other jobs
that changes between two systems lands in their throughput ratio (0.69-2.20x for the same
engine-only pair over four runs on the 2x2 lab: comparisons/results/design_history.md,
"Comparison noise"). With ``--repeats N`` the harness runs
every system N times, in N rounds. Two systems of one round run minutes apart, two rounds
further apart still, so the ratio of two systems is taken *within* each round (they saw about
the same load) and the report gives the median of those per-round ratios and their range - not
the ratio of two medians, which pairs numbers measured under different loads. Each system's own
figure is the median of its per-round tokens/GPU/s, with the min-max range beside it.

[Note: the order of round r]
Round r (0-based) runs the systems in the base order rotated left by ``r // 2`` positions, and
reversed when r is odd:
    r=0: a b c    r=1: c b a    r=2: b c a    r=3: a c b    r=4: c a b    r=5: b a c
Each pair of rounds (2k, 2k+1) is one order and its reverse, so whoever ran first in one ran
last in the other and a steady drift in load (the machine getting busier over minutes) moves a
system's two positions in opposite directions. Over 2 x (number of systems) rounds every system
takes every position exactly twice. With 2 systems the rounds go  a b | b a | b a | a b | ...
(ABBA: any even N puts each system first in half the rounds; the measured lab pairs had the
system run first faster in 5 of 6 pairs). Odd N leaves one round's order unpaired - prefer even
N.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from amsp_ext.compare import limit
from amsp_ext.compare.config import SpecError

__all__ = ["CLAIM_AGREE", "CLAIM_MIN_ROUNDS", "CLAIM_MIN_TIMED_STEPS", "TARGET", "combine_rounds",
           "overloaded_rounds", "paired_ratio", "timed_steps", "round_order", "validate_repeats", "verdict"]

# [Note: what a claim needs]
# On the shared machines these comparisons run on, one configuration's median ratio swings by
# tenths between runs of a few timed steps and 3-4 rounds. So a ratio
# is a *claim* only with at least CLAIM_MIN_TIMED_STEPS timed steps per job (after the warm-up)
# and CLAIM_MIN_ROUNDS paired rounds in alternated order; anything less is reported with its
# numbers but labelled "not a claim". A claim's target (AMSP faster than the peer: ratio above
# TARGET) is *met* only when the median of the per-round ratios is above it and at least
# CLAIM_AGREE of the paired rounds are too (4 of 5); otherwise it is *not met*, whatever the
# median says. The report gives the interquartile range of the per-round ratios beside the
# median, so a reader sees the spread the verdict was taken over.
CLAIM_MIN_TIMED_STEPS = 10
CLAIM_MIN_ROUNDS = 5
CLAIM_AGREE = 0.8
TARGET = 1.0


def validate_repeats(num_repeats: Any) -> int:
    if isinstance(num_repeats, bool) or not isinstance(num_repeats, int) or num_repeats < 1:
        raise SpecError(f"--repeats must be an integer >= 1, got {num_repeats!r}")
    return num_repeats


def round_order(items: Sequence, round_index: int) -> list:
    """The order of round ``round_index`` (0-based); see [Note: the order of round r]."""
    n = len(items)
    if n == 0:
        return []
    k = (round_index // 2) % n
    order = list(items[k:]) + list(items[:k])
    return order[::-1] if round_index % 2 else order


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _round_list(numbers: list[int]) -> str:
    return ("round " if len(numbers) == 1 else "rounds ") + ",".join(str(n) for n in numbers)


def _failure_text(failed: list[dict[str, Any]]) -> str:
    """'round 2 failed: why' / 'rounds 1,3 failed: why' (same reason) / '...; round 4 failed: ...'."""
    by_reason: dict[str, list[int]] = {}
    for f in failed:
        by_reason.setdefault(f"{f['status']}: {f['reason']}", []).append(f["round"])
    return "; ".join(f"{_round_list(rs)} {why}" for why, rs in by_reason.items())


def combine_rounds(rounds: list[dict[str, Any]], *, mfu_of=None) -> dict[str, Any]:
    """One row from a system's per-round rows (each from ``summary.summarize`` plus ``round``,
    1-based, and ``position`` in that round's order).

    Throughput: median and min-max of the ok rounds' tokens/GPU/s (MFU from the median, via
    ``mfu_of(row, tokens_per_gpu_per_s)``). Communication (``comm_s``, ``exposed_comm_s``, and
    the breakdown's per-kind and total busy/exposed/overlapped seconds, each round's median over
    ranks): the median over the rounds that profiled a step, in ``breakdown.median_over_rounds``
    (the per-phase rows stay the first ok round's rank 0); ``cpu_s_per_step``: the median over
    the ok rounds. Loss and memory: the first ok
    round's. A failed round is kept in ``rounds`` and named, with its reason, in
    ``failed_rounds`` and the row's ``reason``.
    """
    ok = [r for r in rounds if r.get("status") == "ok"]
    failed = [{"round": r["round"], "status": r.get("status"), "reason": r.get("reason")}
              for r in rounds if r.get("status") != "ok"]
    base = dict(ok[0] if ok else rounds[0])
    base.pop("round", None)
    base.pop("position", None)
    row: dict[str, Any] = {**base, "num_rounds": len(rounds), "num_ok_rounds": len(ok),
                           "failed_rounds": failed, "rounds": [_without_timeline(r) for r in rounds],
                           "tokens_per_gpu_per_s_rounds":
                               [r.get("tokens_per_gpu_per_s") if r.get("status") == "ok" else None
                                for r in rounds]}
    if not ok:
        same = {(f["status"], f["reason"]) for f in failed}
        row["reason"] = (f"{failed[0]['reason']} (all {len(failed)} rounds)" if len(same) == 1
                         else _failure_text(failed))
        return row
    tgs = _spread([r["tokens_per_gpu_per_s"] for r in ok])
    row.update(tokens_per_gpu_per_s=tgs["median"],
               tokens_per_gpu_per_s_range=[tgs["min"], tgs["max"]],
               median_step_s=statistics.median(r["median_step_s"] for r in ok),
               reason=_failure_text(failed) if failed else None)
    if mfu_of is not None:
        row["mfu"] = mfu_of(row, tgs["median"])
    cpu = [r["cpu_s_per_step"] for r in ok if r.get("cpu_s_per_step")]
    if cpu:
        row["cpu_s_per_step"] = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}
    _comm_over_rounds(row, ok)
    row["limit"] = limit.combine(ok, step_s=row["median_step_s"], exposed_comm_s=row.get("exposed_comm_s"))
    return row


def _without_timeline(round_row: dict[str, Any]) -> dict[str, Any]:
    """A round as the row keeps it: its figures, not its per-rank timeline.

    [Note: one timeline per row]
    A breakdown's timeline lists every collective of every rank with its issue and end times
    (megabytes per round on small-llama); only timeline.png reads it, and that draws the row's
    own breakdown (the first ok round's). Keeping it in every round made a 5-round results.json
    ten times larger without adding a figure, so each round keeps its breakdown less the timeline.
    """
    bd = round_row.get("breakdown")
    if not (bd and "timeline" in bd):
        return round_row
    return {**round_row, "breakdown": {k: v for k, v in bd.items() if k != "timeline"}}


def _comm_over_rounds(row: dict[str, Any], ok: list[dict[str, Any]]) -> None:
    profiled = [r for r in ok if r.get("comm_s") is not None]
    if profiled:
        row["comm_s"] = statistics.median(r["comm_s"] for r in profiled)
        row["exposed_comm_s"] = statistics.median(r["exposed_comm_s"] for r in profiled)
        row["num_profiled_rounds"] = len(profiled)
    per_round = [r["breakdown"]["median_over_ranks"] for r in ok
                 if (r.get("breakdown") or {}).get("median_over_ranks")]
    if per_round and row.get("breakdown"):
        keys = sorted({k for m in per_round for k in m})
        med = {k: {f: statistics.median(m.get(k, {}).get(f, 0.0) for m in per_round)
                   for f in sorted({f for m in per_round for f in m.get(k, {})})} for k in keys}
        row["breakdown"] = {**row["breakdown"], "median_over_rounds": med,
                            "num_profiled_rounds": len(per_round)}


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def overloaded_rounds(round_loads: list, cpu_count: int | None = None) -> dict[str, Any]:
    """``{"cpu_count", "overloaded_rounds"}``: the rounds (1-based) whose 1-minute load average at
    the start was above twice the core count: their timings are flagged in the report (a
    busier machine than the run itself makes)."""
    import os

    cores = cpu_count or os.cpu_count() or 1
    return {"cpu_count": cores,
            "overloaded_rounds": [i for i, load in enumerate(round_loads, 1) if load and load[0] > 2 * cores]}


def timed_steps(row: dict[str, Any]) -> int | None:
    """Timed steps per job of a row (its spec's steps less warm-up), None if it has no spec."""
    spec = row.get("spec") or {}
    if "num_steps" not in spec:
        return None
    return spec["num_steps"] - spec.get("num_warmup_steps", 0)


def verdict(rec: dict[str, Any], steps: int | None) -> dict[str, Any]:
    """[Note: what a claim needs]: ``{"claim": bool, "met": bool | None, "text": ...}`` of a
    paired ratio (``paired_ratio``) whose jobs timed ``steps`` steps each."""
    n = rec["num_paired_rounds"]
    above = rec["rounds_above_target"]
    if steps is None or steps < CLAIM_MIN_TIMED_STEPS or n < CLAIM_MIN_ROUNDS:
        got = (f"{'?' if steps is None else steps} timed step{'' if steps == 1 else 's'}, "
               f"{n} round{'' if n == 1 else 's'}")
        return {"claim": False, "met": None,
                "text": f"not a claim ({got}; a claim needs >= {CLAIM_MIN_TIMED_STEPS} timed steps "
                        f"and >= {CLAIM_MIN_ROUNDS} rounds)"}
    need = math.ceil(CLAIM_AGREE * n - 1e-9)
    met = rec["median"] > TARGET and above >= need
    why = (f"median {rec['median']:.2f}x, {above} of {n} rounds above {TARGET:.1f}x; "
           f"met needs the median and >= {need} rounds above it")
    return {"claim": True, "met": met, "text": f"target {'met' if met else 'not met'} ({why})"}


def paired_ratio(num: dict[str, Any], den: dict[str, Any]) -> dict[str, Any] | None:
    """tokens/GPU/s of ``num`` over ``den``: per round where both ran ok, then median, range,
    interquartile range and how many rounds were above ``TARGET``.

    Rows without rounds (N = 1, or a row that never ran) count as one round."""
    a = num.get("tokens_per_gpu_per_s_rounds") or [num.get("tokens_per_gpu_per_s")]
    b = den.get("tokens_per_gpu_per_s_rounds") or [den.get("tokens_per_gpu_per_s")]
    per_round = [x / y if x is not None and y else None for x, y in zip(a, b)]
    vals = [v for v in per_round if v is not None]
    if not vals:
        return None
    q1, q3 = _quartiles(vals)
    return {"per_round": per_round, "num_rounds": len(per_round), "num_paired_rounds": len(vals),
            **_spread(vals), "q1": q1, "q3": q3, "iqr": q3 - q1,
            "rounds_above_target": sum(v > TARGET for v in vals)}
