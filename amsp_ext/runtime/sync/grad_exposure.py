"""The reduced gradients where PyTorch's tools look for them: each parameter's ``.grad``.

[Note: .grad after the boundary backward]
The engine reduces gradients into buffers of its own (grad_sync.py) and the optimizer steps the
owners' copies. ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``, gradient logging and
hooks read ``param.grad`` instead; left empty, the clip returns 0.0 and clips nothing, with no
error. So at the end of every boundary backward each trainable parameter's ``.grad`` is set:

- ``views`` (every rank owns every local tensor it holds - sos = sp - without tensor
  parallelism, and gradients kept in the parameters' dtype): the owned gradient itself, no copy;
  a plain tensor when sp = 1, and, when sp > 1, a DTensor with the parameter's own mesh and
  placements (FSDP2's sharded ``.grad``), so torch's norm is reduced over the shards. Clipping
  in place through ``.grad`` is clipping what the optimizer steps.
- ``absent`` (optimizer states sharded by whole tensors beyond the parameters, os > p: a
  gradient lives on one rank of its ``optim_bcast`` group; or fp32 gradients for 16-bit
  parameters; or tensor parallelism): ``.grad`` is an ``AbsentGrad``, a tensor with the
  parameter's shape and dtype and no storage, whose every operation raises one line naming
  ``opt.clip_grad_norm_``. A norm over the gradients one rank holds would be wrong with no error.

What the loop does to ``.grad`` before ``step()`` is what the optimizer steps, as in torch:
``adopt`` runs at the start of ``step()`` and of the next forward and takes a replaced
``.grad`` as the gradient, and a ``.grad`` set to None (``model.zero_grad()``) as none. The
exposed tensors are released at the first forward pre-hook of the next forward, before any
backward can accumulate into them (autograd adds into an existing ``.grad`` in place, FSDP2 into
an existing sharded one), so ``.grad`` reads the reduced gradient from the end of the boundary
backward until the next forward, ``step()`` or ``zero_grad()``.
"""

from __future__ import annotations

from typing import Mapping, MutableMapping, Sequence

import torch

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime.optim.layout import LocalTensor

__all__ = ["AbsentGrad", "GradExposure", "absent_grad"]

EXPOSURES = ("views", "absent")


class AbsentGrad(compat.RaisingTensor):
    """A ``.grad`` the engine cannot offer: shape, dtype and device of the parameter, no storage;
    any operation on it raises ``RuntimeError(why)``."""


def absent_grad(param: torch.Tensor, why: str) -> AbsentGrad:
    local = compat.dtensor_local(param)
    return AbsentGrad(param.shape, dtype=local.dtype, device=local.device, why=why)


class GradExposure:
    """Sets and reconciles the ``.grad`` of ``tensors`` ([Note: .grad after the boundary backward]).
    ``mode``: ``views`` or ``absent``; ``why``: for ``absent``, the reason its error names."""

    def __init__(self, tensors: Sequence[LocalTensor], *, mode: str, why: str | None = None) -> None:
        if mode not in EXPOSURES:
            raise ValueError(f"mode must be one of {', '.join(EXPOSURES)}, got {mode!r}")
        if mode == "absent" and not why:
            raise ValueError("mode 'absent' needs the reason its error gives (why=)")
        self.tensors = list(tensors)
        self.mode, self.why = mode, why
        self._exposed: dict[int, torch.Tensor] = {}  # tensor index -> the object set as .grad

    def is_exposed(self, index: int, grad: torch.Tensor | None) -> bool:
        return grad is not None and self._exposed.get(index) is grad

    def expose(self, owned: Mapping[int, torch.Tensor]) -> None:
        """End of a boundary backward: ``.grad`` of every tensor from ``owned`` (or absent)."""
        for t in self.tensors:
            if self.mode == "absent":
                g: torch.Tensor = absent_grad(t.param, _message(t.name, self.why))
            else:
                local = owned.get(t.index)
                if local is None:  # no gradient reached it (unused this step)
                    continue
                g = _shaped_like(t.param, local.view(t.local_shape))
            t.param.grad = g
            self._exposed[t.index] = g

    def adopt(self, owned: MutableMapping[int, torch.Tensor]) -> None:
        """What the loop did to an exposed ``.grad`` becomes the gradient: a replaced tensor is
        taken (its local data), None drops the owned gradient."""
        for index, obj in self._exposed.items():
            t = self.tensors[index]
            now = t.param.grad
            if now is obj:
                continue
            if now is None:
                owned.pop(index, None)
            elif self.mode == "absent":  # a gradient this rank may not hold: never ignored silently
                raise RuntimeError(_message(t.name, self.why).replace("has no .grad to compute with",
                                                                      "cannot take a new .grad"))
            else:
                owned[index] = compat.dtensor_local(now).reshape(t.local_shape)
            self._exposed[index] = now  # adopted once

    def release(self) -> None:
        """Take the exposed tensors off ``.grad`` (the engine keeps the gradients)."""
        for index, obj in self._exposed.items():
            p = self.tensors[index].param
            if p.grad is obj:
                p.grad = None
        self._exposed.clear()

    @property
    def active(self) -> bool:
        return bool(self._exposed)


def _shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _message(name: str, why: str | None) -> str:
    return (f"amsp: parameter {name!r} has no .grad to compute with here: {why}; clip with "
            f"opt.clip_grad_norm_(max_norm), which returns the exact global norm")
