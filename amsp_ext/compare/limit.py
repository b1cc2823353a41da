"""How far a row's step is from its own limit, max(compute, communication).

[Note: a row's limit]
A throughput ratio between two rows says nothing about how much either leaves on the table, so
every row records, beside its step (``median_step_s``) and its exposed communication:

- ``compute_only_s``: the row's timed steps with the communication taken out. The same system,
  plan, model, local batches and number of ranks, on the same machine right after the row (the
  same CPU contention between its ranks), in a second job whose process group is torch's fake
  backend (``worker --compute-only``): every collective returns at once, the all-gathers'
  outputs filled with copies of the input (finite values; ``tools/dryrun.fake_fills_outputs``).
  Running one rank alone would change a sharded plan's work (its shards would be the whole
  model); the fake group keeps the world size, so each rank gathers, computes and updates
  exactly the tensors it does in the row. A system whose own code reads what a collective
  returned takes that read out in this job: DDP's reducer gets a local hook
  (systems/ddp.py), ZeRO-3's and MiCS's per-step rank-order check is off
  (systems/deepspeed_zero.py [Note: DeepSpeed's steps under the fake group]); DeepSpeed's
  ZeRO-1, ZeRO-3 and MiCS rows get every field on 4 loopback ranks
  (tests/test_compare_limit.py). Measured in the rounds ``RunSpec.limit_rounds``
  names (the first by default), median over the timed steps of the slowest rank's.
  What it leaves in: the CPU gloo's threads spend reducing in the real row (they are gone
  here, so compute-only is the compute without that contention).
- ``comm_only_s``: the row's collectives alone on the same links: one step after the profiled
  ones records every collective issued (as the dispatcher sees it, so DDP's reducer and
  DeepSpeed's too), then that list is issued again on fresh tensors with no compute, all
  before any wait (runtime/collectives.py [Note: a step's collectives replayed alone]); the
  slowest rank's time, median of ``worker.COMM_REPLAYS`` replays, median over the rounds.
- ``bound_s = max(compute_only_s, comm_only_s)``: no schedule of this work can beat it.
- ``last_backward_s``: in the compute-only job, the last micro-batch's backward (slowest rank,
  median over the timed steps). A plan that reduces its gradients once per step (DDP's
  ``no_sync``, AMSP's unsharded gradients) can hide that reduction under this window only:
  the micro-batches before it have nothing to send yet and the optimizer needs the result. So
  with M micro-batches such a row cannot beat
  ``compute_only_s - last_backward_s + max(last_backward_s, comm_only_s)``, and where the
  collectives alone outlast that window its ``bound_s`` is out of reach by their difference.
  Plans that reduce-scatter every micro-batch or gather parameters in the forward have more
  to hide under, and more to send.
- ``efficiency = bound_s / median_step_s`` (1.0: at the limit);
  ``hidden_fraction = 1 - exposed_comm_s / comm_only_s`` (1.0: every collective under
  compute; below 0 when the row exposes more than its collectives need alone: they queued
  behind each other or ran slower beside compute).
- ``reason``: in a round that ran the compute-only job, why a part is None (that job's failure,
  or no replay because the row was not traced), one line, printed under the report's table: a
  missing figure is never silent. None when nothing is missing, and in rounds not asked for the
  limit.
"""

from __future__ import annotations

import statistics
from typing import Any

from amsp_ext.common.metrics import median_after_warmup

__all__ = ["LIMIT_FIELDS", "combine", "compute_only_of", "comm_only_of", "limit_of", "why_missing"]

LIMIT_FIELDS = ("compute_only_s", "comm_only_s", "bound_s", "efficiency", "hidden_fraction", "last_backward_s")


def compute_only_of(ranks: list[dict], num_warmup: int, field: str = "step_s") -> float | None:
    """The compute-only job's figure from its ranks' records (``field``: ``step_s`` or
    ``last_backward_s``, one per step): per step the slowest rank, median over the steps after
    ``num_warmup``."""
    if not ranks or any(not r.get(field) or None in r[field] for r in ranks):
        return None
    steps = [max(r[field][i] for r in ranks) for i in range(min(len(r[field]) for r in ranks))]
    return median_after_warmup(steps, num_warmup)


def comm_only_of(ranks: list[dict]) -> float | None:
    """A round's figure from its ranks' ``comm_alone`` replays: per replay the slowest rank,
    median over the replays; None where a rank recorded none."""
    alone = [r.get("comm_alone") for r in ranks]
    if not alone or any(not a for a in alone):
        return None
    n = min(len(a) for a in alone)
    return statistics.median(max(a[i]["s"] for a in alone) for i in range(n))


def why_missing(compute_only: dict[str, Any] | None, *, compute_only_s: float | None,
                comm_only_s: float | None, traced: bool) -> str | None:
    """A round's ``reason`` ([Note: a row's limit]); ``compute_only``: the round's compute-only
    job as the harness recorded it, None where the round did not run one."""
    if compute_only is None:
        return None
    parts = []
    if compute_only_s is None:
        parts.append(f"compute only: the job {compute_only.get('status')}: {compute_only.get('reason')}"
                     if compute_only.get("status") != "ok" else "compute only: a rank recorded no step")
    if comm_only_s is None:
        parts.append("comm only: " + ("a rank recorded no replay" if traced
                                      else "not measured (trace off: the replay follows the profiled steps)"))
    return "; ".join(parts) or None


