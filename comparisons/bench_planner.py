"""Time ``amsp plan`` at 1,024 GPUs (128 x 8) and 65,536 GPUs (8192 x 8).

    python comparisons/bench_planner.py [--repeat 5] [--json]

Targets (issue 2): under 1 s at 1,024 GPUs and under 5 s at 65,536 GPUs on a 2-core machine.
Each case is timed end to end as a fresh ``python -m amsp_ext.cli plan`` process (interpreter
start-up and imports included: what a user waits for) and the search alone in-process.
paper-a800 covers 1..128 nodes, so the 65,536-GPU case estimates the larger meshes with the
alpha-beta fit (--missing-mesh fit); its global batch is one 4096-token sequence per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "1024 GPUs (128x8), llama-7b": [
        "--model", "llama-7b", "--nodes", "128", "--gpus-per-node", "8",
        "--global-batch-tokens", "4194304"],
    "65536 GPUs (8192x8), llama-65b": [
        "--model", "llama-65b", "--nodes", "8192", "--gpus-per-node", "8",
        "--global-batch-tokens", str(65536 * 4096), "--missing-mesh", "fit", "--recompute"],
}
COMMON = ["--gpu-memory", "80GiB", "--profile", "paper-a800", "--seq-len", "4096",
          "--micro-batch-size", "1", "--json"]
VARIANTS = {"comm": [], "step": ["--objective", "step"],
            "comm+pareto+sensitivity": ["--pareto", "--sensitivity", "0.2"]}


def time_cli(argv: list[str], repeat: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "amsp_ext.cli", "plan", *argv], env=env,
                             capture_output=True, text=True, check=True).stdout
        times.append(time.perf_counter() - t0)
        json.loads(out)
    return times


def time_search(argv: list[str], repeat: int) -> tuple[list[float], str]:
    sys.path.insert(0, str(ROOT))
    from amsp_ext.cli.main import build_parser
    from amsp_ext.planner.search import make_problem, search
    from amsp_ext.planner.specs import ClusterSpec, paper_job, parse_size

    a = build_parser().parse_args(["plan", *argv])
    cluster = ClusterSpec(num_nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                          gpu_memory_bytes=parse_size(a.gpu_memory))
    training = paper_job(seq_len=a.seq_len, global_batch_tokens=a.global_batch_tokens,
                         recompute=a.recompute)
    times, plan = [], ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = search(make_problem(a.model, cluster, training, a.profile,
                                  objective=a.objective, missing=a.missing_mesh))
        times.append(time.perf_counter() - t0)
        plan = str(res.best.plan)
    return times, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for case, argv in CASES.items():
        for variant, extra in VARIANTS.items():
            full = argv + COMMON + extra
            cli = time_cli(full, args.repeat)
            search_t, plan = time_search(full, args.repeat)
            rows.append({"case": case, "variant": variant, "plan": plan,
                         "cli_median_s": statistics.median(cli), "cli_min_s": min(cli),
                         "search_median_s": statistics.median(search_t)})
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "load": os.getloadavg(), "rows": rows}))
        return
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} (timings are noisy "
          f"when the machine is shared)")
    print(f"{'case':<32}{'variant':<26}{'cli median':>11}{'cli min':>9}{'search':>9}  plan")
    for r in rows:
        print(f"{r['case']:<32}{r['variant']:<26}{r['cli_median_s']:>10.3f}s"
              f"{r['cli_min_s']:>8.3f}s{r['search_median_s']:>8.3f}s  {r['plan']}")


if __name__ == "__main__":
    main()
