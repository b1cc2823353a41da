"""The model's units in forward order: what FSDP2 shards as one group (sp > 1), what a forward
pre-hook waits for (broadcasts), and what the planner costs as one AllGather/ReduceScatter.

[Note: units]
``granularity="module"`` (the paper's module-level AG/RS): every ``nn.Linear`` of a decoder layer
(q, k, v, o, gate, up, down for Llama) is its own unit, and the layer's remaining parameters
(the two RMSNorms) form the layer unit, which runs first (its pre-forward fires before the
attention). ``"layer"``: one unit per decoder layer. Outside the layers, every module that owns
parameters directly (embedding, final norm, lm_head) is a unit. Parameters left to the root
(tied weights, parameters registered on the root itself) form a "root" unit, listed first.

Decoder layers are found through Hugging Face's ``_no_split_modules`` class names when the model
has them, else as the entries of the largest ``nn.ModuleList``. Forward order is taken to be
registration order (true for Llama-family models); a wrong order only costs prefetch efficiency,
never correctness, because every wait also covers the prefetch target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from amsp_ext.choices import GRANULARITIES, check_one_of

__all__ = ["Unit", "decoder_layers", "list_units", "refresh_params", "unit_param_counts"]


@dataclass(kw_only=True)
class Unit:
    name: str  # module path ("" = root)
    module: nn.Module
    kind: str  # "root" | "outer" | "layer" | "linear"
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
        if m is not model:
            ps = direct(m, recurse=False)
            if ps:
                units.append(Unit(name=names[id(m)], module=m, kind="outer", params=ps))
        for child in m.children():
            visit(child)

    visit(model)
    rest = [(pnames[id(p)], p) for p in model.parameters() if id(p) not in claimed]
    units.insert(0, Unit(name="", module=model, kind="root", params=rest))
    return units


def refresh_params(units: list[Unit], model: nn.Module) -> None:
    """Re-read each unit's parameters by name (``fully_shard`` replaces them with DTensors)."""
    current = dict(model.named_parameters())
    for u in units:
        u.params = [(n, current[n]) for n, _ in u.params]


def unit_param_counts(model: nn.Module, granularity: str) -> list[tuple[str, int]]:
    """``[(unit name, number of parameters)]`` in forward order (the root unit only if non-empty)."""
    return [(u.name or "<root>", u.numel) for u in list_units(model, granularity)
            if u.kind != "root" or u.params]
