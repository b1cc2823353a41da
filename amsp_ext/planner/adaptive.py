"""Adaptive AMSP's settings (pure Python, like AutoPlanConfig: the launcher, the DeepSpeed
``amsp`` block and the engine all validate with it, torch-free).

[Note: adaptive is opt-in]
``ShardConfig(adaptive=AdaptiveConfig(...))``, ``amsp train --adaptive``, ds_config
``amsp.adaptive``. None (the default) changes nothing: no monitor, no extra collective, the
same hot path. With it on, the run may re-plan while it trains: when the measured/predicted
time of some collective kind stays outside ``band`` for ``window`` steps, the profile is re-fit
from what was measured, the planner runs again and the engine switches plans in memory
(runtime/replan/switch.py) if the predicted gain over the remaining steps exceeds the measured cost
of a switch by the ``hysteresis`` margin, and no earlier than ``min_steps_between_switches``
after the last switch. ``allow_replan=False`` forbids replacing a plan the user gave as
factors or a name; adaptive then has nothing to do on such a plan, which is refused.
``horizon_steps`` is how many steps a switch's gain is counted over where the run's length is
not known (your own loop, DeepSpeed); ``amsp train`` counts the steps it has left instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from amsp_ext.choices import check_bool, check_int, check_number
from amsp_ext.planner.plan import is_auto

__all__ = ["AdaptiveConfig", "Decision", "KIND_TERMS", "Monitor", "check_replannable", "decide",
           "crosses_nodes", "predicted_by_kind", "refit_scales", "replan", "trace_kinds_cross_nodes",
           "predicted_trace_kinds", "switch_move_s"]


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    # measured / predicted time of a collective kind inside (low, high) counts as "as planned"
    band: tuple[float, float] = (0.67, 1.5)
    window: int = 20  # consecutive steps outside the band before re-planning
    min_steps_between_switches: int = 50
    hysteresis: float = 0.1  # switch only if gain > (1 + hysteresis) x switch cost
    allow_replan: bool = True  # may a plan given as factors or a name be replaced?
    horizon_steps: int = 1000  # steps a switch must pay back over when the run's end is unknown

    def __post_init__(self) -> None:
        band = self.band
        if isinstance(band, list):
            band = tuple(band)
            object.__setattr__(self, "band", band)
        ok = (isinstance(band, tuple) and len(band) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                      for x in band))
        if not ok or not 0 < band[0] < 1 < band[1]:
            raise ValueError(f"adaptive.band must be two numbers (low, high) with 0 < low < 1 < high "
                             f"(a non-empty band around measured = predicted), got {self.band!r}")
        object.__setattr__(self, "band", (float(band[0]), float(band[1])))
        check_int(self.window, "adaptive.window (steps)", minimum=1)
        check_int(self.min_steps_between_switches, "adaptive.min_steps_between_switches", minimum=0)
        check_number(self.hysteresis, "adaptive.hysteresis", minimum=0)
        check_bool(self.allow_replan, "adaptive.allow_replan")
        check_int(self.horizon_steps, "adaptive.horizon_steps", minimum=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "adaptive") -> "AdaptiveConfig":
        """From a JSON object (ds_config ``amsp.adaptive``); an unknown key is one line."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object with keys band, window, "
                             f"min_steps_between_switches, hysteresis, allow_replan, "
                             f"horizon_steps; got {d!r}")
        known = ("band", "window", "min_steps_between_switches", "hysteresis", "allow_replan",
                 "horizon_steps")
        for k in d:
            if k not in known:
                raise ValueError(f"{where}.{k} is not an adaptive setting (allowed: {', '.join(known)})")
        return cls(**d)


