"""Fit the step model's constants (calibration.py) to measured runs of one job shape.

Input: the plans ``amsp tune`` measured, each with its median step time, the per-kind busy time
of its collectives, its compute time (forward + backward wall time less the time blocked in
waits) and its optimizer time from the engine's trace; and the compute probe (the unsharded
model's forward, backward and optimizer step, every rank at once, no collective).

[Note: what is fitted from what]
Each constant comes from the measurement that isolates it, in this order, and only the last
one from step times:
1. forward / backward FLOP/s: the probe's forward and backward times (this model, this device,
   every rank busy). No plan's communication is in them.
2. optimizer bytes/s: the optimizer phase of every plan against the bytes its step touches
   (Phi / sos owned parameters), least squares with an intercept (the intercept, clipping and
   issuing the broadcasts, goes to the per-step overhead).
3. comm_time_scale[k], comm_latency_s[k]: per plan, the measured busy time of its kind-k
   collectives against the profile's time for the collectives the engine issues (issued.py)
   and their number, non-negative least squares over the plans: busy ~ scale x time +
   latency x number. A profile is measured with nothing else running; in training the same
   collective meets compute, other collectives and late ranks.
4. overlap[k]: how much longer compute ran in each plan than in the probe (the compute thread
   lost that time to the collectives in flight) against each kind's busy time, non-negative
   least squares: inflation ~ sum_k (1 - overlap[k]) busy[k]. A kind no plan issued keeps 1.
5. step_overhead_s: the median over plans of measured - predicted step with the constants
   above and no overhead, clipped at 0.
Nothing is fitted to the ranking, and the model's form (the overlap rules, the engine's bucket
limit) is fixed in step.py, so a calibration from one job shape can be checked on others.

Pure Python + NumPy.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import numpy as np

from amsp_ext.planner.calibration import KINDS, Calibration
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.search import Problem, evaluate
from amsp_ext.planner.step import (forward_flops_per_token, issued_profile_times,
                                   optimizer_traffic_bytes, step_estimate)

__all__ = ["PlanObservation", "ProbeObservation", "fit_calibration", "nnls"]


@dataclass(frozen=True, kw_only=True)
class PlanObservation:
    plan: Plan
    step_s: float  # measured step time (median)
    busy_s: dict[str, float]  # per kind AG/RS/AR/BC: wall time with one in flight, per step
    compute_s: float  # forward + backward wall less time blocked in waits, per step
    optimizer_s: float  # optimizer phase wall less time blocked in waits, per step


@dataclass(frozen=True, kw_only=True)
class ProbeObservation:
    forward_s: float  # one micro-batch's forward, unsharded model, every rank busy
    backward_s: float  # its backward (with recomputation: the recompute forward included)
    optimizer_s: float  # one AdamW step of the whole model


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (small problems)."""
    n = x.shape[1]
    active = list(range(n))
    while True:
        coef = np.zeros(n)
        if active:
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            coef[active] = sol
        neg = [j for j in active if coef[j] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda j: coef[j]))


def _forward_flops(problem: Problem) -> float:
    """Forward FLOPs of one micro-batch."""
    tr = problem.training
    return forward_flops_per_token(problem.spec, tr.seq_len) * tr.tokens_per_micro_batch


