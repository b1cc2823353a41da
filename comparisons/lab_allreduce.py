"""All-reduce across the lab's rate-limited link vs inside one node (one network namespace).

Reproduces the field-notes figure (1 Gbit/s tbf link, 32 MB all-reduce: 0.43 s across two
namespaces vs 0.097 s inside one, about 4.5x). Needs root and iproute2; it brings up its own lab
(name ``amspb``), runs one torchrun per node through ``amsp cluster run``'s launcher, prints the
table and the ratio, and tears the lab down (also on error or Ctrl-C)::

    sudo -E python comparisons/lab_allreduce.py                      # 2 nodes x 2 ranks, 1gbit, 32 MB
    sudo -E python comparisons/lab_allreduce.py --bandwidth 500mbit --size-mb 64 --json out.json

Three cases, same 32 MB float32 buffer, all groups of a case running at once (as in training):

* ``inside one node``   each node's ranks all-reduce among themselves (loopback only);
* ``across, pairs``     rank i with its peer on the other node (1 x 2 groups, share the link);
* ``across, world``     every rank of every node (the DDP all-reduce).

The "link bound" column is what the shaped link alone allows for a ring all-reduce (every ring
edge carries ``2 (n-1)/n * v``; edges leaving a node share its link), so the measured time can be
read against physics rather than against another run of the same code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(size_mb: float, reps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    from amsp_ext.runtime import collectives as C

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // local
    node_groups = [list(range(n * local, (n + 1) * local)) for n in range(nodes)]
    pair_groups = [[n * local + i for n in range(nodes)] for i in range(local)]
    intra, _ = dist.new_subgroups_by_enumeration(node_groups) if local > 1 else (None, None)
    pairs, _ = dist.new_subgroups_by_enumeration(pair_groups)
    numel = int(size_mb * 1e6) // 4
    buf = torch.ones(numel)
    flag = torch.zeros(1)
    cases = [("across, world", None, world)]
    cases.append(("across, pairs", pairs, nodes))
    if intra is not None:
        cases.insert(0, ("inside one node", intra, local))
    results = {}
    for label, group, n in cases:
        times = []
        for rep in range(warmup + reps):
            C.all_reduce(flag, None, name="world", async_op=False, timeout=300)
            t0 = time.perf_counter()
            C.all_reduce(buf, group, name=f"bench_{label}", async_op=False, timeout=300)
            if rep >= warmup:
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64)
        C.all_reduce(slowest, None, name="world", op=dist.ReduceOp.MAX, async_op=False, timeout=300)
        layout = {"inside one node": node_groups, "across, pairs": pair_groups}.get(label, [list(range(world))])
        results[label] = {"median_s": statistics.median(slowest.tolist()), "group_size": n, "groups": layout}
    if rank == 0:
        print("RESULT " + json.dumps({"results": results, "nodes": nodes, "gpus_per_node": local,
                                      "bytes": numel * 4}), flush=True)
    dist.destroy_process_group()


def link_bound_s(nbytes: int, groups: list[list[int]], gpus_per_node: int, link_bits: int) -> float:
    """Lower bound from the shaped link for a ring all-reduce (gloo's algorithm for large buffers).

    Each ring edge carries 2(n-1)/n * v; an edge between two nodes goes out of the sender node's
    link. All groups run at once, so a node's egress is the sum over its crossing edges.
    """
    egress: dict[int, float] = {}
    for g in groups:
        n = len(g)
        for a, b in zip(g, g[1:] + g[:1]):
            if a // gpus_per_node != b // gpus_per_node:
                egress[a // gpus_per_node] = egress.get(a // gpus_per_node, 0.0) + 2 * (n - 1) / n * nbytes
    return max(egress.values(), default=0.0) / (link_bits / 8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--size-mb", type=float, default=32.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--name", default="amspb", help="lab name (default amspb, so a user's lab is untouched)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.size_mb, args.reps, args.warmup)
        return 0

    import io

    from amsp_ext.cluster import netns
    from amsp_ext.cluster.lab import LabError, LabSpec
    from amsp_ext.cluster.launch import run_on_lab

    try:
        spec = LabSpec(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                       inter_node_bandwidth=args.bandwidth, name=args.name, subnet="10.77.251.0/24")
        netns.up(spec, log=lambda s: print(s, file=sys.stderr))
    except LabError as e:
        print(f"lab_allreduce: error: {e}", file=sys.stderr)
        return 2
    sink = io.StringIO()
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        rc = run_on_lab(spec, [str(Path(__file__).resolve()), "--worker", "--size-mb", str(args.size_mb),
                               "--reps", str(args.reps), "--warmup", str(args.warmup)],
                        state_file=str(netns.state_path(spec.name)), master_port=29561, timeout_s=600,
                        sink=sink)
    finally:
        netns.down(spec.name)
    lines = [l for l in sink.getvalue().splitlines() if "RESULT " in l]
    if rc != 0 or not lines:
        print(sink.getvalue()[-4000:], file=sys.stderr)
        print(f"lab_allreduce: the run failed (exit {rc})", file=sys.stderr)
        return 1
    data = json.loads(lines[0].split("RESULT ", 1)[1])
    res, nbytes, R = data["results"], data["bytes"], data["gpus_per_node"]
    bits = spec.inter_node_bits
    print(f"all-reduce of {nbytes / 1e6:g} MB float32, {spec.num_nodes} nodes x {R} ranks, "
          f"{args.bandwidth} per node link (tbf), median of {args.reps} (slowest rank), gloo")
    print(f"{'case':<18}{'group':>6}{'time (s)':>10}{'algbw (GB/s)':>14}{'link bound (s)':>16}")
    for label, r in res.items():
        n = r["group_size"]
        bound = "-" if label.startswith("inside") else f"{link_bound_s(nbytes, r['groups'], R, bits):.3f}"
        print(f"{label:<18}{n:>6}{r['median_s']:>10.3f}{nbytes / r['median_s'] / 1e9:>14.3f}{bound:>16}")
    if "inside one node" in res:
        ratio = res["across, world"]["median_s"] / res["inside one node"]["median_s"]
        print(f"ratio across (world) / inside one node: {ratio:.1f}x")
        data["ratio_world_over_inside"] = ratio
    if args.json:
        data.update(bandwidth=args.bandwidth, date=datetime.date.today().isoformat())
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
