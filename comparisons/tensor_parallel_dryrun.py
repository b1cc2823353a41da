"""The dry runs of the TP report (issue 38, item 4): one rank of each 2-D job on the fake backend,
engine vs planner memory per category, and TP bytes against the hand count.

    python comparisons/tensor_parallel_dryrun.py RUNS_DIR DEST_PREFIX [--run] [CASE ...]

``--run`` runs the cases whose RUNS_DIR/<case>/dryrun.json is missing (one at a time: a 65B rank
takes minutes of one core); then every case found is written to DEST_PREFIX.json (the dry runs'
own results, each rank's collective lists summed by kind to keep the file small) and the
report's tables are printed as Markdown.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from amsp_ext.tools.dryrun_report import CATS, KINDS, bytes_per_kind, planner_at, tp_bytes_per_phase

# the paper's job, as the TP price report (tensor_parallel_plan_2026-12-04.md) plans it
JOB = ["--gpus-per-node", "8", "--gpu-memory", "80GiB", "--seq-len", "4096", "--micro-batches", "1",
       "--precision", "bf16", "--reduce-dtype", "bf16", "--granularity", "module", "--grad-bucket-bytes", "128MiB",
       "--ranks", "0", "--steps", "2"]
CASES = {
    # name: (model, nodes, T, plan, extra flags); plans are the price report's picks at that T
    "65b_1024_tp8_zero3": ("llama-65b", 128, 8, "zero3", []),
    "65b_1024_tp8_amsp": ("llama-65b", 128, 8, "p=1x2,g=1x2,os=1x128", []),
    "65b_1024_tp2_amsp": ("llama-65b", 128, 2, "p=2x1,g=2x1,os=4x64", ["--recompute"]),
    "65b_1024_tp1_amsp": ("llama-65b", 128, 1, "p=4x1,g=4x1,os=8x128", ["--recompute"]),
    "65b_8192_tp2_amsp": ("llama-65b", 1024, 2, "p=2x1,g=2x1,os=4x64", ["--recompute"]),
    "65b_8192_tp8_zero3": ("llama-65b", 1024, 8, "zero3", []),
    "7b_65536_tp8_amsp": ("llama-7b", 8192, 8, "p=1x2,g=1x2,os=1x2", []),
}


def command(name: str) -> list[str]:
    model, nodes, T, plan, extra = CASES[name]
    return ["amsp", "dryrun", "--model", model, "--nodes", str(nodes), "--tensor-parallel", str(T),
            "--plan", plan, *JOB, *extra]


def planner_now(name: str) -> dict:
    """The planner's numbers for a case by the code as it is now (a run keeps the ones it was
    dry-run with as ``planner_at_run``): the same DryRunSpec the command builds."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.tools.dryrun import DryRunSpec, planner_numbers, resolved

    model, nodes, T, plan, extra = CASES[name]
    engine = EngineConfig(precision="bf16", reduce_dtype="bf16", granularity="module",
                          grad_bucket_bytes=parse_size("128MiB", field="--grad-bucket-bytes"),
                          recompute="--recompute" in extra, tensor_parallel=T)
    spec = DryRunSpec(model=model, num_nodes=nodes, gpus_per_node=8, plan=plan, seq_len=4096, engine=engine,
                      gpu_memory_bytes=parse_size("80GiB", field="--gpu-memory"), ranks=(0,))
    resolved_plan, spec = resolved(spec)
    return planner_numbers(spec, resolved_plan)


def _slim(result: dict) -> dict:
    """A dry run's result with each rank's collective lists summed (kind, group, phase -> bytes)."""
    out = dict(result)
    ranks = []
    for rk in result["ranks"]:
        rk = dict(rk)
        for key in ("collectives", "tp_collectives", "setup_collectives"):
            sums: dict[str, dict] = {}
            for c in rk.get(key, ()):
                k = f"{c['kind']}|{c['group']}|{c['phase']}"
                s = sums.setdefault(k, {"kind": c["kind"], "group": c["group"], "phase": c["phase"],
                                        "count": 0, "bytes": 0})
                s["count"] += 1
                s["bytes"] += c["bytes"]
            rk[key] = list(sums.values())
        rk["amsp_bytes_per_kind"] = bytes_per_kind(result_rank(result, rk["rank"]))
        rk["tp_bytes_per_phase"] = tp_bytes_per_phase(result_rank(result, rk["rank"]))
        ranks.append(rk)
    out["ranks"] = ranks
    return out


