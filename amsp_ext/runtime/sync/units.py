"""The model's units in forward order: what FSDP2 shards as one group (sp > 1), what a forward
pre-hook waits for (broadcasts), and what the planner costs as one AllGather/ReduceScatter.

[Note: units]
``granularity="module"`` (the paper's module-level AG/RS): every ``nn.Linear`` of a decoder layer
(q, k, v, o, gate, up, down for Llama) is its own unit, and the layer's remaining parameters
(the two RMSNorms) form the layer unit, which runs first (its pre-forward fires before the
attention). ``"layer"``: one unit per decoder layer. Every parameter outside the decoder layers
(embedding, final norm, lm_head, tied weights, parameters registered on the root itself) is in
ONE "root" unit, listed first: see [Note: one root unit].

[Note: one root unit]
Invariant: outside the decoder layers there is exactly one unit, the root (``fully_shard`` of
the model itself), gathered once at the start of the forward and kept gathered into the
backward, reduce-scattered once after it. Why: every unit costs one all-gather in forward, one
in backward and one reduce-scatter, each paying a collective's latency; with the embedding,
final norm and lm_head as units of their own a micro-batch issued 2L + 6 all-gathers and
L + 3 reduce-scatters where FSDP2 (``fully_shard`` per layer, then the root) issues 2L + 1 and
L + 1 (planner/issued.py [Note: FSDP2's count]). The root is needed first in backward (lm_head),
so resharding it after the forward would only gather it again at once; FSDP2 keeps it too, and
the memory model charges it whole from the forward into the backward, with lm_head's unsharded
gradient (planner/memory.py [Note: the root unit's memory]). Its reduce-scatter runs in FSDP2's
final backward callback, after the embedding's gradient, so its tensors come last in the
gradient layout when sp > 1 (:func:`layout_order`). A fused loss that reads ``lm_head.weight``
directly finds it gathered for the whole forward (outside_reads.py). A forward-only engine
reshards the root after its forward (no backward will).

Decoder layers are found through Hugging Face's ``_no_split_modules`` class names when the model
has them, else as the entries of the largest ``nn.ModuleList``. Forward order is taken to be
registration order (true for Llama-family models); a wrong order only costs prefetch efficiency,
never correctness, because every wait also covers the prefetch target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from amsp_ext.choices import GRANULARITIES, check_one_of

__all__ = ["Unit", "decoder_layers", "layout_order", "list_units", "refresh_params", "unit_param_counts"]


@dataclass(kw_only=True)
class Unit:
    name: str  # module path ("" = root)
    module: nn.Module
    kind: str  # "root" | "layer" | "linear"
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # (full name, param)
    layer_index: int | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


def _shared_params(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


def list_units(model: nn.Module, granularity: str) -> list[Unit]:
    """Units in forward order; every parameter of ``model`` is in exactly one unit."""
    check_one_of(granularity, GRANULARITIES, "granularity")
    layers = {id(m): i for i, m in enumerate(decoder_layers(model))}
    shared = _shared_params(model)
    names = {id(m): n for n, m in model.named_modules()}
    pnames = {id(p): n for n, p in model.named_parameters()}
    units: list[Unit] = []
    claimed: set[int] = set()

    def direct(m: nn.Module, recurse: bool) -> list[tuple[str, nn.Parameter]]:
        out = []
        for p in m.parameters(recurse=recurse):
            if id(p) in claimed or id(p) in shared:
                continue
            claimed.add(id(p))
            out.append((pnames[id(p)], p))
        return out

    def visit(m: nn.Module) -> None:
        if id(m) in layers:
            layer = Unit(name=names[id(m)], module=m, kind="layer", layer_index=layers[id(m)])
            units.append(layer)
            if granularity == "module":
                for sub in m.modules():
                    if sub is not m and isinstance(sub, nn.Linear):
                        ps = direct(sub, recurse=True)
                        if ps:
                            units.append(Unit(name=names[id(sub)], module=sub, kind="linear",
                                              params=ps, layer_index=layers[id(m)]))
            layer.params = direct(m, recurse=True)
            return
        for child in m.children():
            visit(child)

    visit(model)
    # [Note: one root unit]: everything outside the layers, in registration order
    rest = [(pnames[id(p)], p) for p in model.parameters() if id(p) not in claimed]
    units.insert(0, Unit(name="", module=model, kind="root", params=rest))
    return units


def layout_order(units: list[Unit], *, root_reduced_last: bool) -> list[tuple[int, str, nn.Parameter]]:
    """``(unit index, name, parameter)`` of every parameter in the order the engine lays its
    local tensors out: forward order, whose reverse is the order gradients arrive (gradient
    buckets are laid out backward and launched strictly in order, grad_sync.py).

    ``root_reduced_last`` (sp > 1): the root unit's gradients all arrive after the backward
    (its one reduce-scatter, [Note: one root unit]), so its tensors come first. Else (sp = 1)
    autograd hands each gradient over when it is computed: lm_head's at the start of the
    backward, the embedding's at the end, so the root's tensors keep their registration place,
    those registered before the first decoder layer first and the others after the layers."""
    root = [(i, u) for i, u in enumerate(units) if u.kind == "root"]
    rest = [(i, n, p) for i, u in enumerate(units) if u.kind != "root" for n, p in u.params]
    if not root:
        return rest
    ri, ru = root[0]
    mine = [(ri, n, p) for n, p in ru.params]
    if root_reduced_last or not rest:
        return mine + rest
    position = {n: k for k, (n, _) in enumerate(ru.module.named_parameters())}
    first_layer = min(position.get(n, len(position)) for _, n, _ in rest)
    before = [t for t in mine if position[t[1]] < first_layer]
    after = [t for t in mine if position[t[1]] >= first_layer]
    return before + rest + after


def refresh_params(units: list[Unit], model: nn.Module) -> None:
    """Re-read each unit's parameters by name (``fully_shard`` replaces them with DTensors)."""
    current = dict(model.named_parameters())
    for u in units:
        u.params = [(n, current[n]) for n, _ in u.params]


def unit_param_counts(model: nn.Module, granularity: str) -> list[tuple[str, int]]:
    """``[(unit name, number of parameters)]`` in forward order (the root unit only if non-empty)."""
    return [(u.name or "<root>", u.numel) for u in list_units(model, granularity)
            if u.kind != "root" or u.params]
