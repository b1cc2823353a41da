"""From the ranks' records to the figures of a tune report: measured vs predicted per plan,
Spearman's rho, the planner's regret under each objective, the measured winner.

[Note: measured figures of a plan]
* Step time: per step, the slowest rank's time (a synchronous step is over when its last rank
  is); per round, the median over the timed steps; the plan's figure is the median over rounds,
  with the min-max over rounds as its spread.
* Phases (forward, backward, optimizer) and per-kind communication (busy, exposed, count):
  per step the mean over ranks, then the median over steps of all rounds.
* Model-state bytes and peak memory: the largest rank's.

[Note: regret and rank correlation]
The planner's pick under an objective is the best plan of its search (the tie-break included).
Regret = measured step of the pick / best measured step - 1 (0 when the pick is the measured
winner). Spearman's rho is the Pearson correlation of the ranks (ties get their mean rank) of
predicted and measured step times over the measured plans; for ``--objective comm`` it ranks by
the communication time, which is what that objective minimises.

[Note: how far the measurement itself can rank]
On a noisy cluster two plans whose true step times differ by less than the round-to-round
spread swap places from one tune run to the next, and no model can predict that order. The
measurement's own reliability is its split-half rank correlation: split the rounds into two
halves, take each plan's median in each half, and correlate the two rankings (every balanced
split, median over splits). Spearman-Brown turns that into the reliability of the medians over
all rounds, r_full = 2 r_half / (1 + r_half), and by the attenuation formula a model that knew
the true step times would reach about sqrt(r_full) against the measured ranking: the *ceiling*
that a Spearman rho of the planner should be read against. It is an estimate, coarse with few
plans. It does not know which plans are the same program: at M = 1 the gradient factor only
changes memory, so sg = sp and sg = sos run the same collectives, and a model must predict them
the same; their measured order is a coin flip that no prediction can match.

Pure Python.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any, Iterable, Sequence

from amsp_ext.planner.calibration import KINDS
from amsp_ext.planner.search import Problem, evaluate, search
from amsp_ext.planner.step import kind_times, model_flops_per_token
from amsp_ext.tune.candidates import Candidate

__all__ = ["aggregate", "compute_drift", "predictions", "ranks", "regret", "reliability",
           "spearman", "summarize_variant"]

_MAX_SPLITS = 200


def _median(xs: Iterable[float]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def aggregate(records: list[dict[str, Any]], candidates: list[Candidate]) -> dict[str, dict]:
    """Per plan key: its measured figures (see [Note: measured figures of a plan])."""
    by_plan: dict[str, dict[int, list[dict]]] = {}
    for rank_rec in records:
        for run in rank_rec["runs"]:
            by_plan.setdefault(run["plan"], {}).setdefault(run["round"], []).append(run)
    out = {}
    for cand in candidates:
        rounds = by_plan.get(cand.key, {})
        round_steps, all_steps, loads = [], [], []
        for r, runs in sorted(rounds.items()):
            num_steps = min(len(run["steps"]) for run in runs)
            per_step = [max(run["steps"][i]["step_s"] for run in runs) for i in range(num_steps)]
            round_steps.append(statistics.median(per_step))
            loads.append(runs[0].get("load"))
            for i in range(num_steps):
                all_steps.append([run["steps"][i] for run in runs])
        phases = {ph: {k: _median(statistics.fmean(s["phases"][ph][k] for s in step) for step in all_steps)
                       for k in ("wall_s", "blocked_s")}
                  for ph in ("forward", "backward", "optimizer", "loss_sync")}
        comm = {kind: {k: _median(statistics.fmean(s["comm"][kind][k] for s in step) for step in all_steps)
                       for k in ("busy_s", "sum_s", "exposed_s", "count", "bytes")}
                for kind in (*KINDS, "other")}
        runs = [run for rs in rounds.values() for run in rs]
        foreign = [f for rs in rounds.values() if (f := foreign_cores(rs)) is not None]
        states = [run["model_state_bytes"]["total"] for run in runs]
        peaks = [run["peak_memory_bytes"] for run in runs if run.get("peak_memory_bytes") is not None]
        out[cand.key] = {
            "label": cand.label,
            "step_s": _spread(round_steps) if round_steps else None,
            "step_s_rounds": round_steps,
            "loads": loads,
            "phases": phases,
            "comm": comm,
            "model_state_bytes": max(states) if states else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "setup_s": _median(run["setup_s"] for run in runs),
            "foreign_cores": foreign,
        }
    return out


def foreign_cores(runs: list[dict[str, Any]]) -> float | None:
    """Cores other jobs kept busy while one plan ran (one round, all ranks): per host, its busy
    CPU seconds less every local rank's own, over the wall time; the largest host's."""
    by_host: dict[str, list[dict]] = {}
    for run in runs:
        cpu = run.get("cpu")
        if cpu and cpu.get("host_busy_s") is not None:
            by_host.setdefault(cpu["host"], []).append(cpu)
    worst = None
    for cpus in by_host.values():
        wall = max(c["wall_s"] for c in cpus)
        other = max(c["host_busy_s"] for c in cpus) - sum(c["own_s"] for c in cpus)
        cores = max(0.0, other / wall) if wall > 0 else None
        if cores is not None and (worst is None or cores > worst):
            worst = cores
    return worst


def predictions(problem: Problem, cand: Candidate) -> dict[str, Any]:
    """What the planner predicts for ``cand`` on ``problem`` (step, per kind, memory)."""
    c = evaluate(problem, cand.plan, with_step=True)
    st = c.step
    kt = kind_times(cand.plan, problem.spec, problem.training, problem.cluster, problem.timer,
                    c.comm, num_micro_batches=problem.num_micro_batches, step=st,
                    efficiency=problem.efficiency, overlap=problem.overlap,
                    calibration=problem.calibration)
    return {
        "step_s": st.step_s, "compute_s": st.compute_s, "optimizer_s": st.optimizer_s,
        "exposed_comm_s": st.exposed_comm_s, "mfu": st.mfu, "comm_total_s": c.comm.total,
        "terms": c.comm.as_dict(),
        "busy_s": kt.busy_s, "exposed_s": kt.exposed_s,
        "model_state_bytes": c.memory.model_states, "peak_memory_bytes": c.memory.total,
        "fits": c.feasible,
    }


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho of two equally long sequences (None for fewer than 3 or a constant one)."""
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} vs {len(b)} values")
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    if va == 0 or vb == 0:
        return None
    return cov / (va * vb)


