"""Raw per-rank records -> one row per system (the numbers the table and plots show)."""

from __future__ import annotations

import statistics
from typing import Any

from amsp_ext.compare import limit
from amsp_ext.compare.config import RunSpec
from amsp_ext.common.metrics import flops_per_token, median_after_warmup, mfu

__all__ = ["global_losses", "peak_flops", "summarize", "step_times"]


def step_times(ranks: list[dict]) -> list[float]:
    """Per step, the slowest rank's time: a synchronous step is over when its last rank is."""
    return [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]


def global_losses(ranks: list[dict]) -> list[float]:
    """Per step, the mean over ranks of their mean micro-batch loss = the global-batch loss
    (every rank and micro-batch has the same number of tokens)."""
    return [statistics.fmean(r["loss"][i] for r in ranks) for i in range(len(ranks[0]["loss"]))]


def peak_flops(results: list[dict]) -> float | None:
    """The matmul peak used for every row's MFU: median over all ranks of all successful runs."""
    vals = [r["peak_flops"] for res in results if res.get("status") == "ok" for r in res["ranks"]]
    return statistics.median(vals) if vals else None


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _breakdown(ranks: list[dict]) -> dict[str, Any] | None:
    """Rank 0's step breakdown (compare/breakdown.py) and, per kind and in total, the median
    over ranks of its busy and exposed seconds."""
    got = [r.get("breakdown") for r in ranks if r.get("breakdown")]
    if not got:
        return None
    kinds = sorted({k for b in got for k in b["kinds"]})
    med = {k: {f: _median([b["kinds"].get(k, {}).get(f, 0.0) for b in got])
               for f in ("busy_s", "exposed_s", "overlapped_s")} for k in kinds}
    med["total"] = {f: _median([b["totals"][f] for b in got])
                    for f in ("step_s", "compute_s", "comm_s", "exposed_s")}
    return {**got[0], "rank": ranks[0]["rank"], "median_over_ranks": med}


def _wire(ranks: list[dict], spec: RunSpec) -> dict[str, Any] | None:
    """Rank 0's wire record of its profiled step (compare/wire.py [Note: bytes on the wire]) and
    every rank's gradient bytes; None without a trace."""
    got = [(r["rank"], (r.get("breakdown") or {}).get("wire")) for r in ranks]
    if not got or got[0][1] is None:
        return None
    return {**got[0][1], "rank": got[0][0], "reduce_dtype_asked": spec.reduce_dtype,
            "grad_bytes_per_step_ranks": [w["grad_bytes_per_step"] if w else None for _, w in got]}


def _cpu(ranks: list[dict], num_warmup: int) -> dict[str, float] | None:
    """CPU seconds per timed step of the training thread and of the other threads (compare/cpu.py
    [Note: CPU time beside wall time]): each rank's median over the timed steps, then the median
    over ranks; None where a rank could not read them."""
    per_rank = [r.get("cpu_s") or [] for r in ranks]
    if not per_rank or any(not steps or None in steps for steps in per_rank):
        return None
    return {k: statistics.median(median_after_warmup([c[k] for c in steps], num_warmup) for steps in per_rank)
            for k in ("main", "other")}


def summarize(result: dict[str, Any], spec: RunSpec, peak: float | None) -> dict[str, Any]:
    row = {k: result.get(k) for k in ("key", "system", "label", "status", "reason", "command", "wall_s",
                                      "spec", "plan_source")}
    if result.get("status") != "ok":
        return row
    from amsp_ext.common.models import llama_config_dict

    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    times = step_times(ranks)
    median_step = median_after_warmup(times, spec.num_warmup_steps)
    tgs = spec.tokens_per_rank_per_step / median_step
    fpt = flops_per_token(llama_config_dict(spec.model), spec.seq_len)
    comm = [r["comm"] for r in ranks if r.get("comm")]
    exposed = _median([c["exposed_comm_s"] for c in comm]) if comm else None
    compute_only = result.get("compute_only") or {}
    co_ranks = compute_only["ranks"] if compute_only.get("status") == "ok" else []
    compute_only_s = limit.compute_only_of(co_ranks, spec.num_warmup_steps)
    comm_only_s = limit.comm_only_of(ranks)
    row.update({
        "step_s": times,
        "median_step_s": median_step,
        "tokens_per_gpu_per_s": tgs,
        "flops_per_token": fpt,
        "mfu": mfu(flops_per_token=fpt, tokens_per_gpu_per_s=tgs, peak_flops=peak) if peak else None,
        "loss": global_losses(ranks),
        "peak_rss_delta_bytes": [r["peak_rss_delta_bytes"] for r in ranks],
        "live_tensor_delta_bytes": [r["live_tensor_delta_bytes"] for r in ranks],
        "comm_s": _median([c["comm_s"] for c in comm]) if comm else None,
        "exposed_comm_s": exposed,
        "limit": limit.limit_of(
            step_s=median_step, exposed_comm_s=exposed, comm_only_s=comm_only_s, compute_only_s=compute_only_s,
            last_backward_s=limit.compute_only_of(co_ranks, spec.num_warmup_steps, "last_backward_s"),
            reason=limit.why_missing(result.get("compute_only"), compute_only_s=compute_only_s,
                                     comm_only_s=comm_only_s, traced=spec.trace)),
        "compute_only_run": {**{k: compute_only.get(k) for k in ("status", "reason", "command", "wall_s")},
                             "backends": sorted({r.get("backend") for r in co_ranks})}
        if compute_only else None,
        "cpu_s_per_step": _cpu(ranks, spec.num_warmup_steps),
        "breakdown": _breakdown(ranks),
        "setup_s": max(r["setup_s"] for r in ranks),
        "settings": result.get("settings"),
        "mixed_precision": result.get("mixed_precision"),
        "wire": _wire(ranks, spec),
        "patches": result.get("patches"),
        "world_size": result.get("world_size"),
        "num_nodes": result.get("num_nodes"),
        "gpus_per_node": result.get("gpus_per_node"),
    })
    return row
