"""The collectives the engine issues in one step, one by one, for the calibrated step model.

The paper's terms (cost.py) price T0_os as fractional buckets of exactly U bytes and T1_os as one
broadcast per owner of all its bytes. The engine issues something else: gradient buckets that
never split a tensor (grad_sync.py: up to U bytes, a larger tensor alone), and one broadcast per
local tensor, the smallest packed per owner up to a budget of U (param_sync.py). Where a
collective costs a fixed latency on top of its bytes, the count matters: small-llama's
optimizer-state broadcasts over 2 ranks are 30 broadcasts of 128-700 KiB, not one of 6 MiB, and
on the CPU lab each pays about a millisecond before a byte moves. This module lists them from the
model's shapes, in the engine's order, so the calibrated model can price each one; the layout
itself is the engine's own, planner/buckets.py, applied to the model's shapes.

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

from amsp_ext.planner.buckets import bucket_layout, packable
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan

__all__ = ["broadcast_items", "grad_buckets", "local_tensors"]

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
    engine's layout (planner/buckets.py [Note: buckets close at unit boundaries])."""
    tensors = local_tensors(spec, granularity, plan.sp)
    return [(sum(tensors[j][1] for j in bucket) * elem_bytes, [tensors[j][0] for j in bucket])
            for bucket in bucket_layout(tensors, bucket_bytes=bucket_bytes, elem_bytes=elem_bytes)]


def broadcast_items(spec: ModelSpec, plan: Plan, *, granularity: str, bucket_bytes: int,
                    elem_bytes: int) -> list[tuple[float, int]]:
    """(bytes, unit) of each parameter broadcast after a step, in issue (forward) order; empty
    when sos = sp (nothing to broadcast)."""
    owners = plan.sos // plan.sp
    if owners <= 1:
        return []
    tensors = local_tensors(spec, granularity, plan.sp)
    packed = packable([n * elem_bytes for _, n in tensors], bucket_bytes)
    items = [(n * elem_bytes, unit) for j, (unit, n) in enumerate(tensors) if j not in packed]
    if packed:
        num_packs = min(owners, len(packed))
        total = sum(tensors[j][1] for j in packed) * elem_bytes
        first = tensors[min(packed)][0]
        items += [(total / num_packs, first)] * num_packs
        items.sort(key=lambda it: it[1])
    return items
