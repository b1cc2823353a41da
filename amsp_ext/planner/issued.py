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
the two RMSNorm weights; outside: the embedding, the final norm and lm_head (absent when tied),
all three in the one root unit (runtime/sync/units.py [Note: one root unit]).
With sp > 1 each local tensor is 1/sp of the parameter (FSDP2's dim-0 shard; padding ignored).
Packed broadcasts: the tensors up to U/2 bytes, smallest first, within a budget of U bytes; the
engine packs them per owner, which is taken here as one pack per owner that holds some (greedy
ownership spreads the small tensors), at most one per packable tensor.

Pure Python.
"""

from __future__ import annotations

from amsp_ext.planner.buckets import bucket_layout, link_close_bytes, packable
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.profile import ProfileError

__all__ = ["broadcast_items", "bucket_close_bytes", "collectives_per_micro_batch", "forward_gathers", "fsdp2_collectives_per_micro_batch",
           "grad_buckets", "local_tensors", "root_tasks", "tensor_tasks", "unit_gathers"]

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


def root_tasks(spec: ModelSpec, granularity: str) -> list[int]:
    """The step model's tasks (``_units``) that hold the root unit's tensors: the embedding,
    the final norm and lm_head (units.py [Note: one root unit])."""
    first_out = 1 + spec.num_layers * len(spec.layer_units(granularity))
    return [0, first_out] + ([first_out + 1] if not spec.tie_word_embeddings else [])


def tensor_tasks(spec: ModelSpec, granularity: str, sp: int) -> list[tuple[int, int, float]]:
    """(task, unit, local numel) of every tensor in the engine's layout order
    (units.py ``layout_order``): ``task`` indexes the step model's ``_units`` (embedding, the
    layers' units, final norm, lm_head: where the tensor is computed), ``unit`` is the engine's
    unit (0: the root, else the task) - buckets close at its boundaries. With sp > 1 the root's
    tensors come first (their gradients arrive last), else in registration order."""
    kinds = [k for k, _ in spec.layer_units(granularity)]
    per_layer = len(kinds)
    first_out = 1 + spec.num_layers * per_layer
    before = [(0, 0, spec.vocab_size * spec.hidden_size / sp)]
    after = [(first_out, 0, spec.hidden_size / sp)]
    if not spec.tie_word_embeddings:
        after.append((first_out + 1, 0, spec.vocab_size * spec.hidden_size / sp))
    layers = []
    for li in range(spec.num_layers):
        for kind, n in _layer_tensors(spec):
            t = 1 + li * per_layer + (0 if granularity == "layer" else kinds.index(kind))
            layers.append((t, t, n / sp))
    return before + after + layers if sp > 1 else before + layers + after


def local_tensors(spec: ModelSpec, granularity: str, sp: int) -> list[tuple[int, float]]:
    """(engine unit, local numel) of every tensor in layout order (``tensor_tasks``)."""
    return [(u, n) for _, u, n in tensor_tasks(spec, granularity, sp)]


def grad_buckets(spec: ModelSpec, plan: Plan, *, granularity: str, bucket_bytes: int,
                 elem_bytes: int, close_bytes: int | None = None) -> list[tuple[float, list[int]]]:
    """(bytes, tasks of its tensors) of each gradient bucket, in backward (launch) order: the
    engine's layout (planner/buckets.py [Note: buckets close at unit boundaries], [Note: a
    sharded unit is one bucket]; ``close_bytes``: ``bucket_close_bytes``'s)."""
    tensors = tensor_tasks(spec, granularity, plan.sp)
    layout = bucket_layout([(u, n) for _, u, n in tensors], bucket_bytes=bucket_bytes,
                           elem_bytes=elem_bytes, split_units=plan.sp == 1, close_bytes=close_bytes)
    return [(sum(tensors[j][2] for j in bucket) * elem_bytes, [tensors[j][0] for j in bucket])
            for bucket in layout]