def check_replannable(plan: Any, adaptive: AdaptiveConfig | None, *, flag: str = "adaptive.allow_replan") -> None:
    """Adaptive on a plan that may not be replaced (anything but "auto" with allow_replan
    false) could never act: refuse it in one line."""
    if adaptive is None or adaptive.allow_replan:
        return
    if is_auto(plan):
        return
    raise ValueError(f"{flag}: false with plan {plan} (explicit factors or a name) leaves adaptive "
                     f"nothing it may change; use plan 'auto', or {flag} true, or turn adaptive off")


# -- monitor and decide (pure; the engine feeds them agreed numbers) -------------------------------
# [Note: what is compared]
# A "kind" is a collective's group kind (topology/groups.py): param_shard (AG/RS, the planner's
# Tp), grad (Tg), param_replica (T0_os) and optim_bcast (T1_os). Each step the caller hands the
# monitor the measured seconds per kind (every rank's, averaged in one small all-reduce at the
# step boundary, so every rank holds the same numbers and takes the same decisions) and the
# planner's prediction for the current plan (planner/cost.py: CommCost, per step). A kind
# drifts when its measured/predicted ratio stayed outside the band, on the same side, for each
# of the last ``window`` steps; one slow step (a checkpoint, a hiccup) resets nothing but does
# not trigger anything either. After every re-plan, switch or not, the re-fit profile becomes
# the prediction and the windows restart: otherwise a link that stays degraded would re-plan
# every window forever (tests/test_adaptive.py simulates both a steady and a cut link).

KIND_TERMS = {"param_shard": "t_p", "grad": "t_g", "param_replica": "t0_os", "optim_bcast": "t1_os"}


def predicted_by_kind(comm: Any) -> dict[str, float]:
    """The planner's per-step seconds per group kind, from a CommCost (or its as_dict())."""
    d = comm.as_dict() if hasattr(comm, "as_dict") else dict(comm)
    return {kind: float(d[term]) for kind, term in KIND_TERMS.items()}


