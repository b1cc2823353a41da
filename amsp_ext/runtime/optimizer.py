"""The optimizer a training loop sees: owners step their fp32 masters, then broadcast.

[Note: what each rank keeps]
A rank keeps fp32 master weights and the inner optimizer's states only for the local tensors
it owns (ownership.py); the inner optimizer (``optimizer_factory``) is built over those masters
alone, so ``param_groups`` (and LR schedulers) work as usual. With ``precision="fp32"`` the
master *is* the local parameter storage (a second Parameter object on the same memory), so no
copy and no extra 4 bytes per parameter. Gradients of owned tensors stay in the compute dtype
until the step, which upcasts them one tensor at a time (D_tmp, not model state).

[Note: exact global clipping]
The ``optim`` group (sos ranks = sp shard positions x sos/sp owners) holds every local tensor of
the model exactly once across its ranks, so the sum of squares of owned gradients over one
``optim`` group is the global squared norm. It is all-reduced over the world (every ``optim``
group contributes the same sum: divided by world / sos), so that the non-finite guard's
decision, which rides on it, is one for all ranks (nonfinite.py). The clip coefficient is
applied to the fp32 gradients at step time (with the fp16 loss-scale division).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.loss_scale import DynamicLossScaler
from amsp_ext.runtime.nonfinite import NonFiniteGuard

if TYPE_CHECKING:
    from amsp_ext.runtime.engine import Engine

__all__ = ["AMSPOptimizer"]


class AMSPOptimizer(torch.optim.Optimizer):
    # Optimizer.__init__ is not called: it would register the model's parameters, while ours are
    # the owned masters, handed to the inner optimizer. We set what schedulers and hooks read.
    def __init__(self, engine: "Engine", masters: dict[int, nn.Parameter],
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self._engine = engine
        self.masters = masters  # tensor index -> fp32 master (owned only), forward order
        self._aliased = engine.config.dtype == torch.float32
        params = list(masters.values())
        if not params:  # a rank that owns nothing still has param_groups for schedulers
            params = [nn.Parameter(torch.zeros(0, device=engine.device))]
        inner = optimizer_factory(params)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"optimizer_factory must return a torch.optim.Optimizer, got {type(inner).__name__}")
        self.inner = inner
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        self.scaler = DynamicLossScaler(engine.config.fp16) if engine.config.precision == "fp16" else None
        self._grad_coef = 1.0
        self.last_grad_norm: float | None = None
        # set by clip_grad_norm_: a non-finite global norm is exactly "some gradient overflowed",
        # so step() needs no second all-reduce (and no per-tensor isfinite sync) to find out
        self._found_inf: bool | None = None
        self.num_steps = 0
        self.guard = NonFiniteGuard(engine.config.max_bad_steps)  # see nonfinite.py
        self._skipped = 0

    # -- what LR schedulers and user code read ---------------------------------------------------
    @property
    def param_groups(self):  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.inner.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value):
        self.inner.state = value

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (fp16 overflows and non-finite steps)."""
        return self._skipped

    def __repr__(self) -> str:
        return f"AMSPOptimizer(plan={self._engine.plan}, owned={len(self.masters)}, inner={self.inner!r})"

    # -- training loop ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the dynamic loss scale under fp16."""
        self.guard.note_loss(loss)  # [amsp nonfinite] lazy flag, no sync
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def _owned_grads(self) -> dict[int, torch.Tensor]:
        return self._engine.grad_sync.owned

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm (of the unscaled, averaged gradients); clip to ``max_norm``."""
        e = self._engine
        if norm_type not in (2.0, 2, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
        with record_function("amsp::clip_grad_norm::optim"):
            grads = list(self._owned_grads().values())
            # [amsp nonfinite] over the world, with this rank's loss verdict folded in: every
            # rank gets the same (non-)finite norm (nonfinite.py: [Note: one decision...])
            world = dist.group.WORLD
            if norm_type == math.inf:
                local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                            default=torch.zeros((), device=e.device))
                total = torch.as_tensor(local, dtype=torch.float32, device=e.device).reshape(1)
                total = self.guard.fold(total).nan_to_num(nan=math.inf)  # MAX of NaN is unordered
                C.all_reduce(total, world, name="world", op=dist.ReduceOp.MAX,
                             async_op=False, timeout=e.config.timeout)
                norm = total[0]
            else:
                # one fp32 norm per tensor, computed without an fp32 copy of the gradient
                total = torch.zeros(1, dtype=torch.float32, device=e.device)
                if grads:
                    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads]
                    total += torch.stack(norms).square().sum()
                total = self.guard.fold(total)
                C.all_reduce(total, world, name="world", async_op=False, timeout=e.config.timeout)
                # each optim group holds every gradient once: the world counts it world/sos times
                norm = (total[0] / (e.world.size // e.size("optim"))).sqrt()
            if self.scaler is not None:
                norm = norm / self.scaler.scale
            coef = float(max_norm) / (float(norm) + 1e-6)
            self._grad_coef = min(coef, 1.0) if math.isfinite(coef) else 1.0
            self.last_grad_norm = float(norm)
            self._found_inf = not math.isfinite(self.last_grad_norm)
            return norm

    @torch.no_grad()
    def step(self, closure: Callable | None = None):  # type: ignore[override]
        if closure is not None:
            raise ValueError("AMSPOptimizer.step does not take a closure")
        e = self._engine
        e.param_sync.wait_all()
        with record_function("amsp::optimizer_step"):
            checked = self.scaler is not None or self.guard.enabled
            if checked and self._found_inf is None:  # no clip this step: the guard needs the norm
                self.clip_grad_norm_(math.inf)
            found_inf, self._found_inf = self._found_inf, None
            if checked and found_inf:  # [amsp nonfinite] the same decision on every rank
                self._skip_step()
                return None
            self.guard.after_step(step=self.num_steps + self._skipped, bad=False, counts=False,
                                  ranks=None, norm=self.last_grad_norm, rank=e.rank)
            factor = self._grad_coef / (self.scaler.scale if self.scaler else 1.0)
            owned = self._owned_grads()
            for idx, m in self.masters.items():
                g = owned.get(idx)
                if g is None:
                    m.grad = None
                    continue
                g = g.to(torch.float32).view(m.shape)  # aliases the buffer under fp32
                if factor != 1.0:
                    g = g * factor
                m.grad = g
            self.inner.step()
            for idx, m in self.masters.items():
                if not self._aliased:
                    e.tensors[idx].local().copy_(m)
                m.grad = None
            self._grad_coef = 1.0
            if self.scaler is not None:
                self.scaler.update(False)
            self.num_steps += 1
        e.param_sync.broadcast_all()
        return None

    def _skip_step(self) -> None:
        """A non-finite step: nothing is applied, on any rank (see nonfinite.py)."""
        e = self._engine
        step = self.num_steps + self._skipped
        counts = self.scaler is None or self.scaler.scale <= self.scaler.cfg.min_scale
        if self.scaler is not None:
            self.scaler.update(True)
        self._skipped += 1
        self._grad_coef = 1.0
        e.grad_sync.zero_grad()
        ranks = None
        if self.guard.enabled and counts:  # rare: one small all-gather names the ranks
            flags = C.all_gather_bytes(b"1" if self.guard.loss_was_bad() else b"0", None, name="world",
                                       timeout=e.config.timeout)
            ranks = [r for r, f in enumerate(flags) if f == b"1"]
        if self.guard.enabled:
            self.guard.after_step(step=step, bad=True, counts=counts, ranks=ranks,
                                  norm=self.last_grad_norm, rank=e.rank)
        self.guard.reset_loss()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self._found_inf = None
        self.guard.reset_loss()
        self._engine.grad_sync.zero_grad()
        for m in self.masters.values():
            m.grad = None

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        e = self._engine
        return {
            "inner": self.inner.state_dict(),
            "tensors": [e.tensors[i].metadata() for i in self.masters],
            "masters": {e.tensors[i].name: m.detach().clone() for i, m in self.masters.items()},
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "plan": str(e.plan),
            "world": [e.world.num_nodes, e.world.gpus_per_node],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state saved under the same plan and world (collective: re-broadcasts)."""
        e = self._engine
        mine = [e.tensors[i].metadata() for i in self.masters]
        if state_dict.get("tensors") != mine:
            raise ValueError(
                f"optimizer state_dict was saved under plan {state_dict.get('plan')} on "
                f"{state_dict.get('world')} and owns other tensors than this rank under plan "
                f"{e.plan}; use amsp_ext.save_checkpoint / load_checkpoint to change plans"
            )
        for i, m in self.masters.items():
            m.copy_(state_dict["masters"][e.tensors[i].name])
            if not self._aliased:
                e.tensors[i].local().copy_(m)
        self.inner.load_state_dict(state_dict["inner"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        e.param_sync.broadcast_all()
        e.param_sync.wait_all()

    def state_bytes(self) -> tuple[int, int]:
        """(fp32 master bytes not aliased to the parameters, inner optimizer state bytes)."""
        master = 0 if self._aliased else sum(m.numel() * m.element_size() for m in self.masters.values())
        states = 0
        for st in self.inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    states += v.numel() * v.element_size()
        return master, states