def fit_calibration(problem: Problem, plans: list[PlanObservation], probe: ProbeObservation, *,
                    source: str, date: str, device: str, peak_flops: float,
                    ar_buckets_in_flight: int | None) -> Calibration:
    """The constants of [Note: what is fitted from what], with what the fit saw in ``fit``."""
    if not plans:
        raise ValueError("fit_calibration needs at least one measured plan")
    base = dataclasses.replace(problem.timer.profile, calibration=None)
    prob0 = problem.with_timer(dataclasses.replace(problem.timer, profile=base))
    M = problem.num_micro_batches
    f_flops = _forward_flops(problem)
    bwd_s = probe.backward_s
    if problem.training.recompute:
        bwd_s = max(probe.backward_s - probe.forward_s, 1e-9)
    fwd_rate = f_flops / probe.forward_s
    bwd_rate = 2.0 * f_flops / bwd_s

    # 2. optimizer: t = a + bytes / B over the plans
    traffic = np.array([optimizer_traffic_bytes(problem.spec, o.plan, problem.training) for o in plans])
    t_opt = np.array([o.optimizer_s for o in plans])
    if len(plans) >= 2 and np.ptp(traffic) > 0:
        coef = nnls(np.column_stack([np.ones_like(traffic), traffic]), t_opt)
        intercept, per_byte = float(coef[0]), float(coef[1])
    else:
        intercept, per_byte = 0.0, 0.0
    if per_byte <= 0:  # no spread to fit on: the probe's full-model step
        full = optimizer_traffic_bytes(problem.spec, Plan(), problem.training)
        intercept, per_byte = 0.0, probe.optimizer_s / full
    opt_bw = 1.0 / per_byte

    # 3. per kind: measured busy ~ scale x (the profile's time) + latency x (number issued)
    issued = [issued_profile_times(o.plan, prob0.spec, prob0.training, prob0.cluster, prob0.timer,
                                   num_micro_batches=M) for o in plans]
    scale, latency, observed = {}, {}, {}
    for k in KINDS:
        rows = [(iss[k][0], iss[k][1], o.busy_s.get(k, 0.0)) for o, iss in zip(plans, issued)
                if iss[k][1] > 0]
        observed[k] = bool(rows) and sum(r[2] for r in rows) > 0
        scale[k], latency[k] = 1.0, 0.0
        if not observed[k]:
            continue
        x = np.array([[t, n] for t, n, _ in rows])
        y = np.array([b for *_, b in rows])
        coef = nnls(x, y) if len(rows) >= 2 else np.array([y[0] / x[0, 0], 0.0])
        if coef[0] <= 0:  # all latency: keep a time scale, put the rest per collective
            coef = np.array([sum(y) / sum(x[:, 0]), 0.0])
        scale[k], latency[k] = float(coef[0]), float(coef[1])

    # 4. overlap: compute inflation against busy time per kind (NNLS)
    probe_compute = M * (probe.forward_s + probe.backward_s)
    kinds = [k for k in KINDS if observed[k]]
    inflation = np.array([max(0.0, o.compute_s - probe_compute) for o in plans])
    overlap = {k: 1.0 for k in KINDS}
    if kinds:
        x = np.array([[o.busy_s.get(k, 0.0) for k in kinds] for o in plans])
        a = nnls(x, inflation)
        for k, v in zip(kinds, a):
            overlap[k] = float(min(1.0, max(0.0, 1.0 - v)))

    # 5. overhead: what is left, median over plans
    def calibrated(overhead: float) -> Calibration:
        return Calibration(source=source, date=date, device=device, peak_flops=peak_flops,
                           forward_flops_per_s=fwd_rate, backward_flops_per_s=bwd_rate,
                           optimizer_bytes_per_s=opt_bw, step_overhead_s=overhead,
                           ar_buckets_in_flight=ar_buckets_in_flight,
                           comm_time_scale=scale, comm_latency_s=latency, overlap=overlap)

    def predict(cal: Calibration, plan: Plan) -> float:
        c = evaluate(prob0, plan, with_step=False)
        return step_estimate(plan, prob0.spec, prob0.training, prob0.cluster, prob0.timer, c.comm,
                             num_micro_batches=M, overlap=prob0.overlap, calibration=cal).step_s

    cal0 = calibrated(0.0)
    residual = [o.step_s - predict(cal0, o.plan) for o in plans]
    overhead = max(0.0, statistics.median(residual))
    cal = calibrated(overhead)
    in_sample = {str(o.plan): {"measured_s": o.step_s, "predicted_s": predict(cal, o.plan)}
                 for o in plans}
    fit = {
        "num_plans": len(plans),
        "probe": dataclasses.asdict(probe),
        "optimizer_intercept_s": intercept,
        "kinds_observed": [k for k in KINDS if observed[k]],
        "compute_inflation_s": {str(o.plan): float(i) for o, i in zip(plans, inflation)},
        "in_sample": in_sample,
        "mean_abs_rel_error": statistics.fmean(abs(v["predicted_s"] / v["measured_s"] - 1)
                                               for v in in_sample.values()),
    }
    return dataclasses.replace(cal, fit=fit)
