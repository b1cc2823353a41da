"""All-reduce across the lab's rate-limited link vs inside one node (one network namespace).

Reproduces the field-notes figure (1 Gbit/s tbf link, 32 MB all-reduce: 0.43 s across two
namespaces vs 0.097 s inside one, about 4.5x). Needs root and iproute2; it brings up its own lab
(name ``amspb``), runs one torchrun per node through ``amsp cluster run``'s launcher, prints the
table and the ratio, and tears the lab down (also on error or Ctrl-C)::

    sudo -E python comparisons/lab_allreduce.py                      # 2 nodes x 2 ranks, 1gbit, 32 MB
    sudo -E python comparisons/lab_allreduce.py --bandwidth 500mbit --size-mb 64 --json out.json

Cases, same 32 MB float32 buffer, all groups of a case running at once (as in training):

* ``inside one node``   each node's ranks all-reduce among themselves (loopback only);
* ``across, world``     every rank of every node (the DDP all-reduce);
* ``across, 1xN``       local rank i of every node (R groups share each node's link);
* with ``--nodes-per-leaf K --spine-bandwidth B`` and N = 2K nodes: pairs of nodes under one
  leaf vs pairs across the spine (the paper's leaf placement question)::

    sudo -E python comparisons/lab_allreduce.py --nodes 4 --gpus-per-node 1 \\
        --nodes-per-leaf 2 --spine-bandwidth 500mbit

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
    rank = dist.get_rank()
    comm = C.CollectiveContext(timeout=300)
    cases = json.loads(os.environ["AMSP_BENCH_CASES"])  # label -> list of rank groups
    numel = int(size_mb * 1e6) // 4
    buf = torch.ones(numel)
    flag = torch.zeros(1)
    results = {}
    for label, groups in cases.items():
        if len(groups) == 1 and len(groups[0]) == dist.get_world_size():
            group = None
        else:
            group, _ = dist.new_subgroups_by_enumeration(groups)
        times = []
        for rep in range(warmup + reps):
            C.all_reduce(comm, flag, None, name="world", stream=None, async_op=False)
            t0 = time.perf_counter()
            C.all_reduce(comm, buf, group, name=f"bench_{label}", stream=None, async_op=False)
            if rep >= warmup:
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64)
        C.all_reduce(comm, slowest, None, name="world", stream=None, op=dist.ReduceOp.MAX, async_op=False)
        results[label] = statistics.median(slowest.tolist())
    if rank == 0:
        print("RESULT " + json.dumps({"median_s": results, "bytes": numel * 4}), flush=True)
    dist.destroy_process_group()


def bench_cases(num_nodes: int, gpus_per_node: int, nodes_per_leaf: int | None) -> dict[str, list[list[int]]]:
    """label -> rank groups; every group of a case runs at once."""
    R, N = gpus_per_node, num_nodes
    ranks_of = lambda nodes: [n * R + i for n in nodes for i in range(R)]  # noqa: E731
    out: dict[str, list[list[int]]] = {}
    if R > 1:
        out["inside one node"] = [ranks_of([n]) for n in range(N)]
    out["across, world"] = [list(range(R * N))]
    out[f"across, 1x{N}"] = [[n * R + i for n in range(N)] for i in range(R)]
    K = nodes_per_leaf
    if K is not None and N == 2 * K:  # two leaves: node pairs under one leaf vs across the spine
        if K % 2 == 0:
            out["node pairs, same leaf"] = [ranks_of([n, n + 1]) for n in range(0, N, 2)]
        out["node pairs, across leaves"] = [ranks_of([n, n + K]) for n in range(K)]
    return out


def link_bound_s(nbytes: int, groups: list[list[int]], gpus_per_node: int, link_bits: int,
                 nodes_per_leaf: int | None = None, spine_bits: int | None = None) -> float:
    """Lower bound from the shaped links for a ring all-reduce (gloo's algorithm for large buffers).

    Each ring edge carries 2(n-1)/n * v; an edge between two nodes leaves through the sender
    node's link, and through its leaf's spine uplink when the nodes sit under different leaves.
    All groups run at once, so a link's load is the sum over the edges that cross it.
    """
    node_out: dict[int, float] = {}
    leaf_out: dict[int, float] = {}
    for g in groups:
        n = len(g)
        for a, b in zip(g, g[1:] + g[:1]):
            na, nb = a // gpus_per_node, b // gpus_per_node
            if na == nb:
                continue
            load = 2 * (n - 1) / n * nbytes
            node_out[na] = node_out.get(na, 0.0) + load
            if nodes_per_leaf is not None and na // nodes_per_leaf != nb // nodes_per_leaf:
                leaf_out[na // nodes_per_leaf] = leaf_out.get(na // nodes_per_leaf, 0.0) + load
    t = max(node_out.values(), default=0.0) / (link_bits / 8)
    if spine_bits and leaf_out:
        t = max(t, max(leaf_out.values()) / (spine_bits / 8))
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--size-mb", type=float, default=32.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nodes-per-leaf", type=int, default=None, help="leaf switches (with --spine-bandwidth)")
    p.add_argument("--spine-bandwidth", default=None, help="each leaf's uplink, e.g. 500mbit")
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
                       inter_node_bandwidth=args.bandwidth, name=args.name, subnet="10.77.251.0/24",
                       nodes_per_leaf=args.nodes_per_leaf, spine_bandwidth=args.spine_bandwidth)
        netns.up(spec, log=lambda s: print(s, file=sys.stderr))
    except LabError as e:
        print(f"lab_allreduce: error: {e}", file=sys.stderr)
        return 2
    sink = io.StringIO()
    cases = bench_cases(spec.num_nodes, spec.gpus_per_node, spec.nodes_per_leaf)
    try:
        os.environ["AMSP_BENCH_CASES"] = json.dumps(cases)
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
    med, nbytes, R = data["median_s"], data["bytes"], spec.gpus_per_node
    link = f"{args.bandwidth} per node link (tbf)"
    if spec.nodes_per_leaf is not None:
        link += f", {spec.nodes_per_leaf} node(s) per leaf, {spec.spine_bandwidth} spine uplinks"
    print(f"all-reduce of {nbytes / 1e6:g} MB float32, {spec.num_nodes} nodes x {R} ranks, {link}; "
          f"median of {args.reps} (slowest rank), gloo, all groups of a case at once")
    print(f"{'case':<28}{'groups':>7}{'size':>5}{'time (s)':>10}{'algbw (GB/s)':>14}{'link bound (s)':>16}")
    rows = {}
    for label, groups in cases.items():
        bound = link_bound_s(nbytes, groups, R, spec.inter_node_bits, spec.nodes_per_leaf, spec.spine_bits)
        t = med[label]
        rows[label] = {"median_s": t, "groups": groups, "link_bound_s": bound}
        print(f"{label:<28}{len(groups):>7}{len(groups[0]):>5}{t:>10.3f}{nbytes / t / 1e9:>14.3f}"
              f"{(f'{bound:.3f}' if bound else '-'):>16}")
    data = {"cases": rows, "bytes": nbytes, "nodes": spec.num_nodes, "gpus_per_node": R,
            "link": spec.as_dict()}
    if "inside one node" in med:
        ratio = med["across, world"] / med["inside one node"]
        print(f"ratio across (world) / inside one node: {ratio:.1f}x")
        data["ratio_world_over_inside"] = ratio
    if "node pairs, same leaf" in med:
        ratio = med["node pairs, across leaves"] / med["node pairs, same leaf"]
        print(f"ratio node pairs across leaves / same leaf: {ratio:.1f}x")
        data["ratio_across_over_same_leaf"] = ratio
    if args.json:
        data.update(bandwidth=args.bandwidth, date=datetime.date.today().isoformat())
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
