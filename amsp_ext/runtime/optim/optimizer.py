"""The optimizer a training loop sees: owners step their fp32 masters, then broadcast.

[Note: what each rank keeps]
A rank keeps fp32 master weights and the inner optimizer's states only for the local tensors
it owns (ownership.py); the inner optimizer (``optimizer_factory``) is built over those masters
alone, so ``param_groups`` (and LR schedulers) work as usual. With ``precision="fp32"`` the
master *is* the local parameter storage (a second Parameter object on the same memory), so no
copy and no extra 4 bytes per parameter. Owned gradients arrive in the reduce dtype
(ShardConfig.reduce_dtype): under "fp32" they are used as they are; a compute-dtype gradient
is upcast one tensor at a time (D_tmp, not model state). An optimizer that reads whole tensors
under a plan that shards their rows (sp > 1) keeps instead the whole fp32 masters of the
tensors it is whole owner of, and the rows of its owned shards beside them (``local_masters``;
whole_tensor.py [Note: whole-tensor optimizers on row shards]).

[Note: an Optimizer by torch's rules]
``AMSPOptimizer`` runs ``torch.optim.Optimizer.__init__`` over the inner optimizer's param
groups: the group dicts are shared (one object, reachable from both), and ``param_groups`` and
``state`` read through to the inner optimizer, so an LR scheduler that sets ``lr`` here sets it
where the step reads it, even after ``inner.load_state_dict`` replaced the group dicts. Because
``__init__`` ran, torch wraps ``step`` like every optimizer's: instance and global step
pre/post hooks fire around it, and schedulers see it called. ``state_dict``/``load_state_dict``
run their four hook kinds too. The inner optimizer is a real optimizer stepped from inside ours
(as ``ZeroRedundancyOptimizer`` does): a *global* hook therefore also sees the inner one;
filter on ``isinstance(opt, AMSPOptimizer)`` to count training steps. ``add_param_group`` is
refused: every parameter here is an owned master the engine laid out. Between ``step`` and
``zero_grad`` each master's ``.grad`` holds the (unscaled, clipped) fp32 gradient it was stepped
with, as in torch; ``zero_grad(set_to_none=False)`` zeroes those in place.

[Note: collaborators, not the engine]
The optimizer is given what it uses and nothing else: the local tensors (to write masters
back and describe them in a state dict), a gradient source (``owned``: the averaged gradients
of owned tensors after the boundary backward; ``zero_grad``), a parameter broadcaster
(``broadcast_all`` after the step, ``wait_all`` before anything reads parameters) and the
group over which gradient norms and overflow flags are reduced (``NormGroup``; ``group=None``:
this process holds every gradient, no collective). The engine passes its GradSync, ParamSync
and ``optim`` group; a unit test passes a local gradient source and no process group at all.

[Note: parameters current after step()]
Under optimizer-state sharding (sos > sp) a rank steps only the tensors it owns; the others
arrive by broadcast (param_sync.py). ``step()`` returns once they have landed, so whatever reads
the parameters afterwards - ``parameters()``, ``.data``, ``state_dict()``, an EMA or
``AveragedModel``, references taken before training - reads this step's values, as after
DeepSpeed ZeRO-1/2's step. A loop that reads no parameter between ``step()`` and its next
forward may leave the broadcasts in flight under that forward instead (the paper's broadcast
overlap: each unit's forward pre-hook waits for its own tensors):
``with opt.broadcast_under_next_forward(): opt.step()``. ``train_step`` (amsp train, compare,
tune, the dry run) does; the reads that then still wait are the units' forward pre-hooks,
``state_dict()`` and the checkpoint and plan-switch paths (``model.amsp.wait_params()``).
A second ``step()`` or a ``load_state_dict`` waits first as well.

[Note: exact global clipping]
The ``optim`` group (sos ranks = sp shard positions x sos/sp owners) holds every local tensor of
the model exactly once across its ranks, so the sum of squares of owned gradients over one
``optim`` group is the global squared norm. The engine has it all-reduced over the world (every
``optim`` group contributes the same sum: ``NormGroup.replicas`` = world / sos divides it back)
so that the non-finite guard's decision, which rides on it, is one for all ranks
(nonfinite.py). The clip coefficient is applied to the fp32 gradients at step time (with the
fp16 loss-scale division).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import FP16Config
from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.optim.loss_scale import DynamicLossScaler
from amsp_ext.runtime.optim.nonfinite import NonFiniteGuard
from amsp_ext.runtime.optim.whole_tensor import WholeTensors
from amsp_ext.topology.mesh import GroupHandle

__all__ = ["AMSPOptimizer", "GradSource", "NormGroup", "ParamBroadcaster", "StepBoundary"]


class GradSource(Protocol):
    """The averaged gradients of owned tensors (tensor index -> local-shaped tensor)."""

    owned: Mapping[int, torch.Tensor]

    def collect(self) -> Mapping[int, torch.Tensor]:
        """``owned`` as the loop left it (a ``.grad`` it replaced or dropped taken in), or a
        one-line error where no gradient can be stepped."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class ParamBroadcaster(Protocol):
    def broadcast_all(self) -> None: ...

    def wait_all(self) -> None: ...