def limit_of(*, step_s: float | None, compute_only_s: float | None, comm_only_s: float | None,
             exposed_comm_s: float | None, last_backward_s: float | None = None,
             reason: str | None = None) -> dict[str, Any]:
    """The fields of [Note: a row's limit]; a field whose inputs are missing is None."""
    bound = (max(compute_only_s, comm_only_s)
             if compute_only_s is not None and comm_only_s is not None else None)
    efficiency = bound / step_s if bound is not None and step_s else None
    hidden = (1.0 - exposed_comm_s / comm_only_s
              if exposed_comm_s is not None and comm_only_s else None)
    return {"compute_only_s": compute_only_s, "comm_only_s": comm_only_s, "bound_s": bound,
            "efficiency": efficiency, "hidden_fraction": hidden, "last_backward_s": last_backward_s,
            "reason": reason}


def combine(rounds: list[dict[str, Any]], *, step_s: float | None,
            exposed_comm_s: float | None) -> dict[str, Any]:
    """One row's limit from its ok rounds' (each with ``limit``): the median of each measured
    part over the rounds that measured it, then the ratios from the row's own medians; where a
    part is still missing, the rounds' reasons."""
    def med(field: str) -> float | None:
        vals = [r["limit"][field] for r in rounds if (r.get("limit") or {}).get(field) is not None]
        return statistics.median(vals) if vals else None

    compute, comm = med("compute_only_s"), med("comm_only_s")
    reasons = dict.fromkeys(r["limit"]["reason"] for r in rounds if (r.get("limit") or {}).get("reason"))
    return limit_of(step_s=step_s, compute_only_s=compute, comm_only_s=comm, exposed_comm_s=exposed_comm_s,
                    last_backward_s=med("last_backward_s"),
                    reason="; ".join(reasons) if reasons and (compute is None or comm is None) else None)


LIMIT_TEXT = ("Each row against its own limit (amsp_ext/compare/limit.py [Note: a row's limit]): "
              "*compute only* = its timed steps under the fake process group (same ranks, plan, "
              "batches; run right after the row), *comm only* = its step's collectives replayed "
              "alone on the same links; bound = the larger; efficiency = bound / step; hidden = "
              "1 - exposed / comm only (below 0: the step exposed more than its collectives need "
              "alone); last backward = the window a once-per-step reduction can hide under. An "
              "efficiency above 1 says the compute-only job ran under a lighter load than the "
              "row did (they run a minute apart), not that the row beat its bound.")


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def limit_table(rows: list[dict[str, Any]]) -> list[str]:
    """The report's table of every ok row's limit, then why a row's part is missing; empty when
    no row measured one or said why."""
    ok = [r for r in rows if r.get("status") == "ok" and any((r.get("limit") or {}).get(f) is not None
                                                             for f in (*LIMIT_FIELDS, "reason"))]
    if not ok:
        return []
    out = ["| System | step ms | compute only ms | comm only ms | bound ms | efficiency | "
           "exposed comm ms | hidden fraction | last backward ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ok:
        lim = r["limit"]
        eff, hid = lim.get("efficiency"), lim.get("hidden_fraction")
        out.append(f"| {r['label']} | {_ms(r.get('median_step_s'))} | {_ms(lim.get('compute_only_s'))} | "
                   f"{_ms(lim.get('comm_only_s'))} | {_ms(lim.get('bound_s'))} | "
                   f"{'—' if eff is None else f'{eff:.2f}'} | {_ms(r.get('exposed_comm_s'))} | "
                   f"{'—' if hid is None else f'{hid:.2f}'} | {_ms(lim.get('last_backward_s'))} |")
    missing = [f"- {r['label']}: {r['limit']['reason']}" for r in ok if r["limit"].get("reason")]
    return out + (["", "Missing parts:", "", *missing] if missing else [])


def write_limit_plot(rows: list[dict[str, Any]], folder) -> str | None:
    """``limit.png``: per row, its step as compute only, exposed communication and the rest,
    the communication alone beside it, and the bound marked; None when no row has both parts."""
    ok = [r for r in rows if r.get("status") == "ok" and (r.get("limit") or {}).get("bound_s") is not None]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.8 * len(ok)))
    for y, r in enumerate(ok):
        lim, step = r["limit"], r["median_step_s"]
        compute = min(lim["compute_only_s"], step)
        exposed = min(r.get("exposed_comm_s") or 0.0, step - compute)
        rest = max(step - compute - exposed, 0.0)
        ax.barh(y + 0.18, compute * 1e3, height=0.34, color="tab:green", label="compute only" if y == 0 else None)
        ax.barh(y + 0.18, exposed * 1e3, left=compute * 1e3, height=0.34, color="tab:red",
                label="exposed communication" if y == 0 else None)
        ax.barh(y + 0.18, rest * 1e3, left=(compute + exposed) * 1e3, height=0.34, color="tab:gray",
                label="rest of the step" if y == 0 else None)
        ax.barh(y - 0.18, lim["comm_only_s"] * 1e3, height=0.34, color="tab:blue", alpha=0.6,
                label="communication alone" if y == 0 else None)
        ax.plot([lim["bound_s"] * 1e3] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2,
                label="bound max(compute, comm)" if y == 0 else None)
        ax.text(step * 1e3, y + 0.18, f" {lim['efficiency']:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(ok)), [r["label"] for r in ok], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (label: efficiency = bound / step)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(folder / "limit.png", dpi=110)
    plt.close(fig)
    return "limit.png"
