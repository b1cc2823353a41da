"""Adaptive AMSP on the lab (issue 14's acceptance benchmark): the link drops mid-run.

    # four cases, each its own job on the `amsp cluster up` lab (brought up here when it is not up)
    python comparisons/adaptive_bench.py run --cases a,b,c,d --model small-llama \\
        --profile P.calibrated.json --high-plan ddp --low-plan mics:2 \\
        --high-rate 1gbit --low-rate 100mbit --drop-at 30 --steps 100 --out-dir DIR
    # the report of a finished DIR (its a.json ... d.json)
    python comparisons/adaptive_bench.py report --dir DIR -o comparisons/results/adaptive_<model>_cpu-2x2-lab_<date>

Cases, each a ``python -m amsp_ext.train.loop`` job under ``amsp cluster run`` (one torchrun per lab
node) with the same model, batch shape, seed and profile:

* ``a`` (adaptive, drop): ``--adaptive``, starts on ``--high-plan`` (the plan ``amsp tune``
  measured best at ``--high-rate``) at ``--high-rate``; after rank 0 has logged step
  ``--drop-at``, this script runs ``amsp cluster set --inter-node-bandwidth <low-rate>``;
  ``--steps`` in all.
* ``b`` (static, drop): the same without ``--adaptive``.
* ``c`` (low best): ``--low-plan`` (the plan ``amsp tune`` measured best at ``--low-rate``) from
  the start, at ``--low-rate``, no ``--adaptive``; ``--low-steps`` steps.
* ``d`` (steady): ``--adaptive`` on ``--high-plan`` at ``--high-rate`` for ``--steady-steps``
  steps, the link never changes: every decision it logs is a false alarm.

[Note: when the link drops]
The drop is triggered by step, not by time: the driver reads rank 0's log as it streams and
starts ``amsp cluster set`` (in a thread, so the log keeps being time-stamped) right after the
line of step ``--drop-at``. The command takes a moment (a Python start-up and two ``tc``
calls), so the report names the last step whose line had arrived when it returned: every step
after that one ran entirely on the low rate.

[Note: what is timed]
Two figures per step: ``step_time_s`` from the job's JSON summary (rank 0's clock from the
step's first forward to the loss all-reduce; an adaptive run's monitor all-reduce and a
switch happen after it and are not in it), and the wall interval between two consecutive
rank-0 step lines as this driver received them (everything, the monitor and a switch
included). Throughput figures are medians over a stated window of steps. The load average is
sampled every 2 s while a case runs.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AMSP = [sys.executable, "-m", "amsp_ext.cli"]
STEP_RE = re.compile(r"^\[node0 rank0\]:step\s+(\d+)\s")
DECISION_RE = re.compile(r"^\[node0 rank0\]:(adaptive step \d+: .*)$")
CASES = {"a": "adaptive, link drops", "b": "static, link drops", "c": "low-rate best plan from the start",
         "d": "adaptive, steady link"}


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _show(argv: list[str]) -> str:
    return shlex.join(["amsp", *argv[3:]] if argv[:3] == AMSP else argv)


def _amsp(*args: str) -> str:
    argv = [*AMSP, *args]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{_show(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _lab_state(name: str) -> dict | None:
    from amsp_ext.cluster import netns

    s = netns.load_state(name)
    return s if s and s.get("status") == "up" else None


class LoadSampler(threading.Thread):
    def __init__(self, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples, self.stop = every_s, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(_loadavg()[0])
            self.stop.wait(self.every_s)


def train_argv(a: argparse.Namespace, *, plan: str, steps: int, adaptive: bool, result: Path) -> list[str]:
    argv = ["cluster", "run", "--name", a.lab_name, "--timeout", str(a.timeout), "--",
            "-m", "amsp_ext.train.loop", "--model", a.model, "--plan", plan, "--profile", a.profile,
            "--objective", a.objective, "--seq-len", str(a.seq_len),
            "--micro-batch-size", str(a.micro_batch_size), "--micro-batches", str(a.micro_batches),
            "--granularity", a.granularity, "--memory-reserve", "0B", "--steps", str(steps),
            "--seed", "0", "--result-file", str(result)]
    if adaptive:
        argv += ["--adaptive", *a.adaptive_flags.split()]
    return [*AMSP, *argv]


def run_case(a: argparse.Namespace, case: str, out_dir: Path) -> dict:
    drop_at = a.drop_at if case in ("a", "b") else None
    plan = a.low_plan if case == "c" else a.high_plan
    steps = {"a": a.steps, "b": a.steps, "c": a.low_steps, "d": a.steady_steps}[case]
    start_rate = a.low_rate if case == "c" else a.high_rate
    set_start = ["cluster", "set", "--name", a.lab_name, "--inter-node-bandwidth", start_rate]
    _amsp(*set_start)
    result = out_dir / f"{case}.result.json"
    result.unlink(missing_ok=True)
    argv = train_argv(a, plan=plan, steps=steps, adaptive=case in ("a", "d"), result=result)
    set_low = ["cluster", "set", "--name", a.lab_name, "--inter-node-bandwidth", a.low_rate]
    print(f"[{case}] {CASES[case]}: {_show(argv)}", file=sys.stderr, flush=True)

    step_seen: dict[int, float] = {}
    decisions: list[str] = []
    drop: dict = {}
    lines: list[str] = []
    sampler = LoadSampler()
    load_start = _loadavg()
    sampler.start()
    t_start = time.monotonic()

    def do_drop(after_step: int) -> None:
        t = time.monotonic()
        _amsp(*set_low)
        drop.update(after_step_line=after_step, command=_show([*AMSP, *set_low]),
                    started_s=t - t_start, returned_s=time.monotonic() - t_start,
                    last_step_before_return=max(step_seen))

    dropper = None
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    try:
        for line in proc.stdout:
            now = time.monotonic() - t_start
            lines.append(f"{now:9.3f} {line.rstrip()}")
            m = STEP_RE.match(line)
            if m:
                k = int(m.group(1))
                step_seen[k] = now
                if drop_at is not None and k == drop_at and dropper is None:
                    dropper = threading.Thread(target=do_drop, args=(k,), daemon=True)
                    dropper.start()
            m = DECISION_RE.match(line.rstrip())
            if m:
                decisions.append(m.group(1))
                print(f"[{case}] {m.group(1)}", file=sys.stderr, flush=True)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        if dropper is not None:
            dropper.join(timeout=60)
        sampler.stop.set()
        sampler.join()
    wall = time.monotonic() - t_start
    (out_dir / f"{case}.log").write_text("\n".join(lines) + "\n")
    if rc != 0 or not result.exists():
        raise SystemExit(f"[{case}] the job failed ({rc}); log: {out_dir / f'{case}.log'}")
    summary = json.loads(result.read_text())
    order = sorted(step_seen)
    wall_step = {k: step_seen[k] - step_seen[j] for j, k in zip(order, order[1:])}
    return {
        "case": case, "what": CASES[case], "command": _show(argv), "start_rate": start_rate,
        "set_before": _show([*AMSP, *set_start]), "plan": plan, "steps": steps, "drop_at": drop_at,
        "drop": drop or None, "decision_lines": decisions, "wall_s": wall,
        "load": {"start": load_start, "end": _loadavg(), "samples_1min": sampler.samples},
        "step_time_s": summary["step_time_s"], "step_wall_s": {str(k): v for k, v in wall_step.items()},
        "switches": summary["switches"], "adaptive_decisions": summary["adaptive_decisions"],
        "adaptive_ratios": summary.get("adaptive_ratios"),
        "final_plan": summary["plan_str"], "loss": summary["loss"],
        "tokens_per_rank_step": summary["micro_batches"] * summary["micro_batch_size"] * summary["seq_len"],
    }


def cmd_run(a: argparse.Namespace) -> int:
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: {', '.join(bad)} unknown (allowed: {', '.join(CASES)})")
    made = False
    try:
        if _lab_state(a.lab_name) is None:
            _amsp("cluster", "up", "--config", "configs/clusters/lab-2x2.yaml", "--name", a.lab_name,
                  "--subnet", a.subnet, "--inter-node-bandwidth", a.high_rate)
            made = True
        for case in cases:
            r = run_case(a, case, out_dir)
            r["bench_args"] = {k: v for k, v in vars(a).items() if k != "func"}
            (out_dir / f"{case}.json").write_text(json.dumps(r, indent=1) + "\n")
            print(f"[{case}] done in {r['wall_s']:.0f}s; switches {len(r['switches'])}; final plan "
                  f"{r['final_plan']}", file=sys.stderr, flush=True)
    finally:
        if _lab_state(a.lab_name) is not None:
            _amsp("cluster", "set", "--name", a.lab_name, "--inter-node-bandwidth", a.high_rate)
            if made or a.down:
                _amsp("cluster", "down", "--name", a.lab_name)
    return 0


# -- report ---------------------------------------------------------------------------------------
def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def window(r: dict, first: int, last: int | None = None) -> dict:
    """Median step time (summary and wall) over steps [first, last) of case ``r``."""
    st = r["step_time_s"]
    last = len(st) if last is None else last
    ks = range(first, last)
    wall = [r["step_wall_s"][str(k)] for k in ks if str(k) in r["step_wall_s"]]
    med = _med([st[k] for k in ks if k < len(st)])
    return {"steps": [first, last], "n": len(ks), "median_step_s": med, "median_wall_s": _med(wall),
            "tokens_per_rank_per_s": r["tokens_per_rank_step"] / med if med else None}


def ratio_stats(r: dict, first: int = 0, last: int | None = None) -> dict:
    """Per trace kind: the monitor's measured/predicted over steps [first, last): min, median, max."""
    rows = [x for x in r.get("adaptive_ratios") or [] if x["step"] >= first and (last is None or x["step"] < last)]
    kinds = sorted({k for x in rows for k in x if k != "step"})
    return {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}
            for k in kinds for v in [[x[k] for x in rows if k in x]]}


