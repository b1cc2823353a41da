"""Muon for the hidden matrices and AdamW for the rest, as one torch optimizer.

[Note: one optimizer over two]
``torch.optim.Muon`` takes 2-D parameters only; the embedding, the head and every vector
(norms, biases) are trained with AdamW beside it (Keller Jordan's MuonWithAuxAdam, DeepSpeed's
``"type": "Muon"``). AMSP steps one inner optimizer per rank, so the pair is one
``torch.optim.Optimizer``: each param group carries ``use_muon``, and two real torch optimizers
(Muon, AdamW) run the groups of their kind. Invariant: their ``param_groups`` are the very dicts
of this optimizer's list (in the same order: Muon's groups, then AdamW's) and their ``state`` is
this optimizer's dict, so LR schedulers, ``state_dict`` and checkpoints see one optimizer in
torch's layout. ``load_state_dict`` (which replaces both) re-points them, and so does every
``step``: a wrapper may replace ``state`` or ``param_groups`` from outside (AMSPOptimizer's
``torch.optim.Optimizer.__init__`` assigns a fresh ``state`` dict through its ``state``
setter), and before this re-point the two torch optimizers kept stepping into the old dict while
``state_dict()`` - so checkpoints and ``switch_plan`` - saw no state at all. Its class is not
listed as elementwise (kinds.py): it is stepped on whole tensors.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["MuonWithAdamW", "is_hidden_matrix", "muon_adamw_factory"]

MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "eps", "adjust_lr_fn")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's default split when parameters carry no ``use_muon``: a matrix that is not
    an embedding or the output head."""
    low = name.lower()
    return param.dim() == 2 and "embed" not in low and "lm_head" not in low and "wte" not in low \
        and "wpe" not in low


def muon_adamw_factory(*, muon: dict[str, Any] | None = None, adamw: dict[str, Any] | None = None):
    """An ``optimizer_factory`` for ``shard()``: Muon for the hidden matrices (by each master's
    ``amsp_name``, ``is_hidden_matrix``), AdamW for the rest, with these keyword defaults."""
    def build(masters: list[torch.nn.Parameter]) -> "MuonWithAdamW":
        hidden = [m for m in masters if is_hidden_matrix(getattr(m, "amsp_name", ""), m)]
        rest = [m for m in masters if not is_hidden_matrix(getattr(m, "amsp_name", ""), m)]
        return MuonWithAdamW([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}],
                             muon=muon, adamw=adamw)
    return build


class MuonWithAdamW(torch.optim.Optimizer):
    """``params``: param groups, each with ``use_muon`` (True: Muon's hyper-parameters apply;
    False: AdamW's). Defaults for either kind come from ``muon`` / ``adamw`` (keyword dicts of
    ``torch.optim.Muon`` / ``torch.optim.AdamW``)."""

    def __init__(self, params: Iterable[dict[str, Any]], *, muon: dict[str, Any] | None = None,
                 adamw: dict[str, Any] | None = None) -> None:
        groups = [dict(g) for g in params]
        for i, g in enumerate(groups):
            if not isinstance(g.get("use_muon"), bool):
                raise ValueError(f"MuonWithAdamW: param group {i} needs use_muon: true or false")
        muon_groups = [g for g in groups if g["use_muon"]]
        adam_groups = [g for g in groups if not g["use_muon"]]
        # empty groups would be refused by torch: a kind with no parameters gets no optimizer
        self._muon = torch.optim.Muon(muon_groups, **(muon or {})) if muon_groups else None
        self._adamw = torch.optim.AdamW(adam_groups, **(adamw or {})) if adam_groups else None
        super().__init__(self._inner_groups(), {})
        self._constructed = True
        self._repoint()

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [g for o in (self._muon, self._adamw) if o is not None for g in o.param_groups]

    def _repoint(self) -> None:
        """The inner optimizers' groups are this list's dicts, their state this dict."""
        n = len(self._muon.param_groups) if self._muon is not None else 0
        if self._muon is not None:
            self._muon.param_groups = self.param_groups[:n]
            self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = self.param_groups[n:]
            self._adamw.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructed", False):  # a group added later would never be stepped
            raise ValueError("MuonWithAdamW.add_param_group: build it with all its groups")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._repoint()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._repoint()  # [Note: one optimizer over two]: the state written is this one's
        for o in (self._muon, self._adamw):
            if o is not None:
                o.step()
        return loss
