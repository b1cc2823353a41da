"""Parameters read outside their module's forward: gathered where a model may read them, refused
where it cannot.

[Note: parameters read outside their module's forward]
A fused or chunked loss (TRL's fused LM head, Liger, Cut Cross-Entropy) reads ``lm_head.weight``
inside the model's forward without calling ``lm_head``; so does weight tying done by hand. The
engine makes a unit's parameters valid in that unit's own forward (its pre-hook waits for its
broadcasts; FSDP2 gathers it), which such a read bypasses: with sp > 1 the weight is still the
sharded DTensor (TRL then calls ``full_tensor()``, whose gradient skips the reduce-scatter, so
each rank steps its own micro-batch's gradient, with no error), and with sp = 1 under
optimizer-state sharding a non-owner reads last step's weight until the broadcast lands.

The rule is FSDP2's root rule: parameters outside the decoder layers (the root unit: embedding,
final norm, head, tied weights; units.py [Note: one root unit]) are valid for the whole forward of
the model.
- sp = 1: the first forward pre-hook of a forward waits for the root unit's broadcasts
  (param_sync.py), whichever unit's hook runs first.
- sp > 1: the root unit is FSDP2's root group: its root pre-forward gathers it before anything
  runs and, as it does not reshard after forward, it stays gathered into the backward, where
  FSDP2's final callback runs its post-backward: every gradient accumulated on a gathered
  weight (lm_head's, whether lm_head ran or only a fused loss read its weight) is
  reduce-scattered once, reaches the engine like any other, and the root reshards. Nothing
  reshards it in between, so a weight a fused kernel saved for backward keeps its storage even
  when another forward of the same model (DPO's reference pass) runs before that backward. A
  forward-only engine (a reference model) has no backward to come: ``OuterGather`` reshards
  its root when its forward returns, or it kept its gathered head and embedding from one step
  to the next (TRL's ``sync_ref_model`` then met a plain tensor beside the policy's DTensor). A
  trained model's no-grad forward does not: it may run between a forward and its backward.
- [Note: a gathered root after a step] A forward that no backward follows (a no-grad forward
  between the last backward and ``step()``, an evaluation) leaves the root gathered, and FSDP2's
  next root pre-forward reuses a gathered group without gathering again: after the step it
  would compute with the old embedding and head. So when the owners write new parameters (the
  step, a loaded optimizer state: ``ParamSync.broadcast_all``) ``OuterGather.drop_stale``
  reshards a gathered root; the next forward gathers the new values. A root held by an open
  GatheredParameters context is left to it. Nothing a backward still needs can be dropped
  there: the step comes after the backward.
- A decoder layer's parameter stays valid only in its layer's forward. Used elsewhere with
  sp > 1 it is the sharded DTensor, and any gradient autograd computes for it directly (FSDP2
  never lets autograd reach a sharded parameter: it assigns the reduce-scattered ``.grad``)
  stops the backward with one line naming it, instead of stepping a wrong gradient.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.profiler import record_function

from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.sync.units import Unit

__all__ = ["OuterGather"]


class OuterGather:
    """sp > 1: a forward-only engine's root unit resharded after its forward, and the guard on
    every sharded parameter ([Note: parameters read outside their module's forward])."""

    def __init__(self, model: nn.Module, units: Sequence[Unit], tensors: Sequence[LocalTensor], *,
                 plan: str, forward_only: bool = False) -> None:
        self.model = model
        self.forward_only = forward_only
        # the root unit, when it has parameters (FSDP2's root group gathers it)
        self.outer = [u.module for u in units if u.kind == "root" and u.params]
        self.tensors = list(tensors)
        self.plan = plan
        self._handles: list = []
        # id(outer unit) -> open GatheredParameters contexts keeping it gathered
        # (integrations/gathered.py [Note: GatheredParameters under AMSP])
        self._kept: dict[int, int] = {}

    def install(self) -> None:
        if self.outer and self.forward_only:
            self._handles.append(self.model.register_forward_hook(self._release))
        for t in self.tensors:
            self._handles.append(t.param.register_hook(self._guard(t.name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def keep(self, module: nn.Module) -> None:
        """Not released after forwards until ``release(module)``: a GatheredParameters context
        holds it gathered (generation inside gathers once)."""
        self._kept[id(module)] = self._kept.get(id(module), 0) + 1

    def release(self, module: nn.Module) -> None:
        n = self._kept.pop(id(module), 0) - 1
        if n > 0:
            self._kept[id(module)] = n

    def drop_stale(self) -> None:
        """The parameters changed: reshard a root a forward left gathered ([Note: a gathered
        root after a step]). No collective."""
        with record_function("amsp::reshard_stale_root::param_shard"):
            for m in self.outer:
                if id(m) not in self._kept:
                    m.reshard()  # type: ignore[operator]  (an FSDPModule; a no-op when sharded)

    @torch.compiler.disable  # param_sync.py [Note: hooks under torch.compile]
    def _release(self, module, args, output) -> None:
        if self.forward_only:  # no post-backward will reshard them
            with record_function("amsp::reshard_outer_units::param_shard"):
                for m in self.outer:
                    if id(m) not in self._kept:
                        m.reshard()  # type: ignore[operator]  (an FSDPModule)

    def _guard(self, name: str):
        def hook(grad):
            raise RuntimeError(
                f"amsp: parameter {name!r} was used outside its module's forward, where plan "
                f"{self.plan} keeps it sharded; read a decoder layer's parameters inside that "
                f"layer's forward (parameters outside the layers may be read anywhere in the "
                f"model's forward)")
        return hook