def analyse(runs: dict[str, dict], settle: int) -> dict:
    out: dict = {}
    if "c" in runs:
        out["c"] = window(runs["c"], settle)
    for case in ("a", "b"):
        if case not in runs:
            continue
        r = runs[case]
        low_from = r["drop"]["last_step_before_return"] + 1
        after = [v for k, v in r["step_wall_s"].items() if int(k) > r["drop_at"]]
        o = {"link_low_from_step": low_from, "before_drop": window(r, settle, r["drop_at"] + 1),
             # every step after the drop's, detection, switch and monitor included
             "wall_after_drop_s": sum(after), "steps_after_drop": len(after)}
        if r.get("adaptive_ratios"):
            o["ratios_before_drop"] = ratio_stats(r, 0, r["drop_at"] + 1)
        sw = [d for d in r["adaptive_decisions"] or [] if d["switch"]]
        if case == "a":
            o["decisions"] = len(r["adaptive_decisions"] or [])
            if sw:
                s = sw[0]["step"]
                o["switch_step"] = s
                o["steps_from_low_link_to_switch"] = s - low_from + 1
                o["switch_seconds"] = [x["seconds"] for x in r["switches"]]
                o["after_switch"] = window(r, s + 1 + settle)
                o["ratios_after_switch"] = ratio_stats(r, s + 1)
            o["num_switches"] = len(sw)
        out[case] = o
    if "a" in out and "b" in out and "after_switch" in out["a"]:
        first = out["a"]["after_switch"]["steps"][0]
        out["b"]["same_window_as_a"] = window(runs["b"], first)
    if "d" in runs:
        r = runs["d"]
        out["d"] = {"steps": len(r["step_time_s"]), "decisions": len(r["adaptive_decisions"] or []),
                    "switches": len(r["switches"]), "all": window(r, settle), "ratios": ratio_stats(r)}
    c = out.get("c", {}).get("median_step_s")
    if c:
        if "after_switch" in out.get("a", {}):
            x = out["a"]["after_switch"]
            out["a"]["after_switch_vs_c"] = x["median_step_s"] / c - 1
            if x["median_wall_s"] and out["c"]["median_wall_s"]:
                out["a"]["after_switch_vs_c_wall"] = x["median_wall_s"] / out["c"]["median_wall_s"] - 1
        if "same_window_as_a" in out.get("b", {}):
            x = out["b"]["same_window_as_a"]
            out["b"]["slowdown_vs_c"] = x["median_step_s"] / c - 1
    return out


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _load(r: dict) -> str:
    s = r["load"]["samples_1min"]
    return (f"start {r['load']['start']}, end {r['load']['end']}; 1-min samples every 2 s: "
            f"median {_med(s):.2f}, max {max(s):.2f}" if s else "-")


