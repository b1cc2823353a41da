"""``deepspeed.zero.GatheredParameters`` over AMSP parameters (patches/deepspeed_gathered_parameters.py
routes it here).

[Note: GatheredParameters under AMSP]
Post-training code gathers ZeRO-3 weights with ``with GatheredParameters(params,
modifier_rank=r):`` to read them whole (weight syncs to an inference engine, generation, custom
init) and, given ``modifier_rank``, to write them: on exit rank r's values must reach every rank.
DeepSpeed's own class only acts on its ZeRO parameters (``ds_id``): on AMSP's it was a silent
no-op, so a read met the sharded DTensor and a write on rank 0 reached rank 0's shard alone, or
failed inside DTensor, and nothing reached the optimizer's fp32 masters (the next step wrote the
old weights back). Under AMSP:

- Enter (collective over the engine's ranks: every rank enters with the same parameters, in
  the same order, as with DeepSpeed). Pending post-step broadcasts are waited for. With
  sp > 1 every FSDP unit holding a listed parameter that is not gathered yet is unsharded by
  FSDP2 itself (``FSDPModule.unshard``): one all-gather per unit, all issued before the first
  wait, so a list or the whole model costs one collective per unit, and a nested context over
  gathered units costs none. The units keep their gathered weights through forwards run
  inside (their reshard-after-forward is off, and a forward-only engine's outer units are not
  released), so ``model.generate`` inside one context over all parameters gathers once, not
  once per token. With sp = 1 every rank holds every parameter whole: nothing is gathered.
- Inside, the modules' attributes (``module.weight``, ``model.named_parameters()``,
  ``state_dict``-free reads) are the full tensors in the compute dtype. A handle to the sharded
  parameter taken before entering stays the DTensor object, but its ``.data`` and conversions
  read the full tensor ([Note: a handle taken before entering]).
- Exit with ``modifier_rank``: one all-reduce of three flag rows (which parameters the modifier
  changed, which it changed to another shape, which any rank wrote through a sharded handle),
  so every rank takes the same branch; then one broadcast per dtype of the changed full
  tensors from the modifier. Each rank writes its rows into its shard (and into the gathered
  weight where the unit stays gathered), and the rank owning a changed tensor's fp32 master
  writes it there (whole-tensor optimizers refresh their whole masters from those rows), so the
  next ``step()`` starts from the change. Changes made on other ranks are dropped, as in
  DeepSpeed. Only changed tensors move and reach the masters: a context used only to read
  leaves the masters' fp32 bits alone under bf16.
- Exit without ``modifier_rank``: no collective. A write there would be lost on exit (DeepSpeed
  drops it silently); it is refused with one line naming the parameter, on the rank that wrote.
- The units gathered on enter are resharded on exit, and their reshard-after-forward restored;
  units that were already gathered stay as they were.

[Note: a handle taken before entering]
Weight syncs to an inference engine (OpenRLHF, verl) take the handle first and gather it after:
``for name, p in model.named_parameters(): with GatheredParameters([p]): broadcast(p.data, 0)``
or ``vllm.update_weight(name, p.data)``. Under ZeRO-3 ``p.data`` is then the full tensor. Under
AMSP with sp > 1 ``p`` is FSDP2's sharded DTensor, and the gathered weight is another object
(the module's attribute). Found on 2 ranks, p=2x1 (before this): ``p.data``, ``p.detach()``,
``p.cpu()`` are DTensors of the global shape holding this rank's rows; ``broadcast(p.data)``
raised "c10d.broadcast_.default does not have a sharding strategy registered", ``.numpy()`` and
a safetensors save raised, ``torch.equal`` with a plain tensor raised, ``p.full_tensor()`` was
right (one more all-gather), ``p.data.to_local()`` the shard. Nothing named the parameter.

So, for the context's lifetime, each listed sharded handle gets a subclass of DTensor
(``__class__`` swapped on enter, restored on exit; ``isinstance(p, DTensor)`` holds throughout)
whose ``__torch_function__`` answers ``.data``, ``.detach()``, ``.cpu()``, ``.to()``,
``.clone()``, ``.contiguous()`` and ``.float()``/``.half()``/``.bfloat16()`` from the gathered
full tensor, as DeepSpeed's parameter does; every other operation stays DTensor's (global
values, or DTensor's own error), and DTensor's methods (``to_local``, ``full_tensor``) keep
answering for the shard. Not ``.numpy()``: it shares the gathered storage, which FSDP2 then
cannot free on exit ("Trying to resize storage that is not resizable"; the same happens to
``module.weight.data.numpy()``); DTensor refuses it ("not supported for tensor subclasses"). A write through ``p.data`` is then a write to the gathered weight,
the same as one through ``module.weight`` (kept with ``modifier_rank``, refused without); an
in-place op on the handle itself still reaches only the rank's rows and is refused on exit
(``_STALE``). FSDP2 and the engine read the handle only through attributes (``.grad``,
``_local_tensor``, ``_version``) and DTensor methods, which pass through unchanged. When the
unit was resharded inside the context (a ``state_dict`` call), the full tensor is gone and the
handle is DTensor again. With sp = 1 the handle is the full parameter: nothing to do.

[Note: what counts as a write]
In-place counters (``Tensor._version``) do not see the commonest write, ``p.data.copy_(x)``:
``.data`` is an alias with a counter of its own. So the modifier keeps a copy of each listed
full tensor from enter to exit (one rank, the listed tensors' size) and a tensor counts as
changed when its module attribute was replaced or it no longer equals that copy. Without a
modifier nothing is copied: a write is found by the counters and, with sp > 1, by comparing
the rank's rows of the full tensor with its untouched shard (a write that misses the rank's
rows, or a ``.data`` write under sp = 1, goes unseen there). A write through a sharded handle
is found by its counters, and on the modifier by comparing its shard with its copy.

Refused in one line naming the parameter: ZeRO parameters mixed with AMSP ones, ``fwd_module``
(registering external parameters of another module's forward), tensor parallelism, a changed
shape (``resize_token_embeddings`` must run before ``deepspeed.initialize``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C

__all__ = ["AMSPGathered", "amsp_gathered"]

WORLD = "world"  # the label of the default group (engine.py's norm group names it the same)
_MODIFIED, _RESHAPED, _STALE = range(3)  # rows of the exit flags
_OPEN: list[AMSPGathered] = []  # contexts entered and not yet exited, innermost last


@dataclasses.dataclass(eq=False, kw_only=True)
class Target:
    """One listed parameter of one engine, and what enter saw of it."""

    name: str
    param: nn.Parameter  # the engine's parameter (the sharded DTensor when sp > 1)
    home: tuple[nn.Module, str]  # where the model keeps it
    unit: nn.Module | None  # its FSDP unit (sp > 1)
    fsdp_param: object | None  # its FSDPParam (sp > 1)
    tensor: object | None  # its LocalTensor (None: frozen, or a forward-only engine)
    held: torch.Tensor | None = None  # the module attribute after enter (the full tensor)
    versions: tuple[int, int, int] = (0, 0, 0)  # in-place counters: held, param, its local rows
    # the modifier's copy of the full tensor at enter ([Note: what counts as a write])
    snapshot: torch.Tensor | None = None

    def attribute(self) -> torch.Tensor:
        return getattr(*self.home)


# the reads a gathered handle answers from the full tensor ([Note: a handle taken before entering])
_FULL_READS = frozenset({torch.Tensor.data.__get__, torch.Tensor.detach, torch.Tensor.cpu, torch.Tensor.to,
                         torch.Tensor.clone, torch.Tensor.contiguous, torch.Tensor.float, torch.Tensor.half,
                         torch.Tensor.bfloat16})
_TARGET = "_amsp_gathered_target"  # the handle's Target while its class is _GatheredHandle


class _GatheredHandle(DTensor):
    """A sharded parameter's class inside a context ([Note: a handle taken before entering])."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FULL_READS and args and type(args[0]) is cls:
            t = args[0].__dict__.get(_TARGET)
            if t is not None and t.held is not None and compat.fsdp_unit_state(t.unit)[0]:
                return func(t.held, *args[1:], **kwargs)
        return DTensor.__torch_function__(func, types, args, kwargs)  # DTensor's: torch function off


