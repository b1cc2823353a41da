"""What ``amsp plan`` prints: one JSON object, or the same content as readable tables.

Pure Python.
"""

from __future__ import annotations

from typing import Any

from amsp_ext.planner.baselines import Baseline, baselines, comparison
from amsp_ext.planner.search import (
    GiB, Candidate, SearchResult, SensitivityCase, evaluate, pareto, sensitivity,
)

__all__ = ["build_report", "format_text"]


def _candidate_json(result: SearchResult, c: Candidate, rank: int | None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "plan": str(c.plan),
        "factors": c.plan.as_dict(),
        "rank": rank,
        "feasible": c.feasible,
        "objective_s": result.objective(c) if c.feasible or result.problem.objective == "comm"
        else None,
        "t_comm_s": c.comm.as_dict(),
        "memory_bytes": c.memory.total,
        "growth_s_per_micro_batch": c.growth_s,
        "reason": result.reason(c),
    }
    if c.step is not None:
        d["step"] = c.step.as_dict()
    return d


def _baseline_json(chosen: Candidate, b: Baseline) -> dict[str, Any]:
    c = b.candidate
    return {
        "name": b.key,
        "label": b.label,
        "plan": str(b.plan),
        "factors": b.plan.as_dict(),
        "note": b.note,
        "feasible": c.feasible,
        "t_comm_s": c.comm.as_dict(),
        "memory_bytes": c.memory.as_dict(),
        "step": c.step.as_dict() if c.step else None,
        "comparison": comparison(chosen, b),
        "comm_ratio": (c.comm.total / chosen.comm.total) if chosen.comm.total > 0 else None,
        "memory_delta_bytes": chosen.memory.total - c.memory.total,
    }


def build_report(result: SearchResult, *, with_pareto: bool = False,
                 sensitivity_factor: float | None = None, mics_size: int | None = None,
                 hpz_size: int | None = None) -> dict[str, Any]:
    """The JSON object of ``amsp plan --json`` (see the CLI contract in docs/planner.md)."""
    prob = result.problem
    best = result.best
    if best.step is None:
        best = evaluate(prob, best.plan, with_step=True)
    spec, cl, tr = prob.model, prob.cluster, prob.training
    prof = prob.timer.profile
    pf = result.prefiltered
    out: dict[str, Any] = {
        "plan": {**best.plan.as_dict(), "tensor_parallel": prob.tensor_parallel},
        "plan_text": str(best.plan),
        "feasible": True,
        "objective": prob.objective,
        "objective_s": result.objective(best),
        "t_comm_s": best.comm.as_dict(),
        "memory_bytes": {**best.memory.as_dict(), "limit": prob.memory_limit,
                         "gpu": cl.gpu_memory_bytes, "reserve": prob.memory_reserve_bytes},
        "step": best.step.as_dict(),
        "num_micro_batches": prob.num_micro_batches,
        "inputs": {
            "model": {"name": spec.name, "num_params": spec.num_params,
                      "num_layers": spec.num_layers, "hidden_size": spec.hidden_size},
            "cluster": {"num_nodes": cl.num_nodes, "gpus_per_node": prob.node_gpus,
                        "gpu_memory_bytes": cl.gpu_memory_bytes, "peak_flops": cl.peak_flops,
                        "nodes_per_leaf": cl.nodes_per_leaf},
            "training": {k: getattr(tr, k) for k in (
                "seq_len", "micro_batch_size", "global_batch_tokens", "global_batch_size",
                "num_micro_batches", "recompute", "precision", "optimizer", "bucket_bytes",
                "granularity")},
            "profile": {"name": prof.name, "source": prof.source,
                        "concurrency": prof.concurrency, "missing_mesh": prob.timer.missing},
            "efficiency": prob.efficiency,
            "tie_tolerance": prob.tie_tolerance,
            "step_model": step_model_text(prob),
            "calibration": prob.calibration.as_dict() if prob.calibration else None,
        },
        "extrapolated": result.extrapolated,
        "prefilter": {"considered": pf.num_considered, "accepted": len(pf.accepted),
                      "rejected_by_rule": pf.rejected_by_rule()},
        "candidates": [_candidate_json(result, c, i + 1) for i, c in enumerate(result.ranked)]
        + [_candidate_json(result, c, None) for c in result.infeasible],
        "baselines": [_baseline_json(best, b)
                      for b in baselines(prob, mics_size=mics_size, hpz_size=hpz_size)],
    }
    if prob.tp_comm is not None:
        out["tensor_parallel"] = {"degree": prob.tensor_parallel,
                                  "data_parallel_world": {"num_nodes": cl.num_nodes,
                                                          "gpus_per_node": cl.gpus_per_node},
                                  "shard_params": prob.spec.num_params,
                                  "global_batch_tokens": prob.global_batch_tokens,
                                  "all_reduces": prob.tp_comm.as_dict()}
    if cl.nodes_per_leaf:
        out["cross_leaf"] = [c for c in ("p", "g", "os")
                             if best.plan.mesh(c)[1] > cl.nodes_per_leaf]
    if with_pareto:
        out["pareto"] = [{"plan": str(c.plan), "memory_bytes": c.memory.total,
                          "objective_s": result.objective(c)} for c in pareto(result)]
    if sensitivity_factor is not None:
        cases = sensitivity(result, sensitivity_factor)
        out["sensitivity"] = {
            "factor": sensitivity_factor,
            "stable": not any(c.changed for c in cases),
            "cases": [_sens_json(c) for c in cases],
        }
    return out