class Monitor:
    """Sliding windows of measured/predicted per collective kind (see [Note: what is compared])."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self.ratios: dict[str, list[float]] = {}

    def observe(self, measured: dict[str, float], predicted: dict[str, float]) -> dict[str, float]:
        """Record one step; returns this step's ratios (kinds the plan predicts no time for,
        or that were not measured, are skipped)."""
        out = {}
        for kind, p in predicted.items():
            m = measured.get(kind)
            if m is None or not p > 0:
                continue
            r = out[kind] = m / p
            w = self.ratios.setdefault(kind, [])
            w.append(r)
            del w[:-self.config.window]
        return out

    def drift(self) -> dict[str, float]:
        """Kinds out of band for the whole window, on one side -> their median ratio."""
        low, high = self.config.band
        out = {}
        for kind, w in self.ratios.items():
            if len(w) < self.config.window:
                continue
            if all(r > high for r in w) or all(r < low for r in w):
                out[kind] = _median(w)
        return out

    def reset(self) -> None:
        """After a switch (new plan, new predictions) or a re-plan that kept the plan."""
        self.ratios.clear()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def refit_scales(drift: dict[str, float], crosses_nodes: dict[str, bool]) -> tuple[float, float]:
    """Bandwidth multipliers (intra-node, cross-node) for CommTimer.scaled from the drifted
    kinds: 1 / the median measured/predicted ratio of the drifted kinds of that level (a
    level without a drifted kind keeps 1). A collective 4x slower than predicted means a link
    with a quarter of the profile's bandwidth."""
    out = []
    for cross in (False, True):
        rs = [r for k, r in drift.items() if crosses_nodes.get(k, False) == cross]
        out.append(1.0 / _median(rs) if rs else 1.0)
    return out[0], out[1]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One re-planning decision, with every number it was made from (logged as one line)."""

    step: int
    switch: bool
    reason: str
    current: str
    candidate: str
    current_step_s: float  # predicted per step under the re-fit profile
    candidate_step_s: float
    remaining_steps: int
    gain_s: float  # (current - candidate) x remaining steps
    switch_cost_s: float
    steps_since_switch: int
    drift: dict[str, float]
    scales: tuple[float, float]

    def line(self) -> str:
        drift = ", ".join(f"{k} x{r:.2f}" for k, r in sorted(self.drift.items()))
        return (f"adaptive step {self.step}: {'SWITCH' if self.switch else 'stay'} "
                f"({self.reason}); drift {drift or 'none'}; bandwidth x{self.scales[0]:.3g} intra, "
                f"x{self.scales[1]:.3g} inter; {self.current} {self.current_step_s:.4g}s/step vs "
                f"{self.candidate} {self.candidate_step_s:.4g}s/step over {self.remaining_steps} "
                f"steps: gain {self.gain_s:.4g}s vs switch cost {self.switch_cost_s:.4g}s")


def decide(*, step: int, current: str, candidate: str, current_step_s: float, candidate_step_s: float,
           remaining_steps: int, switch_cost_s: float, steps_since_switch: int,
           config: AdaptiveConfig, drift: dict[str, float] | None = None,
           scales: tuple[float, float] = (1.0, 1.0)) -> Decision:
    """Switch only to another plan, no sooner than ``min_steps_between_switches`` after the last
    switch, and only if the predicted gain over the remaining steps exceeds the measured cost
    of a switch by the hysteresis margin: gain > (1 + hysteresis) x cost. Together with the
    window this is what keeps a steady link from flapping: a switch needs a window of drift, a
    predicted gain above its cost, and resets the window."""
    gain = (current_step_s - candidate_step_s) * max(0, remaining_steps)
    need = (1 + config.hysteresis) * switch_cost_s
    if candidate == current:
        switch, reason = False, "the current plan is still the best under the re-fit profile"
    elif steps_since_switch < config.min_steps_between_switches:
        switch, reason = False, (f"{steps_since_switch} steps since the last switch < "
                                 f"{config.min_steps_between_switches}")
    elif gain <= need:
        switch, reason = False, f"gain {gain:.4g}s <= (1 + {config.hysteresis:g}) x cost = {need:.4g}s"
    else:
        switch, reason = True, f"gain {gain:.4g}s > (1 + {config.hysteresis:g}) x cost = {need:.4g}s"
    return Decision(step=step, switch=switch, reason=reason, current=current, candidate=candidate,
                    current_step_s=current_step_s, candidate_step_s=candidate_step_s,
                    remaining_steps=remaining_steps, gain_s=gain, switch_cost_s=switch_cost_s,
                    steps_since_switch=steps_since_switch, drift=dict(drift or {}), scales=scales)


def crosses_nodes(plan: Any, gpus_per_node: int, num_nodes: int) -> dict[str, bool]:
    """Which of the plan's group kinds span nodes (their time follows the cross-node links)."""
    meshes = {"param_shard": plan.mesh("p"), "grad": plan.grad_mesh(),
              "param_replica": plan.replica_mesh(gpus_per_node, num_nodes), "optim_bcast": plan.bcast_mesh()}
    return {k: m[1] > 1 for k, m in meshes.items()}


def replan(problem: Any, current: Any, scales: tuple[float, float]) -> tuple[Any, float, float]:
    """The planner's best plan once the profile's bandwidths are scaled by ``scales`` (intra,
    inter): (best plan, current plan's predicted seconds, best plan's), by the problem's
    objective (planner/search.py; ``comm`` = the paper's Eq. 1 terms, ``step`` = step model)."""
    from amsp_ext.planner.search import evaluate, search

    scaled = problem.with_timer(problem.timer.scaled(intra=scales[0], inter=scales[1]))
    result = search(scaled)
    best = result.best
    mine = evaluate(scaled, current, with_step=scaled.objective == "step")
    return best.plan, result.objective(mine), result.objective(best)


