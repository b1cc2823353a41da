"""Shared helpers for the planner tests: synthetic profiles and a toy model with easy numbers."""

from __future__ import annotations

from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.profile import BandwidthProfile

OPS = ("allreduce", "allgather", "reducescatter", "broadcast")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def constant_profile(R, N, gbps, *, concurrency="all_groups", name="const", drop=()):
    """Every mesh p0 | R, p1 | N at a constant bandwidth per op (GB/s): t = v / (gbps[op] * 1e9)
    for any size from 1 byte to 1 TiB. ``drop`` lists (op, p0, p1) entries to leave out."""
    entries = []
    for op in OPS:
        for p0 in divisors(R):
            for p1 in divisors(N):
                if p0 * p1 == 1 or (op, p0, p1) in drop:
                    continue
                entries.append({"op": op, "p0": p0, "p1": p1, "points": [
                    {"bytes": 1, "GBps": gbps[op]}, {"bytes": 2**40, "GBps": gbps[op]}]})
    doc = {"schema": "amsp-profile/1", "name": name,
           "metadata": {"source": "synthetic", "concurrency": concurrency,
                        "world": {"nodes": N, "gpus_per_node": R}},
           "entries": entries}
    return BandwidthProfile.from_dict(doc)


def ab_profile(R, N, *, concurrency="all_groups", name="ab"):
    """A hierarchical alpha-beta profile (sizes 1 MiB .. 1 GiB) over every mesh p0 | R, p1 | N:
    t = 20us + 3us (p-1) + traffic v / B, B = 100 GB/s inside a node, 12 GB/s per node across
    nodes, shared by the R/p0 concurrent groups when the table is ``all_groups``."""
    entries = []
    for op in OPS:
        for p0 in divisors(R):
            for p1 in divisors(N):
                p = p0 * p1
                if p == 1:
                    continue
                bw = 100e9 if p1 == 1 else 12e9
                if p1 > 1 and concurrency == "all_groups":
                    bw *= p0 / R
                traffic = 1.0 if op == "broadcast" else (2.0 if op == "allreduce" else 1.0) * (p - 1) / p
                pts = []
                for k in range(20, 31, 2):
                    v = 2**k
                    t = 20e-6 + (p - 1) * 3e-6 + traffic * v / bw
                    pts.append({"bytes": v, "GBps": v / t / 1e9})
                entries.append({"op": op, "p0": p0, "p1": p1, "points": pts})
    return BandwidthProfile.from_dict({
        "schema": "amsp-profile/1", "name": name,
        "metadata": {"concurrency": concurrency, "world": {"nodes": N, "gpus_per_node": R}},
        "entries": entries})


# Toy model: h=4, i=8, 2 layers, 2 heads of dim 2, 1 kv head, vocab 16, untied.
# Per layer: norms 2*4=8, q 4*4=16, k 4*2=8, v 8, o 16, gate 32, up 32, down 32 -> 152.
# Outside: embedding 16*4=64, final norm 4, lm_head 64 -> 132. Phi = 2*152 + 132 = 436.
TOY = ModelSpec(name="toy", hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=2, vocab_size=16)
TOY_PHI = 436
