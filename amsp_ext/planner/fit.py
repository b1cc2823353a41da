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
3. comm_s_per_byte[k], comm_latency_s[k]: per plan, the measured busy time of its kind-k
   collectives less the profile's time for the collectives the engine issues (issued.py),
   against their bytes and number, non-negative least squares over the plans. Costs per byte
   and per collective, not a factor on the profile's time: on a CPU they are gloo's work
   waiting for a core, which does not grow when the link is slower (a factor fitted at 1 Gbit
   would multiply a 100 Mbit link's times). comm_time_scale stays 1.
4. blocking: a kind whose waits blocked the compute thread for at least 90% of its busy time,
   over all plans (on CPU: RS, which FSDP2 issues synchronously). micro_batch_overhead_s,
   compute_s_per_byte[k] of the other kinds: how much longer each plan computed than the probe
   (forward + backward less the time blocked in waits), against M and the bytes of each kind it
   issued, non-negative least squares. A kind no plan issued keeps 0 (the paper's rule).
5. step_overhead_s: the median over plans of measured - predicted step with the constants
   above and no overhead, clipped at 0.
Nothing is fitted to the ranking, and the model's form (the overlap rules, the engine's bucket
limit) is fixed in step.py, so a calibration from one job shape can be checked on others.
Kinds that always come together (AG and RS: every sharded plan issues both, in one proportion)
share their constants in a way the fit cannot split; their sum is what carries over.

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

__all__ = ["BLOCKING_SHARE", "PlanObservation", "ProbeObservation", "fit_calibration", "nnls"]

# a kind whose waits took at least this share of its busy time blocks the compute thread
BLOCKING_SHARE = 0.9


@dataclass(frozen=True, kw_only=True)
class PlanObservation:
    plan: Plan
    step_s: float  # measured step time (median)
    busy_s: dict[str, float]  # per kind AG/RS/AR/BC: wall time with one in flight, per step
    exposed_s: dict[str, float]  # per kind: time the compute thread was blocked in its waits
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
    fwd_rate, bwd_rate = _compute_rates(problem, probe)  # 1.
    intercept, opt_bw = _optimizer_rate(problem, plans, probe)  # 2.
    issued = [issued_profile_times(o.plan, prob0.spec, prob0.training, prob0.cluster, prob0.timer,
                                   num_micro_batches=M) for o in plans]
    per_byte, latency, observed = _comm_constants(plans, issued)  # 3.
    blocking, mb_overhead, cpu_per_byte, inflation = _compute_inflation(  # 4.
        plans, issued, probe, observed, M)

    def calibrated(overhead: float) -> Calibration:
        return Calibration(source=source, date=date, device=device, peak_flops=peak_flops,
                           forward_flops_per_s=fwd_rate, backward_flops_per_s=bwd_rate,
                           optimizer_bytes_per_s=opt_bw, step_overhead_s=overhead,
                           micro_batch_overhead_s=mb_overhead,
                           ar_buckets_in_flight=ar_buckets_in_flight, blocking=blocking,
                           comm_s_per_byte=per_byte, comm_latency_s=latency,
                           compute_s_per_byte=cpu_per_byte)

    # 5. overhead: what is left, median over plans
    cal0 = calibrated(0.0)
    residual = [o.step_s - _predict(prob0, cal0, o.plan) for o in plans]
    cal = calibrated(max(0.0, statistics.median(residual)))
    in_sample = {str(o.plan): {"measured_s": o.step_s, "predicted_s": _predict(prob0, cal, o.plan)}
                 for o in plans}
    fit = {
        "num_plans": len(plans),
        "probe": dataclasses.asdict(probe),
        "optimizer_intercept_s": intercept,
        "kinds_observed": [k for k in KINDS if observed[k]],
        "compute_inflation_s": {str(o.plan): float(i) for o, i in zip(plans, inflation)},
        "busy_less_profile_s": {str(o.plan): {k: o.busy_s.get(k, 0.0) - iss[k].time_s
                                              for k in KINDS if iss[k].count}
                                for o, iss in zip(plans, issued)},
        "in_sample": in_sample,
        "mean_abs_rel_error": statistics.fmean(abs(v["predicted_s"] / v["measured_s"] - 1)
                                               for v in in_sample.values()),
    }
    return dataclasses.replace(cal, fit=fit)


def _compute_rates(problem: Problem, probe: ProbeObservation) -> tuple[float, float]:
    """1. forward and backward FLOP/s from the probe (backward = 2 x forward FLOPs; with
    recomputation the probe's backward includes a forward, which is taken out)."""
    f_flops = _forward_flops(problem)
    bwd_s = probe.backward_s
    if problem.training.recompute:
        bwd_s = max(probe.backward_s - probe.forward_s, 1e-9)
    return f_flops / probe.forward_s, 2.0 * f_flops / bwd_s


def _optimizer_rate(problem: Problem, plans: list[PlanObservation],
                    probe: ProbeObservation) -> tuple[float, float]:
    """2. optimizer: t = a + bytes / B over the plans; ``(a, B)``."""
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
    return intercept, 1.0 / per_byte


def _comm_constants(plans: list[PlanObservation], issued: list[dict]):
    """3. per kind: measured busy - the profile's time ~ s_per_byte x bytes + latency x number;
    ``(per_byte, latency, observed)`` by kind."""
    per_byte, latency, observed = {}, {}, {}
    for k in KINDS:
        rows = [(iss[k], o.busy_s.get(k, 0.0)) for o, iss in zip(plans, issued) if iss[k].count]
        observed[k] = bool(rows) and sum(b for _, b in rows) > 0
        per_byte[k], latency[k] = 0.0, 0.0
        if not observed[k]:
            continue
        x = np.array([[i.nbytes, i.count] for i, _ in rows])
        y = np.array([b - i.time_s for i, b in rows])
        coef = nnls(x, y)
        per_byte[k], latency[k] = float(coef[0]), float(coef[1])
    return per_byte, latency, observed


def _compute_inflation(plans: list[PlanObservation], issued: list[dict], probe: ProbeObservation,
                       observed: dict[str, bool], M: int):
    """4. blocking kinds: exposed ~ busy in the trace; the others' compute time lost per byte,
    and per micro-batch (NNLS). ``(blocking, micro-batch overhead, per-byte by kind,
    inflation per plan)``."""
    blocking = tuple(k for k in KINDS if observed[k] and sum(o.exposed_s.get(k, 0.0) for o in plans)
                     >= BLOCKING_SHARE * sum(o.busy_s.get(k, 0.0) for o in plans))
    probe_compute = M * (probe.forward_s + probe.backward_s)
    kinds = [k for k in KINDS if observed[k] and k not in blocking]
    inflation = np.array([o.compute_s - probe_compute for o in plans])
    x = np.array([[M] + [iss[k].nbytes for k in kinds] for iss in issued], dtype=float)
    coef = nnls(x, inflation)
    cpu_per_byte = {k: 0.0 for k in KINDS}
    for k, v in zip(kinds, coef[1:]):
        cpu_per_byte[k] = float(v)
    return blocking, float(coef[0]), cpu_per_byte, inflation


def _predict(prob0: Problem, cal: Calibration, plan: Plan) -> float:
    """The calibrated step model's step time of ``plan`` (the profile without calibration)."""
    c = evaluate(prob0, plan, with_step=False)
    return step_estimate(plan, prob0.spec, prob0.training, prob0.cluster, prob0.timer, c.comm,
                         num_micro_batches=prob0.num_micro_batches, overlap=prob0.overlap,
                         calibration=cal).step_s
