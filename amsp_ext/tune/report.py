"""tune.json, the Markdown report and the predicted-vs-measured plot of an ``amsp tune`` run,
and the winner printed as ``--plan`` and as a ds_config ``amsp.plan``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from amsp_ext.planner.calibration import KINDS
from amsp_ext.tune.analysis import (aggregate, compute_drift, predictions, reliability,
                                   summarize_variant)
from amsp_ext.tune.candidates import Candidate, Problems

__all__ = ["build_result", "print_winner", "write_report"]

UNCALIBRATED_NOTE = ("the step model is **uncalibrated**: compute at 0.65 of the measured peak, the "
                     "optimizer at the planner's default memory bandwidth, every collective "
                     "overlapped as the paper describes (docs/planner.md)")


def build_result(config, problems: Problems, candidates: list[Candidate], records: list[dict],
                 meta: dict[str, Any]) -> dict[str, Any]:
    from amsp_ext import schema

    measured = aggregate(records, candidates)
    plans = []
    for cand in candidates:
        row = {"key": cand.key, "label": cand.label, "plan": cand.plan.as_dict(),
               "measured": measured[cand.key], "predicted": {}}
        for variant, probs in problems.variants().items():
            row["predicted"][variant] = predictions(probs["step"], cand)
        plans.append(row)
    summary = {}
    for variant, probs in problems.variants().items():
        pred = {r["key"]: r["predicted"][variant] for r in plans}
        summary[variant] = summarize_variant(probs, candidates, measured, pred)
    ok = [r for r in plans if r["measured"]["step_s"] is not None]
    winner = min(ok, key=lambda r: r["measured"]["step_s"]["median"])["key"] if ok else None
    cal = problems.calibrated["step"].calibration if problems.calibrated else None
    from amsp_ext.common.metrics import flops_per_token

    fpt = flops_per_token(config.hf_config(), config.batch.seq_len)
    for r in ok:
        tgs = config.tokens_per_rank_per_step / r["measured"]["step_s"]["median"]
        r["measured"]["tokens_per_gpu_per_s"] = tgs
        r["measured"]["mfu"] = fpt * tgs / meta["peak"]["peak_flops_per_gpu"]
    probes = [dict(p, rank=rec["rank"]) for rec in records for p in rec["probes"]]
    reserve = problems.uncalibrated["step"].memory_reserve_bytes
    meta = {**meta, "config": schema.to_dict(config), "job": config.job(reserve),
            "flops_per_token": fpt,
            "profile": {"name": problems.uncalibrated["step"].timer.profile.name,
                        "source": problems.uncalibrated["step"].timer.profile.source},
            "calibration": cal.as_dict() if cal else None,
            "step_model": cal.describe() if cal else UNCALIBRATED_NOTE}
    rel = reliability({r["key"]: r["measured"]["step_s_rounds"] for r in ok})
    result = {"meta": meta, "plans": plans, "summary": summary, "winner": winner,
              "probes": probes, "reliability": rel}
    result["compute_drift"] = compute_drift(result)
    return result


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    ok = [r for r in result["plans"] if r["measured"]["step_s"]]
    lo, hi = float("inf"), 0.0
    for variant, marker in (("uncalibrated", "o"), ("calibrated", "s"), ("in_sample", "^")):
        pts = [(r["predicted"][variant]["step_s"], r["measured"]["step_s"]) for r in ok
               if variant in r["predicted"]]
        if not pts:
            continue
        xs = [p for p, _ in pts]
        ys = [m["median"] for _, m in pts]
        err = [[m["median"] - m["min"] for _, m in pts], [m["max"] - m["median"] for _, m in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt=marker, capsize=3, label=variant.replace("_", "-"))
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo * 0.9, hi * 1.1], [lo * 0.9, hi * 1.1], "k:", lw=1, label="predicted = measured")
    winner = result.get("winner")
    for r in ok:
        if r["key"] == winner:
            ax.annotate("measured winner", (r["predicted"]["uncalibrated"]["step_s"],
                                            r["measured"]["step_s"]["median"]), fontsize=8)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s), median and range over rounds")
    job = result["meta"]["job"]
    ax.set_title(f"amsp tune: {job['model']}, seq {job['seq_len']}, mb {job['micro_batch_size']}, "
                 f"M {job['micro_batches']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary_lines(result: dict[str, Any]) -> list[str]:
    lines = ["| step model | objective | pick | Spearman rho (per round) | regret (per round) | mean abs error of step |",
             "|---|---|---|---|---|---|"]
    for variant, objs in result["summary"].items():
        for obj, s in objs.items():
            rho_r = ", ".join(_f(x["spearman"], ".2f") for x in s["per_round"])
            reg_r = ", ".join(_pct(x["regret"]) for x in s["per_round"])
            lines.append(f"| {variant.replace('_', '-')} | {obj} | `{s['pick']}` | {_f(s['spearman'], '.2f')} "
                         f"({rho_r}) | {_pct(s['regret'])} ({reg_r}) | {_pct(s['mean_abs_rel_error'])} |")
    return lines


def _drift_lines(drift: dict[str, float] | None) -> list[str]:
    if drift is None:
        return []
    return [f"Compute speed in this run against the calibration's (this run's probe): forward "
            f"{100 * drift['forward']:+.0f} %, backward {100 * drift['backward']:+.0f} %. The "
            f"calibrated predictions assume the calibration's speed; a slower device now makes "
            f"every plan slower than predicted by about that much (the ranking moves less).", ""]


def _reliability_lines(rel: dict[str, Any] | None) -> list[str]:
    if rel is None:
        return []
    return [f"How well this measurement ranks the plans itself: split-half Spearman rho "
            f"{rel['split_half']:.2f} (median over {rel['num_splits']} splits of the "
            f"{rel['num_rounds']} rounds), {rel['full']:.2f} for the medians over all rounds "
            f"(Spearman-Brown); a model that knew the true step times would reach about "
            f"**{rel['ceiling']:.2f}** against this ranking. Read the planner's rho against that "
            f"ceiling; more rounds raise it.", ""]


def _table_lines(result: dict[str, Any]) -> list[str]:
    variants = [v for v in ("uncalibrated", "calibrated", "in_sample")
                if any(v in r["predicted"] for r in result["plans"])]
    head = "| plan | measured step (s): median [min-max] | " + " | ".join(
        f"predicted ({v.replace('_', '-')})" for v in variants) + (" | MFU | states MiB meas / pred | "
                                                                    "peak MiB meas / pred | other CPU (cores) per round |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = sorted(result["plans"], key=lambda r: (r["measured"]["step_s"] or {}).get("median", 1e9))
    for r in rows:
        m = r["measured"]
        st = m["step_s"]
        meas = f"**{st['median']:.3f}** [{st['min']:.3f}-{st['max']:.3f}]" if st else "failed"
        preds = " | ".join(_f(r["predicted"][v]["step_s"]) if v in r["predicted"] else "-" for v in variants)
        p0 = r["predicted"]["uncalibrated"]
        lines.append(f"| {r['label']} | {meas} | {preds} | {_pct(m.get('mfu'))} | "
                     f"{_mib(m['model_state_bytes'])} / {_mib(p0['model_state_bytes'])} | "
                     f"{_mib(m['peak_memory_bytes'])} / {_mib(p0['peak_memory_bytes'])} | "
                     f"{', '.join(f'{c:.2f}' for c in m.get('foreign_cores') or []) or '-'} |")
    return lines


def _kind_lines(result: dict[str, Any]) -> list[str]:
    variant = next(v for v in ("calibrated", "in_sample", "uncalibrated")
                   if all(v in r["predicted"] for r in result["plans"]))
    head = "| plan | " + " | ".join(f"{k} busy / exposed (s)" for k in KINDS) + " | all exposed (s) |"
    lines = [f"Per collective kind, one step, measured / `{variant.replace('_', '-')}` model: *busy* "
             f"is the wall time with one of the kind in flight (the model: its collectives' "
             f"time), *exposed* the time the compute thread waited for them (the model: what "
             f"the kind adds to the step). Last column: all waits, and the model's exposed "
             f"communication.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["plans"]:
        m, p = r["measured"]["comm"], r["predicted"][variant]
        cells = [f"{_f(m[k]['busy_s'], '.2f')} / {_f(p['busy_s'][k], '.2f')} · "
                 f"{_f(m[k]['exposed_s'], '.2f')} / {_f(p['exposed_s'][k], '.2f')}" for k in KINDS]
        blocked = sum((m[k]["exposed_s"] or 0.0) for k in (*KINDS, "other"))
        lines.append(f"| {r['label']} | " + " | ".join(cells)
                     + f" | {_f(blocked)} / {_f(p['exposed_comm_s'])} |")
    return lines


def write_report(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    _plot(result, out_dir / "predicted_vs_measured.png")
    meta, spec = result["meta"], result["meta"]["job"]
    win = next((r for r in result["plans"] if r["key"] == result["winner"]), None)
    lines = [
        f"# amsp tune: {spec['model']} on {meta['world']['num_nodes']} x "
        f"{meta['world']['gpus_per_node']} ({meta['backend']}), {meta['date']}", "",
        f"Command: `{meta['command']}`", "",
        f"Job: seq {spec['seq_len']}, micro-batch {spec['micro_batch_size']}, M "
        f"{spec['micro_batches']}, {spec['precision']}, granularity {spec['granularity']}, "
        f"bucket {spec['bucket_bytes'] / 2**20:g} MiB{', recompute' if spec['recompute'] else ''}; "
        f"memory limit {meta['gpu_memory_bytes'] / 2**20:.1f} MiB per GPU less "
        f"{spec['memory_reserve_bytes'] / 2**20:.1f} MiB. {spec['steps']} timed steps after "
        f"{spec['warmup_steps']} warm-up, {spec['repeats']} rounds in alternated order.", "",
        f"Profile: `{meta['profile']['source']}`. Link: {meta.get('cluster_link') or 'n/a'}.", "",
        f"Step model: {meta['step_model']}.", "",
        *_drift_lines(result.get("compute_drift")),
        f"MFU peak: {meta['peak']['peak_flops_per_gpu'] / 1e9:.2f} GFLOP/s per GPU "
        f"({meta['peak']['peak_flops_source']}). Load averages (1/5/15 min): start "
        f"{meta['load']['start']}, end {meta['load']['end']}. Wall time {meta.get('wall_s', 0):.0f} s.", "",
        "## Measured winner", "",
        (f"`{win['key']}` ({win['label']}): {win['measured']['step_s']['median']:.3f} s/step "
         f"(range over rounds {win['measured']['step_s']['min']:.3f}-{win['measured']['step_s']['max']:.3f}), "
         f"{win['measured']['tokens_per_gpu_per_s']:.0f} tokens/GPU/s, MFU {_pct(win['measured']['mfu'])}."
         if win else "no plan ran"), "",
        "## Planner vs measured", "",
        *_summary_lines(result), "",
        "Regret = measured step of the planner's pick / best measured step - 1. Spearman over the "
        "plans' predicted and measured step times (comm objective: its communication time). "
        "Figures in parentheses: each round alone. *Other CPU*: cores kept busy by anything but "
        "this run's ranks while a plan ran (other jobs, and the kernel's network processing): "
        "timings with a high figure are suspect.", "",
        *_reliability_lines(result.get("reliability")),
        "![predicted vs measured](predicted_vs_measured.png)", "",
        *_table_lines(result), "",
        *_kind_lines(result), "",
    ]
    if meta.get("calibration_written"):
        cw = meta["calibration_written"]
        lines += ["## Calibration", "", f"Written to `{cw['path']}`: {cw['describe']}.", "",
                  "Fit: " + json.dumps(cw.get("fit", {}), default=str), ""]
    path = out_dir / "tune.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def print_winner(result: dict[str, Any], out: TextIO) -> None:
    key = result.get("winner")
    if key is None:
        print("amsp tune: no plan ran", file=out)
        return
    row = next(r for r in result["plans"] if r["key"] == key)
    st = row["measured"]["step_s"]
    print(f"measured winner: {row['label']}: {st['median']:.3f} s/step "
          f"(rounds {st['min']:.3f}-{st['max']:.3f})", file=out)
    print(f"  amsp train --plan {key}", file=out)
    print(f'  ds_config: "amsp": {{"enabled": true, "plan": "{key}"}}', file=out)