class StepBoundary(Protocol):
    """What runs at the step boundary (runtime/replan/adaptive.py AdaptiveRun): a decision at the
    end of ``step()``, a switch it decided in the next ``zero_grad()``."""

    def at_step_end(self) -> None: ...

    def switch_if_decided(self, optimizer: "AMSPOptimizer") -> None: ...


@dataclass(frozen=True, kw_only=True)
class NormGroup:
    """Where gradient norms (and the non-finite decision riding on them) are reduced (None:
    this process alone); ``replicas``: how many times the group holds each gradient (its sum of
    squares is divided by it). ``reduce=False``: every rank holds every gradient, the same on
    each, so the norm is local; the group then only names the bad ranks of a skipped step
    (nonfinite.py [Note: one decision, on the norm all-reduce])."""

    group: GroupHandle | None = None
    replicas: int = 1
    reduce: bool = True
    comm: C.CollectiveContext | None = None  # the engine's (collectives.py); needed with a group

    def __post_init__(self) -> None:
        if self.group is not None and self.comm is None:
            raise ValueError("NormGroup: a group needs the engine's collective context (comm=)")

    @property
    def name(self) -> str:
        return "local" if self.group is None else self.group.name


class AMSPOptimizer(torch.optim.Optimizer):
    def __init__(self, masters: Mapping[int, nn.Parameter],
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 tensors: Sequence[LocalTensor], grads: GradSource, params: ParamBroadcaster,
                 norm_group: NormGroup, device: torch.device, precision: str,
                 fp16: FP16Config | None = None, run_info: Mapping[str, Any] | None = None,
                 guard: NonFiniteGuard | None = None, adaptive: StepBoundary | None = None,
                 kind: str = "elementwise", whole: WholeTensors | None = None,
                 step_costs: Mapping[str, int] | None = None) -> None:
        self.masters = dict(masters)  # tensor index -> fp32 master (owned only), forward order
        self.tensors = list(tensors)
        # optim/kinds.py; ``whole``: the masters are whole tensors stepped by their whole owner
        # (optim/whole_tensor.py [Note: whole-tensor optimizers on row shards]); ``step_costs``:
        # the inner optimizer's work per parameter name, which its owners are balanced by
        self.kind, self.whole = kind, whole
        self.step_costs = dict(step_costs or {})
        self._tp_replicas = _tp_replicas(self.tensors)
        self._grads, self._params, self._norm_group = grads, params, norm_group
        self.device = device
        self._aliased_dtype = precision == "fp32"
        self._aliased = self._aliased_dtype and whole is None  # masters share the parameters' storage
        self.run_info = dict(run_info or {})  # plan / world, saved in and checked by state dicts
        owned = list(self.masters.values())
        if not owned:  # a rank that owns nothing still has param_groups for schedulers
            owned = [nn.Parameter(torch.zeros(0, device=device))]
        self._factory = optimizer_factory
        inner = optimizer_factory(owned)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"optimizer_factory must return a torch.optim.Optimizer, got {type(inner).__name__}")
        self.inner = inner
        self._constructed = False
        # the list object, not a copy: __init__ rebinds inner.param_groups (through our setter)
        # and then adds these same dicts back one by one
        super().__init__(inner.param_groups, inner.defaults)
        self._constructed = True
        self.scaler = DynamicLossScaler(fp16 or FP16Config()) if precision == "fp16" else None
        self._grad_coef = 1.0
        self.last_grad_norm: float | None = None
        # set by clip_grad_norm_: a non-finite global norm is exactly "some gradient overflowed",
        # so step() needs no second all-reduce (and no per-tensor isfinite sync) to find out
        self._found_inf: bool | None = None
        self.num_steps = 0
        self._defer_params = False  # [Note: parameters current after step()]
        # runtime/replan/adaptive.AdaptiveRun with ShardConfig.adaptive ([Note: where a switch
        # happens] there): step() ends with its decision, zero_grad() carries out a switch
        self.adaptive = adaptive
        self.guard = guard or NonFiniteGuard(max_bad_steps=0)  # nonfinite.py (0: off)
        self._skipped = 0

    def rebind(self, masters: Mapping[int, nn.Parameter], *, tensors: Sequence[LocalTensor],
               grads: GradSource, params: ParamBroadcaster, norm_group: NormGroup,
               run_info: Mapping[str, Any], whole: WholeTensors | None = None) -> None:
        """[Note: the same optimizer under another plan]
        ``switch_plan`` (runtime/replan/switch.py) gives this object another plan's owned masters and
        collaborators. It stays the object the user's loop and LR scheduler hold: its hooks,
        step counter, loss scaler and guard are kept; the inner optimizer is rebuilt over the
        new masters by the same ``optimizer_factory`` (so param groups come out the same way),
        and ``param_groups``/``state`` read through to it as before. The caller loads the
        states and hyper-parameters into ``inner`` afterwards."""
        owned = list(masters.values())
        if not owned:
            owned = [nn.Parameter(torch.zeros(0, device=self.device))]
        inner = self._factory(owned)
        if type(inner) is not type(self.inner):
            raise ValueError(f"optimizer_factory built a {type(inner).__name__} after a plan switch, "
                             f"{type(self.inner).__name__} before")
        self.masters, self.tensors = dict(masters), list(tensors)
        self._aliased = self._aliased_dtype and whole is None
        self.whole = whole
        self._tp_replicas = _tp_replicas(self.tensors)
        self._grads, self._params, self._norm_group = grads, params, norm_group
        self.run_info = dict(run_info)
        self.inner = inner
        self._grad_coef, self._found_inf = 1.0, None

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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructed:
            raise ValueError("AMSPOptimizer.add_param_group: the parameters are the owned fp32 masters "
                             "the engine laid out; build param groups in optimizer_factory instead")
        super().add_param_group(param_group)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (fp16 overflows and non-finite steps)."""
        return self._skipped

    @property
    def norm_is_local(self) -> bool:
        """The gradient norm takes no all-reduce (every rank holds every gradient; nonfinite.py
        [Note: one decision, on the norm all-reduce])."""
        return not self._norm_group.reduce

    def __repr__(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.run_info.items())
        return f"AMSPOptimizer({where + ', ' if where else ''}owned={len(self.masters)}, inner={self.inner!r})"

    # -- training loop ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the dynamic loss scale under fp16."""
        self.guard.note_loss(loss)  # [amsp nonfinite] lazy flag, no sync
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        g = self._norm_group
        if g.group is not None and g.reduce:
            C.all_reduce(g.comm, t, g.group.pg, name=g.group.name, stream=None, op=op, async_op=False,
                         timeout=g.group.timeout)  # blocking, on the step's (current) stream

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm (of the unscaled, averaged gradients); clip to ``max_norm``."""
        if norm_type not in (2.0, 2, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
        with compat.label(f"amsp::clip_grad_norm::{self._norm_group.name.split('[', 1)[0]}"):
            owned = self._grads.collect()
            grads = list(owned.values())
            if norm_type == math.inf:
                local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                            default=torch.zeros((), device=self.device))
                total = torch.as_tensor(local, dtype=torch.float32, device=self.device).reshape(1)
                # [amsp nonfinite] this rank's loss verdict folded in; MAX of NaN is unordered
                total = self.guard.fold(total).nan_to_num(nan=math.inf)
                self._all_reduce(total, op=dist.ReduceOp.MAX)
                norm = total[0]
            else:
                # one fp32 norm per tensor, computed without an fp32 copy of the gradient
                total = torch.zeros(1, dtype=torch.float32, device=self.device)
                if grads:
                    norms = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
                                         for g in grads]).square()
                    if self._tp_replicas:  # tensor_parallel.py [Note: TP shards and replicated parameters]
                        reps = [self._tp_replicas.get(i, 1) for i in owned]
                        norms = norms / torch.tensor(reps, dtype=torch.float32, device=norms.device)
                    total += norms.sum()
                total = self.guard.fold(total)  # [amsp nonfinite] NaN if this rank's loss was
                self._all_reduce(total)
                norm = (total[0] / self._norm_group.replicas).sqrt()
            if self.scaler is not None:
                norm = norm / self.scaler.scale
            coef = float(max_norm) / (float(norm) + 1e-6)
            self._grad_coef = min(coef, 1.0) if math.isfinite(coef) else 1.0
            self.last_grad_norm = float(norm)
            self._found_inf = not math.isfinite(self.last_grad_norm)
            return norm

    @contextlib.contextmanager
    def broadcast_under_next_forward(self):
        """``step()`` inside returns with the parameter broadcasts in flight; the next forward's
        pre-hooks wait for them ([Note: parameters current after step()]). For loops that read
        no parameter between ``step()`` and that forward."""
        prev, self._defer_params = self._defer_params, True
        try:
            yield
        finally:
            self._defer_params = prev

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        if not self._defer_params:  # [Note: parameters current after step()]
            self._params.wait_all()
        if self.adaptive is not None:  # a step boundary, skipped step or not
            self.adaptive.at_step_end()
        return loss

    def _step(self) -> None:
        self._params.wait_all()
        with compat.label("amsp::optimizer_step"):
            checked = self.scaler is not None or self.guard.enabled
            if checked and self._found_inf is None:  # no clip this step: the guard needs the norm
                self.clip_grad_norm_(math.inf)
            found_inf, self._found_inf = self._found_inf, None
            if checked and found_inf:  # [amsp nonfinite] the same decision on every rank
                self._skip_step()
                return
            self.guard.after_step(step=self.num_steps + self._skipped, bad=False, counts=False,
                                  ranks=None, norm=self.last_grad_norm, rank=_rank())
            factor = self._grad_coef / (self.scaler.scale if self.scaler else 1.0)
            owned = self._grads.collect()
            if self.whole is not None:  # row shards in, whole fp32 gradients of my whole masters out
                owned = self.whole.gather(owned)
            for idx, m in self.masters.items():
                g = owned.get(idx)
                if g is None:
                    m.grad = None
                    continue
                # fp32 already (reduce_dtype="fp32", or an fp32 run): no copy, scaled in place
                g = g.to(torch.float32).view(m.shape)
                if factor != 1.0:
                    g.mul_(factor)
                m.grad = g
            self.inner.step()
            self._write_back()
            self._grad_coef = 1.0
            if self.scaler is not None:
                self.scaler.update(False)
            self.num_steps += 1
        self._params.broadcast_all()

    def _write_back(self) -> None:
        """The stepped masters into the local parameters this rank holds."""
        if self.whole is not None:
            self.whole.scatter(self.masters, self.tensors)
        elif not self._aliased:
            for idx, m in self.masters.items():
                self.tensors[idx].local().copy_(m)

    @property
    def local_masters(self) -> dict[int, torch.Tensor]:
        """This rank's fp32 masters shaped like its local tensors (tensor index -> rows): the
        masters themselves, or, with whole masters, the rows kept beside them."""
        return self.whole.rows if self.whole is not None else self.masters

    @property
    def mixed_precision(self) -> bool:
        """fp32 masters are kept apart from the parameters (bf16 / fp16 runs)."""
        return not self._aliased_dtype

    def _master_metadata(self, idx: int) -> dict:
        meta = self.tensors[idx].metadata()
        if self.whole is not None:  # a whole master: the global tensor, not this rank's rows
            meta.update(local_shape=list(meta["global_shape"]), shard_index=0, whole=True)
        return meta

    def _skip_step(self) -> None:
        """A non-finite step: nothing is applied, on any rank (see nonfinite.py)."""
        step = self.num_steps + self._skipped
        counts = self.scaler is None or self.scaler.scale <= self.scaler.cfg.min_scale
        if self.scaler is not None:
            self.scaler.update(True)
        self._skipped += 1
        self._grad_coef = 1.0
        self._grads.zero_grad()
        ranks = None
        g = self._norm_group
        if self.guard.enabled and counts and g.group is not None:  # rare: name the ranks
            flags = C.all_gather_bytes(g.comm, b"1" if self.guard.loss_was_bad() else b"0", g.group.pg,
                                       name=g.group.name, timeout=g.group.timeout)
            ranks = [r for r, f in enumerate(flags) if f == b"1"]
        if self.guard.enabled:
            self.guard.after_step(step=step, bad=True, counts=counts, ranks=ranks,
                                  norm=self.last_grad_norm, rank=_rank())
        self.guard.reset_loss()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self._zero_grad(set_to_none)
        if self.adaptive is not None:  # no gradient pending: the one place a switch may run
            self.adaptive.switch_if_decided(self)

    def _zero_grad(self, set_to_none: bool) -> None:
        with compat.label("amsp::zero_grad"):
            self._found_inf = None
            self.guard.reset_loss()
            self._grads.zero_grad(set_to_none)
            for m in self.masters.values():
                if m.grad is None:
                    continue
                if set_to_none:
                    m.grad = None
                else:
                    m.grad.zero_()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout (``state``, ``param_groups`` of the inner optimizer, over this rank's
        owned masters) plus ``amsp``: the masters, their tensors, the loss scaler and the step."""
        for hook in compat.optimizer_hooks(self, "state_dict_pre"):
            hook(self)
        inner = self.inner.state_dict()
        sd = {
            "state": inner["state"],
            "param_groups": inner["param_groups"],
            "amsp": {
                "tensors": [self._master_metadata(i) for i in self.masters],
                "masters": {self.tensors[i].name: m.detach().clone() for i, m in self.masters.items()},
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "num_steps": self.num_steps,
                **self.run_info,
            },
        }
        for hook in compat.optimizer_hooks(self, "state_dict_post"):
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state saved under the same plan and world (collective: re-broadcasts)."""
        for hook in compat.optimizer_hooks(self, "load_state_dict_pre"):
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        a = state_dict.get("amsp") if isinstance(state_dict, Mapping) else None
        mine = [self._master_metadata(i) for i in self.masters]
        if a is None or a.get("tensors") != mine:
            saved = {k: v for k, v in (a or {}).items() if k not in ("tensors", "masters", "scaler")}
            raise ValueError(
                f"optimizer state_dict was saved with {saved or 'no AMSP layout'} and owns other "
                f"tensors than this rank with {self.run_info}; use amsp_ext.save_checkpoint / "
                f"load_checkpoint to change plans"
            )
        for i, m in self.masters.items():
            m.copy_(a["masters"][self.tensors[i].name])
        self._write_back()
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        if self.scaler is not None and a.get("scaler"):
            self.scaler.load_state_dict(a["scaler"])
        self.num_steps = int(a.get("num_steps", self.num_steps))
        self._params.broadcast_all()
        self._params.wait_all()
        for hook in compat.optimizer_hooks(self, "load_state_dict_post"):
            hook(self)

    def state_bytes(self) -> tuple[int, int]:
        """(fp32 master bytes not aliased to the parameters, inner optimizer state bytes)."""
        master = 0 if self._aliased else sum(m.numel() * m.element_size() for m in self.masters.values())
        if self.whole is not None and not self._aliased_dtype:  # the fp32 rows kept beside them
            master += sum(r.numel() * r.element_size() for r in self.whole.rows.values())
        states = 0
        for st in self.inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    states += v.numel() * v.element_size()
        return master, states


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _tp_replicas(tensors: Sequence[LocalTensor]) -> dict[int, int]:
    """Tensor index -> how many ranks of its TP group hold it whole, for those held by more than
    one (empty without tensor parallelism, so clipping does no per-step work for it)."""
    return {t.index: t.tp_replicas for t in tensors if t.tp_replicas > 1}
