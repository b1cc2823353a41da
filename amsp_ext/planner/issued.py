"""The collectives the engine issues in one step, one by one, for the calibrated step model.

The paper's terms (cost.py) price T0_os as fractional buckets of exactly U bytes and T1_os as one
broadcast per owner of all its bytes. The engine issues something else: gradient buckets that
never split a tensor (grad_sync.py: up to U bytes, a larger tensor alone), and one broadcast per
local tensor, the smallest packed per owner up to a budget of U (param_sync.py). Where a
collective costs a fixed latency on top of its bytes, the count matters: small-llama's
optimizer-state broadcasts over 2 ranks are 30 broadcasts of 128-700 KiB, not one of 6 MiB, and
on the CPU lab each pays about a millisecond before a byte moves. This module lists them from the
model's shapes, in the engine's order, so the calibrated model can price each one.

[Note: tensors of a unit]
Per decoder layer: q, k, v, o, gate, up, down (each with its bias when the config has one) and
the two RMSNorm weights; outside: the embedding, the final norm and lm_head (absent when tied).
With sp > 1 each local tensor is 1/sp of the parameter (FSDP2's dim-0 shard; padding ignored).
Packed broadcasts: the tensors up to U/2 bytes, smallest first, within a budget of U bytes; the
engine packs them per owner, which is taken here as one pack per owner that holds some (greedy
ownership spreads the small tensors), at most one per packable tensor.

Pure Python.
"""

from __future__ import annotations

from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan

__all__ = ["UNIT_BUCKET_MIN_BYTES", "broadcast_items", "grad_buckets", "local_tensors"]

# grad_sync.py's constant (the planner does not import the runtime): a bucket closes at a unit
# boundary once it holds this many bytes (DDP's first-bucket size).
UNIT_BUCKET_MIN_BYTES = 2**20


def _layer_tensors(spec: ModelSpec) -> list[tuple[str, int]]:
    """(unit kind at module granularity, numel) of one layer's tensors, forward order."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    out = [("q", h * q), ("k", h * kv), ("v", h * kv)]
    if spec.qkv_bias:
        out += [("q", q), ("k", kv), ("v", kv)]
    out.append(("o", q * h))
    if spec.o_bias:
        out.append(("o", h))
    out += [("gate", h * i), ("up", h * i), ("down", i * h)]
    if spec.mlp_bias:
        out += [("gate", i), ("up", i), ("down", h)]
    return out + [("norms", h), ("norms", h)]


def local_tensors(spec: ModelSpec, granularity: str, sp: int) -> list[tuple[int, float]]:
    """(unit index, local numel) of every tensor in forward order; unit indices as the step
    model's ``_units`` (embedding, the layers' units, final norm, lm_head)."""
    kinds = [k for k, _ in spec.layer_units(granularity)]
    per_layer = len(kinds)
    out: list[tuple[int, float]] = [(0, spec.vocab_size * spec.hidden_size / sp)]
    for li in range(spec.num_layers):
        for kind, n in _layer_tensors(spec):
            u = 0 if granularity == "layer" else kinds.index(kind)
            out.append((1 + li * per_layer + u, n / sp))
    first_out = 1 + spec.num_layers * per_layer
    out.append((first_out, spec.hidden_size / sp))
    if not spec.tie_word_embeddings:
        out.append((first_out + 1, spec.vocab_size * spec.hidden_size / sp))
    return out


def grad_buckets(spec: ModelSpec, plan: Plan, *, granularity: str, bucket_bytes: int,
                 elem_bytes: int) -> list[tuple[float, list[int]]]:
    """(bytes, units of its tensors) of each gradient bucket, in backward (launch) order: the
    engine's rule (runtime/sync/grad_sync.py [Note: buckets close at unit boundaries]): at most
    U bytes, and closed where the backward moves to another unit once it holds 1 MiB."""
    cap = max(1, bucket_bytes // elem_bytes)
    unit_min = min(cap, max(1, UNIT_BUCKET_MIN_BYTES // elem_bytes))
    buckets: list[tuple[float, list[int]]] = []
    cur_n, cur_units = 0.0, []
    for unit, n in reversed(local_tensors(spec, granularity, plan.sp)):
        boundary = bool(cur_units) and unit != cur_units[-1]
        if cur_units and (cur_n + n > cap or (boundary and cur_n >= unit_min)):
            buckets.append((cur_n * elem_bytes, cur_units))
            cur_n, cur_units = 0.0, []
        cur_n += n
        cur_units.append(unit)
    if cur_units:
        buckets.append((cur_n * elem_bytes, cur_units))
    return buckets


def broadcast_items(spec: ModelSpec, plan: Plan, *, granularity: str, bucket_bytes: int,
                    elem_bytes: int) -> list[tuple[float, int]]:
    """(bytes, unit) of each parameter broadcast after a step, in issue (forward) order; empty
    when sos = sp (nothing to broadcast)."""
    owners = plan.sos // plan.sp
    if owners <= 1:
        return []
    tensors = local_tensors(spec, granularity, plan.sp)
    cap, budget = bucket_bytes / 2, float(bucket_bytes)
    packable = set()
    for idx in sorted(range(len(tensors)), key=lambda j: (tensors[j][1], j)):
        b = tensors[idx][1] * elem_bytes
        if b > cap or b > budget:
            break
        packable.add(idx)
        budget -= b
    items = [(n * elem_bytes, unit) for j, (unit, n) in enumerate(tensors) if j not in packable]
    if packable:
        num_packs = min(owners, len(packable))
        packed = sum(tensors[j][1] for j in packable) * elem_bytes
        first = tensors[min(packable)][0]
        items += [(packed / num_packs, first)] * num_packs
        items.sort(key=lambda it: it[1])
    return items