UNCALIBRATED = ("uncalibrated: compute at --efficiency of --peak-tflops, the optimizer at the "
                "GPU's memory bandwidth, every overlap as the paper describes; `amsp tune "
                "--calibrate-out` measures them")


def step_model_text(prob) -> str:
    """What the step objective's constants are: the profile's calibration, or the defaults."""
    return prob.calibration.describe() if prob.calibration else UNCALIBRATED


def _sens_json(c: SensitivityCase) -> dict[str, Any]:
    return {"intra_bw": c.intra, "inter_bw": c.inter, "plan": str(c.plan), "changed": c.changed,
            "nominal_plan_regret_s": c.regret_s if c.regret_s != float("inf") else None}


# -- text ---------------------------------------------------------------------------------------

def _gib(b: int | float) -> str:
    return f"{b / GiB:.1f}"


def format_text(report: dict[str, Any], *, top: int = 10) -> str:
    inp = report["inputs"]
    m, cl, tr, pr = inp["model"], inp["cluster"], inp["training"], inp["profile"]
    t, mem, st = report["t_comm_s"], report["memory_bytes"], report["step"]
    conc = ("cross-node times x R/p0 for concurrent groups" if pr["concurrency"] == "single_group"
            else "measured with all groups active")
    lines = [
        f"model    {m['name']}: {_count(m['num_params'])} parameters, {m['num_layers']} layers",
        f"cluster  {cl['num_nodes']} nodes x {cl['gpus_per_node']} GPUs, "
        f"{_gib(cl['gpu_memory_bytes'])} GiB and {cl['peak_flops'] / 1e12:.3g} TFLOP/s per GPU",
        f"profile  {pr['name']} ({pr['concurrency']}: {conc})",
        f"training seq {tr['seq_len']} x micro-batch {tr['micro_batch_size']}, "
        f"M = {report['num_micro_batches']} per step, {tr['precision']}, {tr['optimizer']}, "
        f"{'recompute' if tr['recompute'] else 'no recompute'}, bucket "
        f"{tr['bucket_bytes'] / 2**20:.0f} MiB; objective: "
        + ("communication time (Eq. 1)" if report["objective"] == "comm" else "step time"),
        "",
        f"plan     {report['plan_text']}   (sp={_s(report['plan'], 'p')}, "
        f"sg={_s(report['plan'], 'g')}, sos={_s(report['plan'], 'os')})",
        f"  comm     {t['total']:.3f} s = Tp {t['t_p']:.3f} + Tg {t['t_g']:.3f} "
        f"+ T0_os {t['t0_os']:.3f} + T1_os {t['t1_os']:.3f}"
        + (f" + Ttp {t['t_tp']:.3f}" if t.get("t_tp") else ""),
        f"  memory   {_gib(mem['total'])} GiB = params {_gib(mem['params'])} + grads "
        f"{_gib(mem['grads'])} + optim {_gib(mem['optim'])} + activations "
        f"{_gib(mem['activations'])} + tmp {_gib(mem['tmp'])}  (usable {_gib(mem['limit'])} of "
        f"{_gib(mem['gpu'])} GiB)",
        f"  step     {st['step_s']:.3f} s, {st['exposed_comm_s']:.3f} s of it exposed "
        f"communication; MFU {st['mfu']:.1%}, {st['tokens_per_gpu_per_s']:.0f} tokens/GPU/s "
        f"(compute efficiency {st['efficiency']:.2f})",
    ]
    if "tensor_parallel" in report:
        lines += _tp_lines(report)
    lines.append(f"  step model: {inp['step_model']}")
    ext = report["extrapolated"]
    if ext:
        shown = ", ".join(ext[:4]) + (f", ... ({len(ext)} in all; see --json)" if len(ext) > 4 else "")
        lines.append(f"  extrapolated (alpha-beta fit, not in the profile): {shown}")
    if report.get("cross_leaf"):
        lines.append(f"  crosses leaf switches: {', '.join(report['cross_leaf'])}")
    pf = report["prefilter"]
    feas = [c for c in report["candidates"] if c["feasible"]]
    lines += ["", f"candidates: {pf['considered']} considered, {pf['accepted']} pass the "
              f"pre-filter, {len(feas)} fit in memory (best {min(top, len(feas))} shown)",
              f"  {'#':>3}  {'plan':<26}{'objective':>10} {'Tp':>8} {'Tg':>8} {'T0_os':>8} "
              f"{'T1_os':>8} {'mem GiB':>8}  note"]
    for c in feas[:top]:
        tc = c["t_comm_s"]
        lines.append(
            f"  {c['rank']:>3}  {c['plan']:<26}{c['objective_s']:>10.3f} {tc['t_p']:>8.3f} "
            f"{tc['t_g']:>8.3f} {tc['t0_os']:>8.3f} {tc['t1_os']:>8.3f} "
            f"{_gib(c['memory_bytes']):>8}  {c['reason'] or 'chosen'}")
    on_world = (f", each with TP {report['tensor_parallel']['degree']} on the data-parallel world"
                if "tensor_parallel" in report else "")
    lines += ["", f"baselines (same formulas{on_world}):",
              f"  {'name':<16} {'plan':<29}{'comm s':>9} {'mem GiB':>8} {'fits':>4} {'MFU':>6}  "
              f"the chosen plan, against this baseline"]
    for b in report["baselines"]:
        lines.append(
            f"  {b['label']:<16} {b['plan']:<29}{b['t_comm_s']['total']:>9.3f} "
            f"{_gib(b['memory_bytes']['total']):>8} {'yes' if b['feasible'] else 'no':>4} "
            f"{b['step']['mfu']:>6.1%}  {b['comparison'].split(': ', 1)[1]}")
    if "pareto" in report:
        lines += ["", "memory/time frontier (less memory first):"]
        lines += [f"  {_gib(p['memory_bytes']):>7} GiB  {p['objective_s']:.3f} s  {p['plan']}"
                  for p in report["pareto"]]
    if "sensitivity" in report:
        s = report["sensitivity"]
        lines += ["", f"sensitivity to bandwidth +-{s['factor']:.0%} (intra, cross-node "
                  f"independently): plan {'stable' if s['stable'] else 'CHANGES'}"]
        for c in s["cases"]:
            lines.append(f"  intra x{c['intra_bw']:.2f} inter x{c['inter_bw']:.2f}: {c['plan']}"
                         + (f"  (chosen plan {c['nominal_plan_regret_s']:+.3f} s slower there)"
                            if c["changed"] else ""))
    return "\n".join(lines)