def markdown(runs: dict[str, dict], res: dict, settle: int) -> str:
    any_r = next(iter(runs.values()))
    ba = any_r["bench_args"]
    lines = [f"# Adaptive AMSP on the 2x2 lab: {ba['model']}, link {ba['high_rate']} -> {ba['low_rate']}", "",
             f"Job: {ba['model']}, seq {ba['seq_len']}, micro-batch {ba['micro_batch_size']}, "
             f"M {ba['micro_batches']}, fp32, granularity {ba['granularity']}, objective {ba['objective']}, "
             f"profile `{ba['profile']}`; adaptive flags `--adaptive {ba['adaptive_flags']}`. "
             f"High-rate plan `{ba['high_plan']}`, low-rate plan `{ba['low_plan']}`. "
             f"Windows skip {settle} step(s) after a start or a switch.", "",
             "| case | what | plan(s) | steps | window | median step (s) | median wall/step (s) | vs (c) |",
             "|---|---|---|---|---|---|---|---|"]
    if "c" in res:
        w = res["c"]
        lines.append(f"| c | {CASES['c']} | `{runs['c']['plan']}` | {len(runs['c']['step_time_s'])} | "
                     f"{w['steps'][0]}..{w['steps'][1] - 1} | {_f(w['median_step_s'])} | {_f(w['median_wall_s'])} | - |")
    if "a" in res:
        o, r = res["a"], runs["a"]
        w = o["before_drop"]
        lines.append(f"| a | before the drop | `{r['plan']}` | | {w['steps'][0]}..{w['steps'][1] - 1} | "
                     f"{_f(w['median_step_s'])} | {_f(w['median_wall_s'])} | |")
        if "after_switch" in o:
            w = o["after_switch"]
            lines.append(f"| a | after the switch | `{r['final_plan']}` | {len(r['step_time_s'])} | "
                         f"{w['steps'][0]}..{w['steps'][1] - 1} | {_f(w['median_step_s'])} | "
                         f"{_f(w['median_wall_s'])} | {_pct(o.get('after_switch_vs_c'))} (wall {_pct(o.get('after_switch_vs_c_wall'))}) |")
    if "b" in res and "same_window_as_a" in res["b"]:
        w = res["b"]["same_window_as_a"]
        lines.append(f"| b | {CASES['b']} (a's after-switch window) | `{runs['b']['plan']}` | "
                     f"{len(runs['b']['step_time_s'])} | {w['steps'][0]}..{w['steps'][1] - 1} | "
                     f"{_f(w['median_step_s'])} | {_f(w['median_wall_s'])} | {_pct(res['b'].get('slowdown_vs_c'))} |")
    if "d" in res:
        w = res["d"]["all"]
        lines.append(f"| d | {CASES['d']} | `{runs['d']['plan']}` | {res['d']['steps']} | "
                     f"{w['steps'][0]}..{w['steps'][1] - 1} | {_f(w['median_step_s'])} | {_f(w['median_wall_s'])} | - |")
    if "a" in res and "b" in res:
        lines += ["", f"Wall time of the {res['a']['steps_after_drop']} steps after the drop step (rank 0's step lines, "
                  f"everything included: the steps before the switch, the switch, the monitor): "
                  f"(a) {res['a']['wall_after_drop_s']:.1f} s, (b) {res['b']['wall_after_drop_s']:.1f} s "
                  f"({res['a']['wall_after_drop_s'] / res['b']['wall_after_drop_s'] - 1:+.1%})."]
    lines += ["", "## Adaptive decisions", ""]
    if "a" in res:
        o = res["a"]
        lines.append(f"(a): link at {ba['low_rate']} from step {o['link_low_from_step']} on (the drop was "
                     f"started after step {runs['a']['drop']['after_step_line']}'s line); "
                     f"{o['decisions']} decision(s), {o['num_switches']} switch(es)"
                     + (f"; first switch at the end of step {o['switch_step']}, "
                        f"{o['steps_from_low_link_to_switch']} steps after the first step on the low link; "
                        f"switch took {', '.join(f'{s:.2f}' for s in o['switch_seconds'])} s" if 'switch_step' in o else "")
                     + ".")
        lines += ["", "```", *runs["a"]["decision_lines"], "```", ""]
    if "d" in res:
        lines.append(f"(d): {res['d']['steps']} steps on a steady {ba['high_rate']} link: "
                     f"{res['d']['decisions']} decision(s), {res['d']['switches']} switch(es).")
        if runs["d"]["decision_lines"]:
            lines += ["", "```", *runs["d"]["decision_lines"], "```"]
        lines.append("")
    rows = [("a", "steps up to the drop", res.get("a", {}).get("ratios_before_drop")),
            ("a", "steps after the switch", res.get("a", {}).get("ratios_after_switch")),
            ("d", "all steps", res.get("d", {}).get("ratios"))]
    rows = [x for x in rows if x[2]]
    if rows:
        lines += ["The monitor's measured/predicted per trace kind (busy seconds per step, mean over ranks; "
                  "band: amsp train's default 0.67..1.5 unless the adaptive flags say otherwise): min / median / max over the steps.", "",
                  "| case | steps | " + " | ".join(("AG", "RS", "AR", "BC")) + " |", "|---|---|---|---|---|---|"]
        for case, what, st in rows:
            cells = [f"{st[k]['min']:.2f} / {st[k]['median']:.2f} / {st[k]['max']:.2f}" if k in st else "-"
                     for k in ("AG", "RS", "AR", "BC")]
            lines.append(f"| {case} | {what} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Commands and load", ""]
    for case in ("a", "b", "c", "d"):
        if case not in runs:
            continue
        r = runs[case]
        lines.append(f"({case}) {r['what']}: `{r['set_before']}` then `{r['command']}`"
                     + (f"; after step {r['drop']['after_step_line']}'s line: `{r['drop']['command']}`" if r["drop"] else "")
                     + f". Wall {r['wall_s']:.0f} s. Load average {_load(r)}.")
        lines.append("")
    return "\n".join(lines)


