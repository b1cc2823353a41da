"""Build ``paper-a800.json``: an approximation of the AMSP paper's testbed as a bandwidth table.

    python -m amsp_ext.planner.profiles.build_paper_a800          # rewrites paper-a800.json

The paper (arXiv 2311.00257) trains on 128 nodes x 8 A800-80GB, NVLink inside a node and four
Mellanox HDR InfiniBand NICs per node without SHARP. It reports a few bandwidths (Fig. 3) but
not a full table, so this script fills one from a small hierarchical alpha-beta model whose free
constants are fitted to what the paper states. Every constant below says where it comes from;
the same text goes into the JSON's ``metadata.notes``.

[Note: the model]
A collective over a ``p0 x p1`` mesh (p = p0 * p1 GPUs) takes

    t = a + steps * h + traffic * v / B

* ``a``: fixed cost of one collective (launch + synchronisation).
* ``h``: latency of one pipeline/ring step; ``steps`` is p - 1 for a ring (allgather,
  reducescatter, broadcast's pipeline fill), 2(p - 1) for a ring allreduce, and
  2(ceil(log2 p1) + p0 - 1) for NCCL's tree allreduce across nodes (NCCL picks the faster).
* ``B``: the bottleneck bandwidth: one GPU's NVLink for p1 = 1; the node's InfiniBand for p1 > 1
  (a ring crosses each node boundary once per pass, and every byte crosses it).
* ``traffic``: bytes through the bottleneck per byte of ``v``: (p-1)/p for allgather (v = output)
  and reducescatter (v = input), 2(p-1)/p for ring allreduce, 2 for tree allreduce, 1 for
  broadcast.

The table describes ONE group alone, which may drive all of its node's NICs (NCCL spreads a
communicator's channels over every NIC, via PXN where needed), so it is declared
``"concurrency": "single_group"`` and the planner multiplies cross-node times by R/p0, the number
of groups of that shape that share a node's links during training.

Pure Python.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

GB = 1e9
OUT = Path(__file__).with_name("paper-a800.json")

NODES, GPUS_PER_NODE = 128, 8
SIZES = [2**k for k in range(20, 31)]  # 1 MiB .. 1 GiB, the paper's range (Sec. IV-A, Fig. 3)
P0S = [1, 2, 4, 8]
P1S = [2**k for k in range(0, 8)]  # 1 .. 128 nodes: every mesh the planner can query

# Stated by the paper.
IB_NODE_BPS = 4 * 200e9 / 8  # 4 x HDR (200 Gb/s each) per node, per direction: 100 GB/s
ANCHOR_BYTES = 64 * 2**20  # Fig. 3: allgather of 64 MB ...
ANCHOR_8x1_BPS = 1200e9 / 8  # ... about 1200 Gb/s on 8 GPUs (one node)
ANCHOR_8x64_BPS = 300e9 / 8  # ... about 300 Gb/s on 512 GPUs (64 nodes)
NVLINK_SPEC_BPS = 600e9 / 2  # NVLink 600 GB/s bidirectional: the ceiling, 300 GB/s per direction

# Assumed (not in the paper): NCCL's fixed cost per collective, about its small-message latency.
FIXED_S = 10e-6


def _fit_constants() -> tuple[float, float]:
    """Step latency from the 512-GPU anchor, then NVLink's effective bandwidth from the 8-GPU one."""
    v = ANCHOR_BYTES
    p = 8 * 64
    t_inter = v / ANCHOR_8x64_BPS
    step = (t_inter - FIXED_S - (p - 1) / p * v / IB_NODE_BPS) / (p - 1)
    t_intra = v / ANCHOR_8x1_BPS
    nvlink = (7 / 8) * v / (t_intra - FIXED_S - 7 * step)
    assert step > 0 and 0 < nvlink <= NVLINK_SPEC_BPS, (step, nvlink)
    return step, nvlink


STEP_S, NVLINK_BPS = _fit_constants()