def _tp_lines(report: dict[str, Any]) -> list[str]:
    """The TP lines of the chosen plan: its world and the TP share of the step beside AMSP's."""
    tp, st, t = report["tensor_parallel"], report["step"], report["t_comm_s"]
    dp, ar = tp["data_parallel_world"], tp["all_reduces"]
    step = st["step_s"]
    return [
        f"tensor   TP {tp['degree']} inside the node; AMSP over the data-parallel world "
        f"{dp['num_nodes']} x {dp['gpus_per_node']} ({_count(tp['shard_params'])} parameters per TP "
        f"rank), global batch {tp['global_batch_tokens']} tokens",
        f"  TP       {ar['layer_bytes'] / 2**20:.1f} MiB of all-reduces per layer and micro-batch; "
        f"{st['tp_comm_s']:.3f} s per step on the critical path ({st['tp_comm_s'] / step:.1%} of the "
        f"step) beside AMSP's {st['exposed_comm_s']:.3f} s exposed ({st['exposed_comm_s'] / step:.1%})"
        f"; comm (Eq. 1 + TP) {t['total']:.3f} s, {t['t_tp']:.3f} s of it TP",
    ]


def _s(plan: dict[str, int], c: str) -> int:
    return plan[f"s0_{c}"] * plan[f"s1_{c}"]


def _count(n: int) -> str:
    """7.00B, 3.02M: billions unless the model is smaller than one."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