# [Note: the kinds amsp train monitors]
# ``amsp train --adaptive`` (runtime/replan/adaptive.py) feeds the Monitor the kinds of the collectives
# trace (runtime/measure/comm_trace.py: AG, RS, AR, BC), not the group kinds above: they are what
# ``amsp tune`` checked the step model against, and their prediction is the step model's
# ``kind_times(...).busy_s`` (planner/step.py; calibrated when the profile carries a
# calibration): the time of the kind's collectives with nothing overlapping them. The measured
# side is the trace's ``busy_s`` (the union of the kind's in-flight intervals), the same pairing
# as ``amsp tune``'s report. AR mixes the gradient all-reduces of M-1 micro-batches over the
# ``grad`` group with the last one over ``param_replica``: it counts as crossing nodes when either
# of them does (a cut link then shows as the AR drift of the crossing part, diluted by the other).


def trace_kinds_cross_nodes(plan: Any, gpus_per_node: int, num_nodes: int,
                            num_micro_batches: int) -> dict[str, bool]:
    """Which trace kinds (AG, RS, AR, BC) of ``plan`` span nodes (see the Note above)."""
    g = crosses_nodes(plan, gpus_per_node, num_nodes)
    return {"AG": g["param_shard"], "RS": g["param_shard"],
            "AR": g["param_replica"] or (num_micro_batches > 1 and g["grad"]),
            "BC": g["optim_bcast"]}


def predicted_trace_kinds(problem: Any, plan: Any, scales: tuple[float, float] = (1.0, 1.0)) -> dict[str, float]:
    """The step model's per-step busy seconds per trace kind for ``plan`` once the profile's
    bandwidths are scaled by ``scales`` (what ``amsp tune`` predicts, planner/step.py)."""
    from amsp_ext.planner.search import evaluate
    from amsp_ext.planner.step import kind_times

    scaled = problem.with_timer(problem.timer.scaled(intra=scales[0], inter=scales[1]))
    c = evaluate(scaled, plan, with_step=True)
    kt = kind_times(plan, scaled.spec, scaled.training, scaled.cluster, scaled.timer, c.comm,
                    num_micro_batches=scaled.num_micro_batches, step=c.step,
                    efficiency=scaled.efficiency, overlap=scaled.overlap,
                    calibration=scaled.calibration)
    return {k: float(v) for k, v in kt.busy_s.items()}


# [Note: the first switch's cost]
# ``decide`` weighs the gain against what a switch costs. After a switch that is its measured
# time; before the first one nothing has been measured, and the start-up ``shard`` time alone
# was far too low: on the 2 x 2 lab at 100 Mbit (small-llama, comparisons/results/adaptive_*)
# shard took 0.27 s and the switch 6.3 s, because a switch broadcasts the whole model state
# over the world (runtime/replan/switch.py, [Note: the resharding layout], step 2) on the link that
# has just become slow. So before the first switch the cost is shard's time plus this: the
# re-fit profile's time for one broadcast of the state's bytes (fp32 masters, which under fp32
# are the parameters, and the optimizer states) on the world mesh. Still a lower bound (the
# switch broadcasts chunk by chunk); 0 when the profile has no world-mesh broadcast.


def switch_move_s(problem: Any, scales: tuple[float, float] = (1.0, 1.0)) -> float:
    """The profile's seconds to broadcast the model state a switch moves over the world, once
    its bandwidths are scaled by ``scales`` (see [Note: the first switch's cost])."""
    from amsp_ext.planner.memory import optimizer_bytes_per_param, param_bytes
    from amsp_ext.planner.profile import ProfileError

    t, c = problem.training, problem.cluster
    per_param = optimizer_bytes_per_param(t.optimizer, t.precision)
    if t.precision == "fp32":  # no separate master: the parameter is it
        per_param += param_bytes(t.precision)
    timer = problem.timer.scaled(intra=scales[0], inter=scales[1])
    try:
        return float(timer.time("broadcast", problem.spec.num_params * per_param, c.gpus_per_node, c.num_nodes))
    except ProfileError:
        return 0.0
