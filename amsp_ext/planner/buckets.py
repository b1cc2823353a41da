"""How the engine groups tensors into collectives, stated once: gradient buckets (the engine's
runtime/sync/grad_sync.py) and the tensors packed into shared broadcasts
(runtime/sync/param_sync.py), from ``(unit, numel)`` lists in forward order. The engine calls
these on its local tensors and planner/issued.py on the model's shapes, so the calibrated step
model prices the collectives the engine issues. Pure Python.

[Note: buckets close at unit boundaries]
Buckets used to be filled to U regardless of units. A model smaller than U (small-llama: 12 MB of
fp32 gradients, U = 25 MiB) then had ONE bucket, ready only when the last gradient of the backward
arrived: the whole AllReduce ran after the backward, exposed (AMSP's replicate plan exposed all
of its all-reduce while DDP, whose first bucket is 1 MiB, hid part of it; the MiCS config waited
for one replica AllReduce at the flush while FSDP2's HSDP all-reduces each unit right after its
reduce-scatter). So a bucket also closes where the backward moves to the next unit once it holds
UNIT_BUCKET_MIN_BYTES (DDP's first-bucket size; from the link where the job is priced, [Note:
where a bucket closes, from the link]): a unit's gradients (for sp > 1, its reduce-scatter's
output) go on the wire as soon as its backward is over, while the earlier units compute; units
smaller than that share a bucket.
With sp = 1, never more than U; a tensor larger than U goes alone (sp > 1: [Note: a sharded
unit is one bucket]).

[Note: a sharded unit is one bucket]
With sp > 1 a unit's gradients reach the hooks together: FSDP2 reduce-scatters the unit and
then runs the post-accumulate-grad hooks of all its sharded parameters in a row. Splitting such
a unit over several buckets pipelines nothing (every piece is ready at the same instant) and
adds a collective's fixed latency per piece; at 1,024 ranks LLaMA-7B's mics:8 replica group
paid 163 all-reduces per step for FSDP2's HSDP 33 (one per unit, FSDP2's own layout). So for
sp > 1 (``split_units=False``) a unit is never split: U bounds the merging of units, and a unit
larger than U is one bucket of its own. With sp = 1 autograd produces a unit's gradients one
tensor after another, so splitting a large unit at U lets its first piece go while the rest
compute (DDP's reason for its 25 MiB buckets), and the old rule stays. Buckets in flight are
then counted in the largest unit's shard rather than U (two of them in flight, as two of U
otherwise, so a unit's all-reduce can run while the next unit's backward goes on); the memory
it costs, the largest unit's reduce-dtype shard three times, is what planner/memory.py charges.

[Note: where a bucket closes, from the link]
UNIT_BUCKET_MIN_BYTES is where a bucket may close when nothing is known of the link. Where the
job is priced (a profile), the size comes from the link the boundary's all-reduce runs on (the
plan's replica group; its gradient group where the replica is one rank): the smallest size, from
64 KiB doubling up to U, whose all-reduce reaches CLOSE_BANDWIDTH_SHARE of the bandwidth of a
U-byte one, each priced as the step model prices it (with the profile's calibration, the cost
per issued collective included: where each collective waits for a core, buckets merge). Below
it a bucket pays mostly the collective's fixed latency, so units are merged; above it a bucket
is bandwidth-bound and merging only delays the first bytes. A slow link
saturates early (the 100 Mbit lab's 1 x 2 all-reduce is at full bandwidth from 64 KiB: a bucket
per unit, tiny-llama's three units included), a fast one late (the A800 profile's 1 x 128
all-reduce reaches 80 % of its 25 MiB bandwidth at 8 MiB). In the alpha-beta model t = a + v/B
this is v >= 4aB at 0.8: the latency at most a fifth of the bucket's time. A profile without the
group's mesh (and ``missing="error"``) leaves UNIT_BUCKET_MIN_BYTES; the planner refuses to price
such a plan anyway. EngineConfig.grad_bucket_close_bytes overrides the rule.

[Note: bytes in flight]
Launching a bucket first completes the oldest ones until what is in flight, this bucket included,
is at most IN_FLIGHT_BUCKETS x U bytes: the bucket memory (D_tmp; planner/memory.py charges 2U in
flight plus the bucket being filled) stays bounded while the backward goes on. Counting bytes,
not buckets, keeps that bound for full buckets and lets small ones queue in the process group as
DDP's do (counting two buckets stalled the backward on the third small one's launch). The
calibrated step model (planner/step.py, ``ar_buckets_in_flight``) applies the same cap, which
`amsp tune` writes into the calibration from here.

[Note: packed broadcasts]
The tensors of at most U/2 bytes, smallest first (ties in forward order), while their total fits
in U, are broadcast in packs rather than one by one: each costs a fixed latency before a byte
moves, and a model's norms and biases are many small tensors.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["CLOSE_BANDWIDTH_SHARE", "IN_FLIGHT_BUCKETS", "UNIT_BUCKET_MIN_BYTES", "bucket_layout", "in_flight_cap",
           "link_close_bytes", "packable"]

UNIT_BUCKET_MIN_BYTES = 2**20  # [Note: buckets close at unit boundaries]
CLOSE_MIN_BYTES = 2**16  # [Note: where a bucket closes, from the link]
CLOSE_BANDWIDTH_SHARE = 0.8
IN_FLIGHT_BUCKETS = 2  # [Note: bytes in flight]


def _bucket_cap(bucket_bytes: int, elem_bytes: int) -> int:
    return max(1, bucket_bytes // elem_bytes)


def in_flight_cap(bucket_bytes: int, elem_bytes: int, largest_numel: int = 0) -> int:
    """Elements of gradient buckets that may be in flight at once ([Note: bytes in flight]):
    ``IN_FLIGHT_BUCKETS`` buckets of U, or of ``largest_numel`` where an unsplit unit is larger
    ([Note: a sharded unit is one bucket]; 0 where units are split at U)."""
    return IN_FLIGHT_BUCKETS * max(_bucket_cap(bucket_bytes, elem_bytes), largest_numel)


def link_close_bytes(time_of: Callable[[float], float], bucket_bytes: int) -> int:
    """Where a bucket closes at a unit boundary on a link whose all-reduce of ``v`` bytes takes
    ``time_of(v)`` seconds ([Note: where a bucket closes, from the link])."""
    full = bucket_bytes / time_of(bucket_bytes)
    size = CLOSE_MIN_BYTES
    while size < bucket_bytes and size / time_of(size) < CLOSE_BANDWIDTH_SHARE * full:
        size *= 2
    return min(size, bucket_bytes)


def bucket_layout(tensors: Sequence[tuple[int, float]], *, bucket_bytes: int,
                  elem_bytes: int, split_units: bool = True, close_bytes: int | None = None) -> list[list[int]]:
    """The gradient buckets of ``tensors`` (``(unit, numel)`` in forward order) in backward
    (launch) order, each as the positions of its tensors in ``tensors``, in backward order
    ([Note: buckets close at unit boundaries]): at most U = ``bucket_bytes`` of
    ``elem_bytes``-byte elements, closed at a unit boundary once it holds
    ``close_bytes`` (None: UNIT_BUCKET_MIN_BYTES; [Note: where a bucket closes, from the
    link]). ``split_units=False`` (sp > 1): a unit is never split, U only bounds merging
    ([Note: a sharded unit is one bucket])."""
    cap = _bucket_cap(bucket_bytes, elem_bytes)
    close = UNIT_BUCKET_MIN_BYTES if close_bytes is None else close_bytes
    unit_min = min(cap, max(1, close // elem_bytes))
    unit_numel: dict[int, float] = {}
    for unit, numel in tensors:
        unit_numel[unit] = unit_numel.get(unit, 0) + numel
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_numel: float = 0
    for pos in reversed(range(len(tensors))):
        unit, numel = tensors[pos]
        at_boundary = bool(cur) and unit != tensors[cur[-1]][0]
        if split_units:
            close = cur and (cur_numel + numel > cap or (at_boundary and cur_numel >= unit_min))
        else:
            close = at_boundary and (cur_numel >= unit_min or cur_numel + unit_numel[unit] > cap)
        if close:
            buckets.append(cur)
            cur, cur_numel = [], 0
        cur.append(pos)
        cur_numel += numel
    if cur:
        buckets.append(cur)
    return buckets


def packable(sizes: Sequence[float], bucket_bytes: int) -> set[int]:
    """Positions of the tensors (of ``sizes`` bytes, forward order) that go into packed
    broadcasts ([Note: packed broadcasts])."""
    cap, budget = bucket_bytes / 2, float(bucket_bytes)
    out: set[int] = set()
    for pos in sorted(range(len(sizes)), key=lambda j: (sizes[j], j)):
        if sizes[pos] > cap or sizes[pos] > budget:
            break
        out.add(pos)
        budget -= sizes[pos]
    return out
