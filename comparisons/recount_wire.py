"""Recount the gradient bytes of committed campaigns from their kept rank-0 traces with the current
reading of a trace (amsp_ext/compare/breakdown.py [Note: match by numel across process groups]).

    python comparisons/recount_wire.py OUT.json ROWS NAME=RUNS_DIR [NAME=RUNS_DIR ...]

ROWS: comma-separated row keys to recount (e.g. ddp,amsp-plan). NAME: the committed campaign's
folder under comparisons/results. RUNS_DIR: its compare output's ``runs/`` folder
(``round<k>/<row>/trace-rank0.json``; not committed, 16 MB a trace). Per campaign, round and
row: the gradient bytes and bytes per op of every profiled step after the first, as the harness
reads a step, and the figure the committed results.json holds for rank 0 of that round. Only
rank 0 kept its trace: the other ranks' readings cannot be redone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from amsp_ext.compare.breakdown import STEP_LABEL, step_breakdown  # noqa: E402


def trace_events(path: Path) -> list:
    """A Chrome trace's complete events as torch's FunctionEvent shows them to breakdown.py:
    ``input_shapes`` empty for a tensor list (the profiler's in-process view), the list's shape in
    ``structured_input_shapes``, ``cpu_parent`` from nesting on each thread."""
    events = []
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args", {})
        dims = args.get("Input Dims") or []
        start = float(e["ts"])
        events.append(SimpleNamespace(
            name=e["name"], thread=e.get("tid"), cpu_parent=None,
            time_range=SimpleNamespace(start=start, end=start + float(e["dur"])),
            input_shapes=[d if all(not isinstance(x, list) for x in d) else [] for d in dims],
            structured_input_shapes=dims, input_dtypes=args.get("Input type")))
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list = []
        for e in evs:
            while stack and stack[-1].time_range.end < e.time_range.end:
                stack.pop()
            e.cpu_parent = stack[-1] if stack else None
            stack.append(e)
    return events


def recount(runs: Path, committed: dict, keys: list[str]) -> dict:
    out: dict = {}
    for trace in sorted(runs.glob("round*/*/trace-rank0.json")):
        rnd, row = trace.parent.parent.name, trace.parent.name
        if row not in keys:
            continue
        events = trace_events(trace)
        steps = sum(1 for e in events if e.name == STEP_LABEL)
        wires = [step_breakdown(events, i)["wire"] for i in range(1, steps)]
        k = int(rnd.removeprefix("round"))
        rounds = (committed.get(row) or {}).get("rounds") or []
        old = next((r.get("wire") or {} for r in rounds if r.get("round") == k), {})
        out.setdefault(row, {})[rnd] = {
            "grad_bytes_per_step": [w["grad_bytes_per_step"] for w in wires],
            "bytes_per_step": [w["bytes_per_step"] for w in wires],
            "committed_rank0": old.get("grad_bytes_per_step"),
            "committed_ranks": old.get("grad_bytes_per_step_ranks")}
    return out


def main(argv: list[str]) -> None:
    out, keys, pairs = Path(argv[0]), argv[1].split(","), [a.split("=", 1) for a in argv[2:]]
    result = {}
    for name, runs in pairs:
        runs = Path(runs)
        committed = ROOT / "comparisons" / "results" / name / "results.json"
        rows = {r["key"]: r for r in json.loads(committed.read_text())["rows"]}
        result[name] = recount(runs, rows, keys)
        print(name, {row: [v["grad_bytes_per_step"] for v in rnds.values()] for row, rnds in result[name].items()})
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
