"""``amsp tune --calibrate-out``: fit the step model on this run's measurements (planner/fit.py)
and write the profile again with a ``calibration`` section.

The measured run's own plans are then re-predicted with the calibration ("in-sample"), which
shows how well the model's form can fit this job; whether it *generalises* is what a tune run of
another job shape with ``--profile`` the calibrated file shows (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from amsp_ext.planner.calibration import KINDS
from amsp_ext.planner.fit import PlanObservation, ProbeObservation, fit_calibration
from amsp_ext.planner.plan import parse_plan
from amsp_ext.tune.analysis import predictions, summarize_variant
from amsp_ext.tune.candidates import Candidate, Problems

__all__ = ["calibrate_from_result", "observations"]


def observations(result: dict[str, Any]) -> tuple[list[PlanObservation], ProbeObservation]:
    """The fit's inputs from a tune result (its measured plans and compute probes)."""
    plans = []
    for r in result["plans"]:
        m = r["measured"]
        if m["step_s"] is None:
            continue
        ph = m["phases"]
        plans.append(PlanObservation(
            plan=parse_plan(r["key"]), step_s=m["step_s"]["median"],
            busy_s={k: m["comm"][k]["busy_s"] or 0.0 for k in KINDS},
            exposed_s={k: m["comm"][k]["exposed_s"] or 0.0 for k in KINDS},
            compute_s=(ph["forward"]["wall_s"] - ph["forward"]["blocked_s"]
                       + ph["backward"]["wall_s"] - ph["backward"]["blocked_s"]),
            optimizer_s=ph["optimizer"]["wall_s"] - ph["optimizer"]["blocked_s"]))
    pr = result["probes"]
    probe = ProbeObservation(forward_s=statistics.median(p["forward_s"] for p in pr),
                             backward_s=statistics.median(p["backward_s"] for p in pr),
                             optimizer_s=statistics.median(p["optimizer_s"] for p in pr))
    return plans, probe


def calibrate_from_result(result: dict[str, Any], config, problems: Problems,
                          candidates: list[Candidate], out: Path) -> None:
    from amsp_ext.planner.buckets import IN_FLIGHT_BUCKETS

    meta = result["meta"]
    plans, probe = observations(result)
    world = meta["world"]
    job = meta["job"]
    source = (f"amsp tune, {job['model']} seq {job['seq_len']} micro-batch "
              f"{job['micro_batch_size']} M {job['micro_batches']} {job['precision']} "
              f"{job['granularity']}, {len(plans)} plans x {job['repeats']} rounds on "
              f"{world['num_nodes']}x{world['gpus_per_node']} {meta['backend']}")
    cal = fit_calibration(problems.uncalibrated["step"], plans, probe, source=source,
                          date=meta["date"], device=meta["device"],
                          peak_flops=meta["peak"]["peak_flops_per_gpu"],
                          ar_buckets_in_flight=IN_FLIGHT_BUCKETS)
    prof = problems.uncalibrated["step"].timer.profile
    doc = json.loads(Path(prof.source).read_text())
    doc["calibration"] = cal.as_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    # in-sample: this run's plans predicted with what was just fitted
    fitted = dataclasses.replace(prof, calibration=cal)
    probs = {obj: p.with_timer(dataclasses.replace(p.timer, profile=fitted))
             for obj, p in problems.uncalibrated.items()}
    measured = {r["key"]: r["measured"] for r in result["plans"]}
    for r, cand in zip(result["plans"], candidates):
        r["predicted"]["in_sample"] = predictions(probs["step"], cand)
    pred = {r["key"]: r["predicted"]["in_sample"] for r in result["plans"]}
    result["summary"]["in_sample"] = summarize_variant(probs, candidates, measured, pred)
    meta["calibration_written"] = {"path": str(out), "describe": cal.describe(),
                                   "fit": {k: v for k, v in cal.fit.items() if k != "in_sample"}}