def _engines():
    from amsp_ext.runtime.engine import Engine

    return list(Engine.live)


def _index(engine) -> dict[int, Target]:
    """id(parameter object) -> Target, for the sharded parameter and, with sp > 1, its gathered
    one (a module attribute read inside an outer context)."""
    model = engine.units[0].module  # the root unit is the model
    tensors = {t.name: t for t in engine.tensors}
    out: dict[int, Target] = {}
    for u in engine.units:
        fsdp = {id(fp.sharded_param): fp for fp in compat.fsdp_params_of(u.module)} if (
            engine.plan.sp > 1 and u.params) else {}
        for name, p in u.params:
            fp = fsdp.get(id(p))
            home = compat.fsdp_param_home(fp) if fp is not None else _home(model, name)
            t = Target(name=name, param=p, home=home, unit=u.module if fp is not None else None,
                       fsdp_param=fp, tensor=tensors.get(name))
            out[id(p)] = t
            full = compat.fsdp_unsharded_param(fp) if fp is not None else None
            if full is not None:
                out[id(full)] = t
    return out


def _home(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def _check_supported(engine, t: Target, fwd_module) -> None:
    if fwd_module is not None:
        raise ValueError(f"GatheredParameters: fwd_module is not supported for AMSP parameter {t.name!r} "
                         f"(its unit is gathered for the whole context; read it inside the context)")
    if engine.world.tensor_parallel > 1:
        raise ValueError(f"GatheredParameters: AMSP parameter {t.name!r} is split by tensor parallelism "
                         f"(tensor_parallel={engine.world.tensor_parallel}); gathering it is not supported")


def _resolve(params: list, fwd_module) -> list[tuple[object, list[Target]]]:
    """The AMSP parameters among ``params``, by engine in first-listed order (the same on every
    rank), each engine's in forward order; [] when there is none."""
    engines = _engines()
    if not engines:
        return []
    indexes = [(e, _index(e)) for e in engines]
    found: dict[int, tuple[object, dict[str, Target]]] = {}
    ds_param = None
    for p in params:
        hit = next(((e, ix[id(p)]) for e, ix in indexes if id(p) in ix), None)
        if hit is None:
            ds_param = ds_param or (p if hasattr(p, "ds_id") else None)
            continue  # not sharded by anyone: already whole, as DeepSpeed leaves it
        e, t = hit
        _check_supported(e, t, fwd_module)
        found.setdefault(id(e), (e, {}))[1].setdefault(t.name, t)
    if found and ds_param is not None:
        raise ValueError(f"GatheredParameters: DeepSpeed ZeRO parameter (ds_id {ds_param.ds_id}) listed "
                         f"with AMSP parameters; gather them in separate contexts")
    order = {t.name: i for e, _ in found.values() for i, t in enumerate(e.tensors)}
    return [(e, sorted(ts.values(), key=lambda t: order.get(t.name, -1))) for e, ts in found.values()]


def amsp_gathered(params: Iterable, modifier_rank: int | None, fwd_module=None) -> AMSPGathered | None:
    """The AMSP context for ``params`` (already a list), or None when none is an AMSP parameter
    (DeepSpeed's own class then handles them)."""
    groups = _resolve(list(params), fwd_module)
    if not groups:
        return None
    world = dist.get_world_size()
    if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
        raise ValueError(f"GatheredParameters: modifier_rank must be a rank in [0, {world}) or None, "
                         f"got {modifier_rank!r}")
    return AMSPGathered(groups, modifier_rank)


class AMSPGathered:
    """Enter / exit of one ``GatheredParameters`` over AMSP parameters ([Note: GatheredParameters
    under AMSP])."""

    def __init__(self, groups: list[tuple[object, list[Target]]], modifier_rank: int | None) -> None:
        self.groups = groups
        self.src = modifier_rank
        self._gathered: list[nn.Module] = []  # units this context unsharded
        self._kept: list[tuple[nn.Module, bool]] = []  # (unit, its reshard-after-forward before)
        self._held_outer: list[tuple[object, nn.Module]] = []
        self._swapped: list[torch.Tensor] = []  # handles this context made _GatheredHandle

    # -- enter -------------------------------------------------------------------------------
    def enter(self) -> None:
        with record_function("amsp::gathered_parameters::enter"):
            for engine, targets in self.groups:
                engine.wait_params()  # a post-step broadcast still in flight would land later
                if engine.plan.sp > 1:
                    self._gather(engine, targets)
                for t in targets:
                    _see(t, keep=self.src == dist.get_rank())
                    self._swap_handle(t)
        _OPEN.append(self)

    def _swap_handle(self, t: Target) -> None:
        """The sharded handle reads the full tensor while this context is open (an enclosing
        context over the same parameter already did it)."""
        if t.fsdp_param is None or type(t.param) is not DTensor or t.held is t.param:
            return
        t.param.__dict__[_TARGET] = t
        t.param.__class__ = _GatheredHandle
        self._swapped.append(t.param)

    def _gather(self, engine, targets: list[Target]) -> None:
        units = list({id(t.unit): t.unit for t in targets}.values())
        todo = [m for m in units if not compat.fsdp_unit_state(m)[0]]
        # all issued before the first wait: one all-gather per unit, overlapping
        handles = [m.unshard(async_op=True) for m in todo]  # type: ignore[operator]
        for h in handles:
            if h is not None:
                h.wait()
        self._gathered += todo
        for m in units:  # [Note: GatheredParameters under AMSP]: gathered through forwards inside
            self._kept.append((m, compat.fsdp_unit_state(m)[1]))
            m.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            if engine.outer_gather is not None:
                engine.outer_gather.keep(m)
                self._held_outer.append((engine.outer_gather, m))

    # -- exit --------------------------------------------------------------------------------
    def exit(self, failed: bool) -> None:
        try:
            if not failed:
                with record_function("amsp::gathered_parameters::exit"):
                    for engine, targets in self.groups:
                        if self.src is None:
                            _refuse_writes(targets)
                        else:
                            self._write_back(engine, targets)
        finally:
            if self in _OPEN:
                _OPEN.remove(self)
            self._release()

    def _release(self) -> None:
        for p in reversed(self._swapped):  # DTensor again before FSDP2 reshards
            p.__class__ = DTensor
            p.__dict__.pop(_TARGET, None)
        self._swapped = []
        for _, targets in self.groups:  # a write dropped or refused leaves the engine's objects
            for t in targets:
                _put_back(t)
        for og, m in reversed(self._held_outer):
            og.release(m)
        for m, before in reversed(self._kept):
            m.set_reshard_after_forward(before, recurse=False)  # type: ignore[operator]
        for m in self._gathered:
            m.reshard()  # type: ignore[operator]
        self._held_outer, self._kept, self._gathered = [], [], []

    def _write_back(self, engine, targets: list[Target]) -> None:
        rank = dist.get_rank()
        flags = torch.zeros(3, len(targets), dtype=torch.int32, device=engine.device)
        for i, t in enumerate(targets):
            flags[_STALE, i] = int(_wrote_sharded(t))
            if rank == self.src and _modified(t):
                flags[_MODIFIED, i] = 1
                flags[_RESHAPED, i] = int(tuple(t.attribute().shape) != tuple(t.param.shape))
        # one decision on every rank before anything moves: MAX over all ranks
        C.all_reduce(engine.comm, flags, None, name=WORLD, stream=None, op=dist.ReduceOp.MAX,
                     async_op=False)
        _raise_flagged(targets, flags, self.src)
        changed = [t for i, t in enumerate(targets) if flags[_MODIFIED, i]]
        for dtype in dict.fromkeys(t.param.dtype for t in changed):
            self._broadcast_into(engine, [t for t in changed if t.param.dtype == dtype], dtype, rank)
        opt = engine.optimizer
        if opt is not None and opt.whole is not None and any(t.tensor is not None for t in changed):
            opt.whole.refresh_masters()  # the whole masters from the rows just written (collective)

    def _broadcast_into(self, engine, changed: list[Target], dtype: torch.dtype, rank: int) -> None:
        flat = torch.empty(sum(t.param.numel() for t in changed), dtype=dtype, device=engine.device)
        if rank == self.src:
            off = 0
            for t in changed:
                n = t.param.numel()
                flat[off: off + n].copy_(t.attribute().detach().reshape(-1))
                off += n
        C.broadcast(engine.comm, flat, self.src, None, name=WORLD, stream=None, async_op=False)
        off = 0
        for t in changed:
            n = t.param.numel()
            _store(engine, t, flat[off: off + n].view(t.param.shape), rank)
            off += n
        _resync(changed)


def _versions(t: Target) -> tuple[int, int, int]:
    return (compat.tensor_version(t.held), compat.tensor_version(t.param),
            compat.tensor_version(compat.dtensor_local(t.param)))


def _see(t: Target, keep: bool) -> None:
    """What enter saw of ``t``; ``keep``: this rank is the modifier (its snapshot)."""
    t.held = t.attribute()
    t.versions = _versions(t)
    t.snapshot = t.held.detach().clone() if keep else None


def _rows(t: Target, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``full`` (the whole tensor when the parameter is not sharded)."""
    shape, offset = compat.local_chunk(t.param)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def _modified(t: Target) -> bool:
    """The modifier's full tensor differs from what it gathered (snapshot kept on enter)."""
    cur = t.attribute()
    if cur is t.param and t.held is not t.param:
        return False  # its unit was resharded inside (a state_dict call): no full value is left
    if cur is not t.held or t.snapshot is None:
        return True
    return tuple(cur.shape) != tuple(t.snapshot.shape) or not torch.equal(cur.detach(), t.snapshot)


def _wrote_sharded(t: Target) -> bool:
    """sp > 1: written through the sharded handle (its local rows), which reaches this rank's
    rows alone: refused. The in-place counters see a write on the handle; the modifier also
    compares its rows with its snapshot (a write through ``.data`` moves no counter)."""
    if t.fsdp_param is None:
        return False
    if _versions(t)[1:] != t.versions[1:]:
        return True
    local = compat.dtensor_local(t.param)
    return t.snapshot is not None and not torch.equal(local, _rows(t, t.snapshot))


def _raise_flagged(targets: list[Target], flags: torch.Tensor, src: int | None) -> None:
    for i, t in enumerate(targets):
        if flags[_STALE, i]:
            raise RuntimeError(
                f"GatheredParameters: AMSP parameter {t.name!r} was written through its sharded "
                f"handle (a DTensor taken before the context), which reaches this rank's rows only; "
                f"write through its .data or the module's attribute (e.g. module.weight) inside "
                f"the context, which hold the full tensor")
        if flags[_RESHAPED, i]:
            raise ValueError(
                f"GatheredParameters: AMSP parameter {t.name!r} changed shape on rank {src} "
                f"({tuple(t.param.shape)} -> another); resizing a sharded parameter is not supported "
                f"(resize before deepspeed.initialize)")


def _refuse_writes(targets: list[Target]) -> None:
    for t in targets:
        if _wrote_sharded(t) or _written_without_modifier(t):
            raise RuntimeError(
                f"GatheredParameters: AMSP parameter {t.name!r} was written inside a context "
                f"without modifier_rank, so the write would be lost on exit; pass modifier_rank "
                f"(the rank whose values every rank then takes)")


def _written_without_modifier(t: Target) -> bool:
    """No snapshot is kept without a modifier: the attribute replaced, its counter moved, or
    (sp > 1) this rank's rows of the full tensor no longer equal its shard."""
    cur = t.attribute()
    if cur is t.param and t.held is not t.param:
        return False  # its unit was resharded inside: nothing left to compare
    if cur is not t.held or _versions(t)[0] != t.versions[0]:
        return True
    return t.fsdp_param is not None and not torch.equal(_rows(t, cur.detach()), compat.dtensor_local(t.param))


def _put_back(t: Target) -> None:
    """A module attribute replaced inside the context: the engine's own object goes back (its
    hooks, FSDP2 and the optimizer know that one)."""
    cur = t.attribute()
    if t.held is not None and cur is not t.held and cur is not t.param:
        setattr(*t.home, t.held)


@torch.no_grad()
def _store(engine, t: Target, full: torch.Tensor, rank: int) -> None:
    """The modifier's full tensor into this rank's copy of ``t``: its shard (sp > 1), the
    gathered weight where its unit stays gathered, the module attribute, the owner's master."""
    _put_back(t)
    local = compat.dtensor_local(t.param)
    local.copy_(_rows(t, full))
    if t.held is not None and t.held is not t.param and compat.fsdp_unit_state(t.unit)[0]:
        t.held.data.copy_(full)
    opt = engine.optimizer
    if t.tensor is None or opt is None or t.tensor.owner_rank != rank:
        return
    master = opt.local_masters[t.tensor.index]
    if master.data_ptr() != local.data_ptr():  # under fp32 the master is the local storage
        master.data.copy_(local.reshape(master.shape))


def _resync(written: list[Target]) -> None:
    """After a write-back: what every open context saw of the written parameters is now the
    new value, so an enclosing context neither takes the inner write for its own nor for a
    write through a sharded handle."""
    params = {id(t.param) for t in written}
    for ctx in _OPEN:
        for _, targets in ctx.groups:
            for t in targets:
                if id(t.param) in params and t.held is not None:
                    t.versions = _versions(t)
                    if t.snapshot is not None:
                        t.snapshot.copy_(t.held.detach())