def bucket_close_bytes(timer, plan: Plan, *, gpus_per_node: int, num_nodes: int, bucket_bytes: int,
                       given: int | None = None) -> int | None:
    """Where ``plan``'s gradient buckets close at a unit boundary (planner/buckets.py [Note: where
    a bucket closes, from the link]): ``given`` (EngineConfig.grad_bucket_close_bytes), else from
    ``timer`` (a CommTimer; with its profile's calibration, each all-reduce as the step model
    prices it) on the group the boundary all-reduces over (the replica group; the gradient group
    where that is one rank). None: nothing all-reduced, or the profile lacks the
    group's mesh (the default then)."""
    if given is not None:
        return given
    mesh = plan.replica_mesh(gpus_per_node, num_nodes)
    if mesh[0] * mesh[1] <= 1:
        mesh = plan.grad_mesh()
    if mesh[0] * mesh[1] <= 1:
        return None
    cal = timer.profile.calibration

    def time_of(v: float) -> float:  # as the step model prices it (step.py _Pricer)
        t = timer.time("allreduce", v, *mesh)
        return t if cal is None else cal.under_load("AR", t, *timer.issued("allreduce", v, *mesh))

    try:
        return link_close_bytes(time_of, bucket_bytes)
    except ProfileError:
        return None


def broadcast_items(spec: ModelSpec, plan: Plan, *, granularity: str, bucket_bytes: int,
                    elem_bytes: int) -> list[tuple[float, int]]:
    """(bytes, task that first waits for it) of each parameter broadcast after a step, in issue
    (layout) order; empty when sos = sp (nothing to broadcast). The root unit's broadcasts are
    waited for by the first pre-hook of a forward (param_sync.py), task 0."""
    owners = plan.sos // plan.sp
    if owners <= 1:
        return []
    tensors = tensor_tasks(spec, granularity, plan.sp)
    waits = [0 if u == 0 else t for t, u, _ in tensors]
    packed = packable([n * elem_bytes for _, _, n in tensors], bucket_bytes)
    items = [(j, n * elem_bytes, waits[j]) for j, (_, _, n) in enumerate(tensors) if j not in packed]
    if packed:
        num_packs = min(owners, len(packed))
        total = sum(tensors[j][2] for j in packed) * elem_bytes
        first = min(packed)
        items += [(first, total / num_packs, waits[first])] * num_packs
        items.sort(key=lambda it: it[0])
    return [(b, task) for _, b, task in items]


def collectives_per_micro_batch(spec: ModelSpec, granularity: str) -> dict[str, int]:
    """The all-gathers and reduce-scatters the engine issues per micro-batch when sp > 1, counted
    on ``unit_gathers``, the list the step model prices: 2U + 1 and U + 1 for U units in the
    layers (units.py [Note: one root unit])."""
    fwd, bwd, rs = unit_gathers(spec, granularity)
    return {"all_gather": sum(n > 0 for n in fwd) + sum(n > 0 for n in bwd),
            "reduce_scatter": sum(n > 0 for n in rs)}


def forward_gathers(spec: ModelSpec, granularity: str) -> int:
    """The all-gathers one forward issues when sp > 1 (a frozen model's whole share per
    micro-batch: it gathers nothing for a backward)."""
    return sum(n > 0 for n in unit_gathers(spec, granularity)[0])


def unit_gathers(spec: ModelSpec, granularity: str) -> tuple[list[float], list[float], list[float]]:
    """Per task of the step model's ``_units`` (forward order): the parameters its forward
    all-gather, its backward all-gather and its reduce-scatter move (0: none issued there). The
    root unit's one gather is issued before the embedding (task 0) and covers the final norm
    and lm_head too; it is not gathered again for the backward; its reduce-scatter follows the
    embedding's backward, the last (units.py [Note: one root unit])."""
    layer = [float(n) for _, n in spec.layer_units(granularity)] * spec.num_layers
    root = float(sum(n for _, n in spec.outside_params()))
    n_out = len(spec.outside_params())
    fwd = [root] + layer + [0.0] * (n_out - 1)
    bwd = [0.0] + layer + [0.0] * (n_out - 1)
    return fwd, bwd, list(fwd)


def fsdp2_collectives_per_micro_batch(num_layers: int, *, hsdp: bool) -> dict[str, int]:
    """[Note: FSDP2's count]
    FSDP2's ZeRO-3 as it is usually wrapped (``fully_shard`` on each of the L decoder layers,
    then on the root) issues per micro-batch: one all-gather per layer in forward and one in
    backward (a non-root module reshards after its forward), one all-gather of the root group
    in forward and none in backward (the root does not reshard after forward), and one
    reduce-scatter per group: AG = 2L + 1, RS = L + 1. Under HSDP (a 2-D mesh, MiCS's
    replication) each group's reduce-scattered gradient is also all-reduced across replicas,
    every micro-batch by default: AR = L + 1. Checked against a real FSDP2 step on 2 gloo
    ranks (tests/test_collective_counts.py)."""
    out = {"all_gather": 2 * num_layers + 1, "reduce_scatter": num_layers + 1}
    if hsdp:
        out["all_reduce"] = num_layers + 1
    return out