def result_rank(result: dict, rank: int) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == rank)


def G(n: float) -> float:
    return n / 2**30


def tables(runs: dict[str, dict]) -> str:
    mem = ["| case | world (TP x data-parallel) | plan | peak engine / planner GiB | peak moment engine / planner | "
           + " | ".join(f"{c} GiB (diff)" for c in CATS) + " | start-up engine / planner GiB | rank wall |",
           "|" + "---|" * (7 + len(CATS))]
    comm = ["| case | " + " | ".join(f"{k} MiB engine / planner" for k in KINDS)
            + " | TP forward MiB engine / hand | TP backward MiB engine / hand | TP per layer per pass, engine / hand |",
            "|" + "---|" * (4 + len(KINDS))]
    for name, r in runs.items():
        rk = r["ranks"][0]
        at, T = planner_at(r, rk), r["planner"]["tensor_parallel"]["degree"]
        cells = []
        for c in CATS:
            e, p = rk["memory"][c], at[c]
            diff = f"{100 * (e - p) / p:+.1f}%" if p else "n/a"
            cells.append(f"{G(e):.2f} / {G(p):.2f} ({diff})")
        mem.append(f"| {name} | {T} x {r['world'] // T} | `{r['plan']}` | {G(rk['peak_bytes']):.2f} / "
                   f"{G(r['planner']['memory']['total']):.2f} | {rk.get('peak_moment')} / "
                   f"{r['planner'].get('peak_moment')} | " + " | ".join(cells)
                   + f" | {G(rk['startup_peak_bytes']):.2f} / {G(r['planner']['memory']['startup']):.2f}"
                   + f" | {rk['seconds']['total']:.0f} s |")
        got, want = rk["amsp_bytes_per_kind"], r["planner"]["bytes"]
        tp, tpw = rk["tp_bytes_per_phase"], r["planner"]["tensor_parallel"]
        layers = r["planner"].get("num_layers")
        per_layer = "—"
        if T > 1 and layers:
            n_ops = sum(c["count"] for c in rk["tp_collectives"] if c["phase"] == "forward")
            per_layer = f"{n_ops / layers:g} x {tpw['activation_allreduce_bytes']:,} B / 2 x {tpw['activation_allreduce_bytes']:,} B"
        comm.append(f"| {name} | " + " | ".join(f"{got[k] / 2**20:,.0f} / {want[k] / 2**20:,.0f}" for k in KINDS)
                    + f" | {tp['forward'] / 2**20:,.0f} / {tpw['step_bytes']['forward'] / 2**20:,.0f}"
                    + f" | {tp['backward'] / 2**20:,.0f} / {tpw['step_bytes']['backward'] / 2**20:,.0f} | {per_layer} |")
    return "\n".join(mem) + "\n\n" + "\n".join(comm)


def main(argv: list[str]) -> int:
    runs_dir, dest = argv[0], argv[1]
    run = "--run" in argv[2:]
    names = [a for a in argv[2:] if not a.startswith("--")] or list(CASES)
    for name in names:
        out = os.path.join(runs_dir, name)
        if run and not os.path.exists(os.path.join(out, "dryrun.json")):
            print(" ".join(command(name)) + f" --out {out}", flush=True)
            subprocess.run([*command(name), "--out", out], check=True)
    runs = {}
    for name in CASES:
        path = os.path.join(runs_dir, name, "dryrun.json")
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            r["command"] = " ".join(command(name))
            r["planner_at_run"], r["planner"] = r["planner"], planner_now(name)
            r["planner"]["num_layers"] = {"llama-65b": 80, "llama-7b": 32}[CASES[name][0]]
            runs[name] = _slim(r)
    with open(f"{dest}.json", "w") as f:
        json.dump({"schema": "amsp-dryrun-tp/1", "measured": "fake-backend dry runs of one rank (memory counted "
                   "by torch's MemTracker, collectives logged), not GPU runs", "runs": runs}, f, indent=1)
    print(tables(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
