"""The planner's hold-out check (issue 10): calibrate the step model on one job shape (scenario
A) with ``amsp tune --calibrate-out``, then run ``amsp tune`` on other shapes and links with the
calibrated profile and compare the planner with the measurements, before and after calibration.

    # a profile measured on another link, with A's calibration copied in
    python comparisons/tune_holdout.py with-calibration --calibration A/calibrated.json \\
        --profile profile-100mbit.json -o profile-100mbit.calibrated.json
    # the summary of several tune runs (each a folder with tune.json); --run NAME=DIR1+DIR2
    # pools the rounds of runs of the same command (same plans, same predictions)
    python comparisons/tune_holdout.py summary --run A=DIR --run B=DIR ... --calibrated-on A \\
        -o comparisons/results/<stem>.md

The commands of every run are read back from its tune.json (``meta.command``). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def with_calibration(calibration: Path, profile: Path, out: Path) -> None:
    """``profile`` (a bandwidth table) with the calibration section of ``calibration``."""
    from amsp_ext.planner.profile import BandwidthProfile

    cal = json.loads(calibration.read_text()).get("calibration")
    if cal is None:
        raise SystemExit(f"{calibration}: no calibration section")
    doc = json.loads(profile.read_text())
    doc["calibration"] = cal
    BandwidthProfile.from_dict(doc, source=str(out))  # validates the result
    out.write_text(json.dumps(doc, indent=1) + "\n")


def repredict(d: dict, profile: str) -> dict:
    """The planner's figures for a finished tune run (its measurements) with another profile,
    uncalibrated: e.g. the profile a user had before measuring one for this job."""
    import dataclasses

    from amsp_ext import schema
    from amsp_ext.tune.analysis import predictions, summarize_variant
    from amsp_ext.tune.candidates import Candidate, make_problems
    from amsp_ext.tune.spec import TuneConfig
    from amsp_ext.planner.plan import parse_plan

    cfg = schema.from_dict(TuneConfig, d["meta"]["config"])
    cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, profile=profile))
    w = d["meta"]["world"]
    probs = make_problems(cfg, num_nodes=w["num_nodes"], gpus_per_node=w["gpus_per_node"],
                          gpu_memory_bytes=d["meta"]["gpu_memory_bytes"],
                          peak_flops=d["meta"]["peak"]["peak_flops_per_gpu"]).uncalibrated
    cands = [Candidate(plan=parse_plan(r["key"]), label=r["label"]) for r in d["plans"]]
    measured = {r["key"]: r["measured"] for r in d["plans"]}
    pred = {c.key: predictions(probs["step"], c) for c in cands}
    return summarize_variant(probs, cands, measured, pred)


def pooled(runs: list[dict]) -> dict:
    """One run made of the rounds of several runs of the same job (same plans and profile, so
    the same predictions and picks): per plan the rounds concatenated, the median over them, and
    Spearman / regret recomputed from those medians."""
    from amsp_ext.tune.analysis import regret, spearman

    first = runs[0]
    keys = [r["key"] for r in first["plans"]]
    for d in runs[1:]:
        if [r["key"] for r in d["plans"]] != keys:
            raise SystemExit("pooled runs must measure the same plans in the same order")
    out = json.loads(json.dumps(first))
    for i, row in enumerate(out["plans"]):
        rounds = [x for d in runs for x in d["plans"][i]["measured"]["step_s_rounds"]]
        row["measured"]["step_s_rounds"] = rounds
        row["measured"]["step_s"] = {"median": statistics.median(rounds), "min": min(rounds),
                                     "max": max(rounds)}
        row["measured"]["foreign_cores"] = [c for d in runs
                                            for c in d["plans"][i]["measured"]["foreign_cores"] or []]
    out["probes"] = [p for d in runs for p in d.get("probes") or []]
    meas = {r["key"]: r["measured"]["step_s"]["median"] for r in out["plans"]}
    out["winner"] = min(meas, key=meas.get)
    for variant, objs in out["summary"].items():
        for obj, s in objs.items():
            source = "in_sample" if variant == "in_sample" else variant
            field = "step_s" if obj == "step" else "comm_total_s"
            pred = {r["key"]: r["predicted"][source][field] for r in out["plans"]}
            s["spearman"] = spearman([pred[k] for k in keys], [meas[k] for k in keys])
            s["regret"] = regret(s["pick"], meas)
            s["per_round"] = [x for d in runs for x in d["summary"][variant][obj]["per_round"]]
            if obj == "step":
                s["mean_abs_rel_error"] = statistics.fmean(
                    abs(pred[k] / meas[k] - 1) for k in keys)
    m = out["meta"]
    m["command"] = " ; ".join(d["meta"]["command"] for d in runs)
    m["wall_s"] = sum(d["meta"].get("wall_s", 0) for d in runs)
    m["load"] = {"start": runs[0]["meta"]["load"]["start"], "end": runs[-1]["meta"]["load"]["end"]}
    return out


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)


def _spread(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    return f"{min(vals):.2f}..{max(vals):.2f}" if min(vals) != max(vals) else f"{vals[0]:.2f}"


def _spread_pct(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    return f"{100 * min(vals):.1f}..{100 * max(vals):.1f}%"


def summary(runs: dict[str, str], calibrated_on: str, out: Path,
            extra_profiles: dict[str, str] | None = None) -> None:
    data = {}
    for name, paths in runs.items():
        loaded = [json.loads((Path(p) / "tune.json").read_text()) for p in str(paths).split("+")]
        data[name] = loaded[0] if len(loaded) == 1 else pooled(loaded)
    for d in data.values():
        for label, prof in (extra_profiles or {}).items():
            d["summary"][f"uncalibrated, profile {label}"] = repredict(d, prof)
    lines = [
        "# amsp tune hold-out: calibrate on scenario " + calibrated_on + ", predict the others", "",
        "Each row is one `amsp tune` run (every plan measured in several rounds of alternated "
        "order; the figure is over the per-round medians, the range is over the rounds alone). "
        "*uncalibrated*: the step model with its defaults (compute at 0.65 of the measured peak, "
        "every overlap perfect, the profile's times); *calibrated*: with the `calibration` "
        f"fitted on scenario {calibrated_on} only; *comm*: the paper's objective (Eq. 1), which "
        "calibration does not change. Regret = measured step of the planner's pick / best "
        "measured step - 1. *Ceiling*: the rho a model that knew the true step times would reach "
        "against this measurement (split-half reliability of the rounds, Spearman-Brown, "
        "attenuation; amsp_ext/tune/analysis.py). *Compute vs calibration*: this run's forward / "
        "backward speed (its probe) against the calibration's; the calibrated predictions "
        "assume the calibration's.", "",
        "| scenario | plans | model | objective | pick | Spearman rho (rounds) | ceiling | "
        "regret (rounds) | mean abs error of step | compute vs calibration | measured winner | "
        "wall | other CPU (cores, median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from amsp_ext.tune.analysis import compute_drift, reliability

    for name, d in data.items():
        rel = reliability({r["key"]: r["measured"]["step_s_rounds"] for r in d["plans"]
                           if r["measured"]["step_s"] is not None})
        ceiling = _f(rel["ceiling"]) if rel else "-"
        drift = compute_drift(d)
        drift = (f"{100 * drift['forward']:+.0f} / {100 * drift['backward']:+.0f} %"
                 if drift else "-")
        winner = d["winner"]
        other = [c for r in d["plans"] for c in (r["measured"].get("foreign_cores") or [])]
        variants = [v for v in d["summary"] if v.startswith("uncalibrated, profile")]
        for variant in (*variants, "uncalibrated", "calibrated", "in_sample"):
            objs = d["summary"].get(variant)
            if not objs:
                continue
            for obj in ("comm", "step"):
                if variant in ("calibrated", "in_sample") and obj == "comm":
                    continue
                s = objs[obj]
                label = {"in_sample": "calibrated (in-sample, fitted here)"}.get(variant, variant)
                lines.append(
                    f"| {name} | {len(d['plans'])} | {label} | {obj} | `{s['pick']}` | "
                    f"{_f(s['spearman'])} ({_spread(x['spearman'] for x in s['per_round'])}) | "
                    f"{ceiling} | {_pct(s['regret'])} ({_spread_pct(x['regret'] for x in s['per_round'])}) | "
                    f"{_pct(s['mean_abs_rel_error'])} | {drift if variant == 'calibrated' else '-'} | "
                    f"`{winner}` | "
                    f"{d['meta'].get('wall_s', 0) / 60:.1f} min | "
                    f"{statistics.median(other) if other else 0:.2f} |")
    lines += ["", "## Commands", ""]
    for name, d in data.items():
        m = d["meta"]
        load = " -> ".join(str([round(x, 1) for x in m["load"][k]]) for k in ("start", "end"))
        link = json.loads(m["cluster_link"]).get("inter") if m.get("cluster_link") else "n/a"
        lines += [f"{name}: `{m['command']}` (load averages {load}; link: {link}; "
                  f"{m.get('wall_s', 0) / 60:.1f} min)", ""]
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("with-calibration")
    w.add_argument("--calibration", type=Path, required=True)
    w.add_argument("--profile", type=Path, required=True)
    w.add_argument("-o", "--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("--run", action="append", required=True, metavar="NAME=DIR")
    s.add_argument("--calibrated-on", default="A")
    s.add_argument("--extra-profile", action="append", default=[], metavar="LABEL=PATH",
                   help="also the uncalibrated planner's figures with this profile")
    s.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "with-calibration":
        with_calibration(a.calibration, a.profile, a.out)
    else:
        runs = dict(r.split("=", 1) for r in a.run)
        extra = dict(e.split("=", 1) for e in a.extra_profile)
        summary(runs, a.calibrated_on, a.out, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