def compute_drift(result: dict[str, Any]) -> dict[str, float] | None:
    """This run's compute speed against the calibration's (a tune result with a calibrated
    profile): the forward and backward FLOP/s of this run's probes (the unsharded model, every
    rank at once, medians) over the calibration's, less 1. A calibration carries the device's
    speed on the day it was measured; on a shared machine that speed moves, and the calibrated
    step predictions move with it. None without a calibration, a probe or a recompute-free job."""
    meta = result["meta"]
    cal, probes, job = meta.get("calibration"), result.get("probes"), meta["job"]
    if not cal or not probes or job.get("recompute"):
        return None
    fwd_flops = meta["flops_per_token"] / 3.0 * job["seq_len"] * job["micro_batch_size"]
    fwd = statistics.median(p["forward_s"] for p in probes)
    bwd = statistics.median(p["backward_s"] for p in probes)
    return {"forward": fwd_flops / fwd / cal["forward_flops_per_s"] - 1.0,
            "backward": 2.0 * fwd_flops / bwd / cal["backward_flops_per_s"] - 1.0}


def reliability(rounds: dict[str, Sequence[float]]) -> dict[str, Any] | None:
    """How well the measurement ranks the plans (see [Note: how far the measurement itself can
    rank]): ``split_half`` (median over balanced splits of the rounds), ``full`` (Spearman-Brown)
    and ``ceiling`` (sqrt of ``full``, 0 when it is not positive). None with fewer than 3 plans
    or 2 rounds."""
    keys = list(rounds)
    n = min((len(v) for v in rounds.values()), default=0)
    if len(keys) < 3 or n < 2:
        return None
    splits = []
    for half in itertools.combinations(range(n), n // 2):
        if n % 2 == 0 and 0 not in half:
            continue  # each split once (its complement is the same split)
        splits.append(half)
        if len(splits) >= _MAX_SPLITS:
            break
    values = []
    for half in splits:
        other = [i for i in range(n) if i not in half]
        a = [statistics.median(rounds[k][i] for i in half) for k in keys]
        b = [statistics.median(rounds[k][i] for i in other) for k in keys]
        rho = spearman(a, b)
        values.append(0.0 if rho is None else rho)
    half_rho = statistics.median(values)
    full = 2 * half_rho / (1 + half_rho) if half_rho > -1 else -1.0
    return {"split_half": half_rho, "full": full, "ceiling": math.sqrt(full) if full > 0 else 0.0,
            "num_splits": len(splits), "num_rounds": n}


def regret(pick: str, measured: dict[str, float]) -> float | None:
    """Measured step of ``pick`` / best measured step - 1."""
    if pick not in measured:
        return None
    return measured[pick] / min(measured.values()) - 1.0


def summarize_variant(problems: dict[str, Problem], candidates: list[Candidate],
                      measured: dict[str, dict], predicted: dict[str, dict]) -> dict[str, Any]:
    """Spearman and regret of one planner variant (uncalibrated / calibrated), both objectives.

    ``predicted[key]`` is ``predictions()`` of the step problem; the comm objective ranks by its
    ``comm_total_s``."""
    keys = [c.key for c in candidates if measured[c.key]["step_s"] is not None]
    meas = {k: measured[k]["step_s"]["median"] for k in keys}
    out: dict[str, Any] = {}
    for obj, prob in problems.items():
        res = search(prob)
        pick = str(res.best.plan)
        field = "step_s" if obj == "step" else "comm_total_s"
        pred = [predicted[k][field] for k in keys]
        # per round: the same figures from that round's medians alone (the spread)
        per_round = []
        num_rounds = min(len(measured[k]["step_s_rounds"]) for k in keys) if keys else 0
        for r in range(num_rounds):
            m_r = {k: measured[k]["step_s_rounds"][r] for k in keys}
            per_round.append({"spearman": spearman(pred, [m_r[k] for k in keys]),
                              "regret": regret(pick, m_r)})
        out[obj] = {
            "pick": pick,
            "spearman": spearman(pred, [meas[k] for k in keys]),
            "regret": regret(pick, meas),
            "per_round": per_round,
            "mean_abs_rel_error": (statistics.fmean(abs(predicted[k]["step_s"] / meas[k] - 1)
                                                    for k in keys) if obj == "step" and keys else None),
        }
    return out


def useful_flops_per_step(problem: Problem) -> float:
    return (model_flops_per_token(problem.spec, problem.training.seq_len)
            * problem.training.tokens_per_micro_batch * problem.num_micro_batches)