def summary_table(results: list[tuple[str, dict]]) -> list[str]:
    """One row per run (folder): the acceptance figures side by side."""
    lines = ["| run | switch at step (steps on the slow link) | (a) after the switch vs (c) | "
             "(b) vs (c), same window | (a) vs (b), wall after the drop | (d) decisions / switches |",
             "|---|---|---|---|---|---|"]
    for name, res in results:
        a, b, d = res.get("a", {}), res.get("b", {}), res.get("d", {})
        sw = (f"{a['switch_step']} ({a['steps_from_low_link_to_switch']})" if "switch_step" in a else "no switch")
        ab = (a["wall_after_drop_s"] / b["wall_after_drop_s"] - 1) if a and b else None
        dd = f"{d['decisions']} / {d['switches']} over {d['steps']} steps" if d else "-"
        lines.append(f"| {name} | {sw} | {_pct(a.get('after_switch_vs_c'))} | {_pct(b.get('slowdown_vs_c'))} | "
                     f"{_pct(ab)} | {dd} |")
    return lines


def cmd_report(a: argparse.Namespace) -> int:
    results, mds, dump = [], [], []
    for i, dir_ in enumerate(a.dir, 1):
        d = Path(dir_)
        runs = {c: json.loads((d / f"{c}.json").read_text()) for c in CASES if (d / f"{c}.json").exists()}
        if not runs:
            raise SystemExit(f"{d}: no a.json .. d.json")
        res = analyse(runs, a.settle)
        results.append((f"{i} (`{d.name}`)", res))
        dump.append({"dir": str(d), "analysis": res, "runs": runs})
        mds.append(markdown(runs, res, a.settle))
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dump, indent=1) + "\n")
    if len(mds) == 1:
        md = mds[0]
    else:  # the first run's title, a summary, then each run with its headings one level down
        title, _, _ = mds[0].partition("\n")
        md = "\n".join([title, "", *summary_table(results), ""])
        for (name, _), m in zip(results, mds):
            body = m.partition("\n")[2].replace("\n## ", "\n### ")
            md += f"\n## Run {name}\n{body}\n"
    if a.notes:
        md += "\n" + Path(a.notes).read_text()
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run cases on the lab")
    r.add_argument("--cases", default="a,b,c,d")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--lab-name", default="amspa")
    r.add_argument("--subnet", default="10.90.21.0/24", help="used when this script brings the lab up")
    r.add_argument("--down", action="store_true", help="take the lab down at the end even if it was up")
    r.add_argument("--model", default="small-llama")
    r.add_argument("--profile", required=True, help="the calibrated profile of the high rate (amsp tune --calibrate-out)")
    r.add_argument("--objective", default="step", choices=("comm", "step"))
    r.add_argument("--seq-len", type=int, default=128)
    r.add_argument("--micro-batch-size", type=int, default=4)
    r.add_argument("--micro-batches", type=int, default=1)
    r.add_argument("--granularity", default="layer")
    r.add_argument("--high-plan", required=True)
    r.add_argument("--low-plan", required=True)
    r.add_argument("--high-rate", default="1gbit")
    r.add_argument("--low-rate", default="100mbit")
    r.add_argument("--drop-at", type=int, default=30)
    r.add_argument("--steps", type=int, default=100, help="steps of cases a and b")
    r.add_argument("--low-steps", type=int, default=50, help="steps of case c")
    r.add_argument("--steady-steps", type=int, default=220, help="steps of case d")
    r.add_argument("--adaptive-flags", default="", help="extra --adaptive-* flags for cases a and d")
    r.add_argument("--timeout", type=float, default=1200)
    r.set_defaults(func=cmd_run)
    q = sub.add_parser("report", help="analyse a finished --out-dir")
    q.add_argument("--dir", required=True, action="append",
                   help="a finished --out-dir; several: one section each and a summary table")
    q.add_argument("-o", "--output", required=True, help="path stem: writes STEM.json and STEM.md")
    q.add_argument("--settle", type=int, default=3, help="steps skipped after a start or a switch")
    q.add_argument("--notes", help="a Markdown file appended to the report")
    q.set_defaults(func=cmd_report)
    a = p.parse_args()
    return a.func(a)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