def collective_time(op: str, v: int, p0: int, p1: int) -> float:
    p = p0 * p1
    bw = NVLINK_BPS if p1 == 1 else min(NVLINK_BPS, IB_NODE_BPS)
    if op in ("allgather", "reducescatter"):
        return FIXED_S + (p - 1) * STEP_S + (p - 1) / p * v / bw
    if op == "broadcast":
        return FIXED_S + (p - 1) * STEP_S + v / bw
    if op == "allreduce":
        ring = FIXED_S + 2 * (p - 1) * STEP_S + 2 * (p - 1) / p * v / bw
        if p1 == 1:
            return ring
        tree = FIXED_S + 2 * (math.ceil(math.log2(p1)) + p0 - 1) * STEP_S + 2 * v / bw
        return min(ring, tree)
    raise ValueError(op)


NOTES = f"""\
Derived, not measured: approximates the AMSP paper's testbed (arXiv 2311.00257, Sec. VI: 128
nodes x 8 A800-80GB, NVLink, 4 x Mellanox HDR InfiniBand per node, no SHARP) with the
hierarchical alpha-beta model of amsp_ext/planner/profiles/build_paper_a800.py:
t = a + steps*h + traffic*v/B. Sources of each constant:
(1) B inter-node = 100 GB/s per node per direction: 4 HDR NICs x 200 Gb/s (paper, Sec. VI).
(2) h = {STEP_S * 1e6:.3f} us per ring step: fitted so that allgather of 64 MiB on 8x64 GPUs gives
300 Gb/s (paper, Fig. 3 / Sec. III-A: 'about 300 Gb/s on 512 GPUs').
(3) B intra-node = {NVLINK_BPS / GB:.1f} GB/s per GPU: fitted so that allgather of 64 MiB on 8x1
gives 1200 Gb/s (paper, Fig. 3). The paper's NVLink figure, 600 GB/s bidirectional
(300 GB/s per direction), is the ceiling; the fit lands at {NVLINK_BPS / NVLINK_SPEC_BPS:.0%} of it.
(4) a = 10 us per collective: assumed (NCCL small-message latency order), not from the paper.
(5) allreduce across nodes takes the faster of ring and NCCL's tree (no SHARP, per the paper).
(6) meshes with p0 < 8 and every size other than 64 MiB are filled by the model (the paper plots
8xN meshes only). The paper says broadcast 'stays above 800 Gb/s at 512 GPUs'; 4 x HDR carries
at most 800 Gb/s per direction into a node and a broadcast must bring every byte into every
node, so no non-SHARP broadcast can exceed it: this table's 8x64 broadcast reaches
{1 * 2**30 / collective_time('broadcast', 2**30, 8, 64) * 8 / 1e9:.0f} Gb/s at 1 GiB.
(7) concurrency single_group: each entry is one group alone using all of its node's NICs; the
planner multiplies cross-node times by R/p0 for the groups that share a node in training."""


def build() -> dict:
    entries = []
    for op in ("allreduce", "allgather", "reducescatter", "broadcast"):
        for p1 in P1S:
            for p0 in P0S:
                if p0 * p1 == 1:
                    continue
                points = [
                    {"bytes": v, "GBps": float(f"{v / collective_time(op, v, p0, p1) / GB:.4g}")}
                    for v in SIZES
                ]
                entries.append({"op": op, "p0": p0, "p1": p1, "points": points})
    return {
        "schema": "amsp-profile/1",
        "name": "paper-a800",
        "metadata": {
            "source": "derived",
            "backend": "nccl",
            "date": "2023-11-01",
            "torch": None,
            "world": {"nodes": NODES, "gpus_per_node": GPUS_PER_NODE},
            "link": {
                "intra": "NVLink, 600 GB/s bidirectional per GPU (paper)",
                "inter": "4 x Mellanox HDR InfiniBand per node, no SHARP (paper)",
            },
            "concurrency": "single_group",
            "model": {
                "fixed_s": FIXED_S, "step_s": STEP_S,
                "intra_Bps": NVLINK_BPS, "inter_node_Bps": IB_NODE_BPS,
            },
            "notes": NOTES,
        },
        "entries": entries,
    }


def main() -> None:
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
