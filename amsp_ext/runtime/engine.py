"""The engine ``shard`` (runtime/shard.py) assembles once its preflight (runtime/preflight.py) has
checked the arguments and resolved the job: its mesh, units, layout, masters, gradient and
broadcast paths (``build_parts``), the Engine made of them and its optimizer, and the hooks
(``install``).

[Note: order of construction]
1. Resolve the job and check its plan against the world (PlanError, before any collective;
   preflight.py).
2. Compare plan/config/model fingerprints across ranks (one small all-gather; preflight.py).
3. Build the plan's process groups once (topology/mesh.py, build_plan_mesh).
4. List the units in forward order; with sp > 1 ``fully_shard`` each on ``param_shard``.
5. Lay out the local tensors, assign owners, and make the owners' fp32 masters from the fp32
   weights, *then* convert the parameters to the compute dtype (so masters never lose bits).
6. Install the gradient hooks (grad_sync), the broadcast waits (param_sync), and return the
   model (its class gains ``no_sync`` and friends, like FSDP2's ``FSDPModule``) and the
   optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import weakref
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.planner.plan import Plan
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import ShardConfig, compute_dtype, reduce_dtype_of
from amsp_ext.runtime.materialize import fill, materialize, to_dtype_keep_buffers
from amsp_ext.runtime.sync.grad_exposure import GradExposure
from amsp_ext.runtime.sync.grad_sync import GradSync
from amsp_ext.runtime.optim.layout import LocalTensor, build_layout
from amsp_ext.runtime.optim.nonfinite import NonFiniteGuard
from amsp_ext.runtime.optim.optimizer import AMSPOptimizer, NormGroup
from amsp_ext.runtime.optim.whole_tensor import WholeTensors
from amsp_ext.runtime.sync.deferred_rs import deferral
from amsp_ext.runtime.sync.param_shard import apply_fsdp, fsdp_streams_wait_current, prefetch_targets
from amsp_ext.runtime.sync.outside_reads import OuterGather
from amsp_ext.runtime.sync.param_sync import ParamSync
from amsp_ext.runtime.sync.units import Unit, list_units, refresh_params
from amsp_ext.runtime.tensor_parallel import data_parallel_mesh, tp_sharded_names
from amsp_ext.topology.groups import World
from amsp_ext.topology.mesh import GroupHandle, PlanMesh, build_plan_mesh

__all__ = ["AMSPModule", "Engine", "EngineParts", "build_engine", "build_parts", "full_state_dict", "install"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineParts:
    """What ``build_parts`` makes for one plan, before there is an optimizer: the owners' fp32
    ``masters`` go to the optimizer (``shard`` builds one, ``switch_plan`` rebinds the existing
    one), the rest into the Engine."""

    plan: Plan
    world: World
    mesh: PlanMesh
    config: ShardConfig
    units: list[Unit]
    tensors: list[LocalTensor]
    device: torch.device
    masters: dict[int, nn.Parameter]  # tensor index -> fp32 master, owned only
    grad_sync: GradSync
    param_sync: ParamSync
    # sp > 1: a forward-only engine's root unit resharded after forward, and the sharded-parameter guard
    # (outside_reads.py [Note: parameters read outside their module's forward])
    outer_gather: OuterGather | None
    norm_group: NormGroup  # the gradient norm's reduction (the optimizer's clip and guard)
    comm: C.CollectiveContext  # collectives.py [Note: the collective context]; kept by a switch
    # a whole-tensor optimizer on row shards (sp > 1): whole owners and their exchange
    # (optim/whole_tensor.py); ``masters`` are then the whole masters this rank steps
    whole: WholeTensors | None = None


class Engine:
    """Everything the runtime holds for one sharded model (reachable as ``model.amsp``),
    complete when constructed."""

    # engines built in this process: once one exists, from_pretrained under an AMSP config loads
    # whole (integrations/patches/transformers_meta_load.py [Note: which from_pretrained loads
    # on meta])
    built: ClassVar[int] = 0
    # the engines alive in this process: plan "auto" counts the forward-only ones beside the
    # model it plans (planner/specs.py [Note: frozen models])
    live: ClassVar["weakref.WeakSet[Engine]"] = weakref.WeakSet()

    def __init__(self, parts: EngineParts, optimizer: AMSPOptimizer | None, *, full_state_dict: bool = False,
                 switches: list[dict] | None = None, retired_meshes: list[PlanMesh] | None = None,
                 profile_source=None) -> None:
        self.plan, self.world, self.mesh, self.config = parts.plan, parts.world, parts.mesh, parts.config
        self.units, self.tensors, self.device = parts.units, parts.tensors, parts.device
        self.grad_sync, self.param_sync, self.optimizer = parts.grad_sync, parts.param_sync, optimizer
        self.outer_gather = parts.outer_gather
        self.comm = parts.comm
        self.rank = dist.get_rank()
        # [Note: state dicts on the integration routes] see AMSPModule.state_dict
        self.full_state_dict = full_state_dict
        # switch_plan's record of every switch, and the meshes of the plans switched away from
        # (runtime/replan/switch.py [Note: the old plan's groups stay alive])
        self.switches: list[dict] = list(switches or [])
        self.retired_meshes: list[PlanMesh] = list(retired_meshes or [])
        # where the profile that planned the job came from (ProfileSource.as_dict() of
        # topology/profile_cache.py; None: no profile, or the launcher planned)
        self.profile_source = profile_source
        self.num_params = sum(u.numel for u in self.units)  # global elements (DTensors count whole)
        Engine.built += 1
        Engine.live.add(self)

    def group(self, kind: str) -> dist.ProcessGroup:
        return self.mesh.group(kind)

    def name(self, kind: str) -> str:
        return self.mesh.name(kind)

    def size(self, kind: str) -> int:
        return self.mesh.size(kind)

    def wait_params(self) -> None:
        """Wait for every pending parameter broadcast (before reading parameters outside forward)."""
        self.param_sync.wait_all()

    def owned_indices(self) -> list[int]:
        return [t.index for t in self.tensors if t.owner_rank == self.rank]

    @property
    def forward_only(self) -> bool:
        """Sharded without an optimizer (grad_sync.py [Note: a model without an optimizer])."""
        return self.optimizer is None

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes, to compare with the planner's memory model.

        ``params``: the local parameter storage (2 Phi / sp in bf16/fp16). ``grads``: the largest
        gradient storage held at the end of any backward pass since the last reset (2 Phi / sg
        when M > 1; in-flight buckets are D_tmp, not counted). ``master`` + ``optim_states``:
        fp32 masters (0 when aliased under fp32) and inner optimizer states of owned tensors
        (12 Phi / sos together for Adam in mixed precision).
        """
        params = 0
        for t in self.tensors:
            loc = t.local()
            params += t.numel * loc.element_size()
        if self.forward_only:  # no local tensors laid out: every parameter is stored as it is
            unique = {id(p): p for u in self.units for _, p in u.params}.values()
            params = sum(compat.dtensor_local(p).numel() * compat.dtensor_local(p).element_size() for p in unique)
        grads = max(self.grad_sync.peak_grad_bytes, self.grad_sync.grad_bytes())
        master, states = self.optimizer.state_bytes() if self.optimizer is not None else (0, 0)
        return {"params": params, "grads": grads, "master": master, "optim_states": states,
                "total": params + grads + master + states}


class AMSPModule:
    """Mixed into the sharded model's class (like FSDP2's FSDPModule)."""

    amsp: Engine

    def __deepcopy__(self, memo):
        # copy.deepcopy would try to pickle the plan's process groups (a TypeError deep inside);
        # say what to do instead, e.g. for torch.optim.swa_utils.AveragedModel(model)
        raise ValueError(
            "amsp: a sharded model cannot be deep-copied (its process groups and hooks belong to "
            "its engine); for swa_utils.AveragedModel build it on an unsharded model of the same "
            "architecture and call averaged.update_parameters(model) after model.amsp.wait_params() "
            "(plans with sp = 1), or average amsp_ext.consolidated_state_dict(model)")

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside are not the accumulation boundary (Tg still runs if sg > sp)."""
        gs = self.amsp.grad_sync
        prev = gs.is_boundary
        gs.is_boundary = False
        try:
            yield
        finally:
            gs.is_boundary = prev

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed-style: the next backward passes are (not) the accumulation boundary."""
        self.amsp.grad_sync.is_boundary = bool(is_boundary)

    def model_state_bytes(self) -> dict[str, int]:
        return self.amsp.model_state_bytes()

    def sharded_state_dict(self, *args, **kwargs):
        """``nn.Module.state_dict`` of the sharded model: with sp > 1 the parameters are FSDP2's
        DTensors (what DCP checkpoints are made of). Local, no collective."""
        # After a step, non-owners' parameters are current only once their broadcasts landed
        # (and packed ones were unpacked); a reader outside forward must not see the old values.
        self.amsp.wait_params()
        return super().state_dict(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """[Note: state dicts on the integration routes]
        ``shard()`` keeps FSDP2's convention: ``state_dict()`` is the sharded one. The model that
        DeepSpeed scripts, Accelerate and the HF Trainer get back (``engine.module``,
        ``accelerator.unwrap_model``) is the user's own model class, and their save code calls
        ``model.state_dict()`` / ``save_pretrained`` on it expecting full tensors (a DTensor
        there fails inside safetensors: "invalid python storage"). ``amsp_ext.initialize`` sets
        ``amsp.full_state_dict``: ``state_dict()`` then returns full tensors in the parameters'
        dtype (``full_state_dict`` below) - collective when sp > 1, so every rank calls
        it, as with DeepSpeed ZeRO-3's gathering; local otherwise."""
        if not self.amsp.full_state_dict:
            return self.sharded_state_dict(*args, **kwargs)
        return full_state_dict(self, *args, **kwargs)


@torch.no_grad()
def full_state_dict(model: "AMSPModule", destination=None, prefix: str = "", keep_vars: bool = False):
    """``nn.Module.state_dict``'s signature and keys, with full tensors: a sharded parameter is
    gathered (DTensor.full_tensor over ``param_shard``) in its own dtype and device, anything
    else is returned as the module holds it. Equal to runtime/export's
    ``consolidated_state_dict(model, dtype=<compute dtype>, rank0_only=False)`` without the
    copies to CPU. Collective when sp > 1; every rank gets the whole dict. Tied aliases stay
    one tensor."""
    from torch.distributed.tensor import DTensor

    sharded = model.sharded_state_dict(keep_vars=True)
    out = destination if destination is not None else type(sharded)()
    if destination is None:
        compat.copy_state_dict_metadata(sharded, out)
    name = model.amsp.name("param_shard")
    seen: dict[int, torch.Tensor] = {}
    for k, v in sharded.items():
        if id(v) not in seen:
            full = C.full_tensor(model.amsp.comm, v.detach(), name=name)
            seen[id(v)] = v if (keep_vars and not isinstance(v, DTensor)) else full
        out[prefix + k] = seen[id(v)]
    return out


def _norm_group(world: World, mesh: PlanMesh, config: ShardConfig, comm: C.CollectiveContext) -> NormGroup:
    # over the world, not optim: one non-finite decision for every rank (nonfinite.py)
    # under TP the world holds each TP shard once per TP coordinate's optim group, so the sum
    # runs over both dimensions (tensor_parallel.py [Note: TP shards and replicated parameters])
    everyone = GroupHandle(pg=dist.group.WORLD, name="world", size=world.global_size,
                           timeout=config.timeout, cross_node=world.num_nodes > 1)
    if mesh.size("optim") == 1 and world.tensor_parallel == 1:  # every rank owns every gradient: the norm is local
        return NormGroup(group=everyone, replicas=1, reduce=False, comm=comm)
    return NormGroup(group=everyone, replicas=world.size // mesh.size("optim"), comm=comm)


def _grad_exposure(tensors: list[LocalTensor], plan: Plan, world: World, mesh: PlanMesh,
                   dtype: torch.dtype, reduce_dtype: torch.dtype) -> GradExposure:
    """What ``.grad`` shows after a boundary backward (grad_exposure.py [Note: .grad after the
    boundary backward]): the owned gradients where every rank owns what it holds, in the
    parameters' dtype; else why not."""
    owners = mesh.size("optim_bcast")
    if world.tensor_parallel > 1:
        why = "under tensor parallelism the engine keeps gradients in its own layout"
    elif owners > 1:
        why = (f"plan {plan} shards optimizer states over {owners} ranks by whole tensors "
               f"(os > p), so each gradient is kept by one rank of {owners}")
    elif reduce_dtype != dtype:
        why = (f"gradients are reduced and kept in {str(reduce_dtype).removeprefix('torch.')} "
               f"for {str(dtype).removeprefix('torch.')} parameters (reduce_dtype)")
    else:
        return GradExposure(tensors, mode="views")
    return GradExposure(tensors, mode="absent", why=why)


def _forward_only_message(model: nn.Module, plan: Plan) -> str:
    name = type(model).__name__.removeprefix("FSDP")  # fully_shard renamed the class
    return (f"amsp: backward through {name}, sharded under plan {plan} without an "
            f"optimizer (a reference, reward or teacher model): it keeps no gradients; run its "
            f"forward under torch.no_grad(), or give it an optimizer to train it (shard()'s "
            f"optimizer_factory; deepspeed.initialize(optimizer=...) or an 'optimizer' block)")


def run_info(parts: EngineParts) -> dict:
    return {"plan": str(parts.plan), "world": [parts.world.num_nodes, parts.world.gpus_per_node]}


def build_engine(model: nn.Module, plan: Plan, world: World, config: ShardConfig, device: torch.device,
                 comm: C.CollectiveContext, *, optimizer_factory=None, optimizer: AMSPOptimizer | None = None,
                 optimizer_kind: str = "elementwise", optimizer_costs: Mapping[str, int] | None = None,
                 monitor: Callable[[EngineParts], Any] | None = None,
                 previous: "Engine | None" = None, initial=None, profile_source=None) -> Engine:
    """[Note: one assembly of an engine]
    ``shard`` builds the first engine of a model and ``switch_plan`` every next one, both here:
    the parts (``build_parts``), the optimizer over them, the Engine, the hooks (``install``).
    Every collaborator goes to a constructor, so an object is complete once built. ``shard``
    passes ``optimizer_factory`` (a new AMSPOptimizer, its non-finite guard from the config, and
    ``monitor(parts)``: the adaptive run, or None); ``switch_plan`` passes the ``optimizer`` to
    keep (rebound to the new parts; its guard, loss scaler and adaptive run stay) and the engine
    it replaces as ``previous`` (its switch record, retired meshes and state-dict mode go on).
    ``initial``: see ``build_parts``. ``profile_source``: where the first plan's profile came
    from (runtime/measure/cluster.py), kept by every switch. ``optimizer_kind``: what
    ``optimizer_factory`` builds (optim/kinds.py), ``optimizer_costs`` its work per parameter
    name (kinds.py ``tensor_costs``); a kept optimizer keeps its own."""
    guard = optimizer.guard if optimizer is not None else NonFiniteGuard(max_bad_steps=config.max_bad_steps)
    forward_only = optimizer is None and optimizer_factory is None
    kind = optimizer.kind if optimizer is not None else optimizer_kind
    costs = optimizer.step_costs if optimizer is not None else dict(optimizer_costs or {})
    parts = build_parts(model, plan, world, config, device, comm, guard=guard, initial=initial,
                        forward_only=forward_only, whole_tensor=costs if kind == "whole_tensor" else None)
    wiring = dict(tensors=parts.tensors, grads=parts.grad_sync, params=parts.param_sync,
                  norm_group=parts.norm_group, run_info=run_info(parts), whole=parts.whole)
    if forward_only:  # grad_sync.py [Note: a model without an optimizer]
        pass
    elif optimizer is None:
        optimizer = AMSPOptimizer(parts.masters, optimizer_factory, device=device, precision=config.precision,
                                  fp16=config.fp16, guard=guard, kind=kind, step_costs=costs,
                                  adaptive=monitor(parts) if monitor is not None else None, **wiring)
    else:
        optimizer.rebind(parts.masters, **wiring)
    kept = dict(profile_source=profile_source) if previous is None else dict(
        full_state_dict=previous.full_state_dict, switches=previous.switches,
        retired_meshes=[*previous.retired_meshes, previous.mesh], profile_source=previous.profile_source)
    engine = Engine(parts, optimizer, **kept)
    install(model, engine)
    return engine


def build_parts(model: nn.Module, plan: Plan, world: World, config: ShardConfig,
                device: torch.device, comm: C.CollectiveContext, *, guard: NonFiniteGuard,
                initial=None, forward_only: bool = False, whole_tensor: Mapping[str, int] | None = None) -> EngineParts:
    """Steps 3-6 of [Note: order of construction]: the mesh, the units (FSDP2 when sp > 1), the
    layout, the owners' fp32 masters, the model in the compute dtype, GradSync and ParamSync
    (not yet installed), all issuing through ``comm``. ``guard``: the optimizer's non-finite
    guard, whose verdict rides on the gradients where the norm takes no all-reduce (nonfinite.py
    [Note: one decision, on the norm all-reduce]).

    ``initial`` None: ``model`` is fp32 and every rank holds it whole. Else the model is on meta
    and ``initial`` is ``(seed, source or None)``: only the local tensors are allocated and
    filled (materialize.py [Note: starting a model larger than one device]).

    ``forward_only``: no optimizer will own anything (grad_sync.py [Note: a model without an
    optimizer]): no local tensors, gradient path, master or broadcast; parameters as in training.

    ``whole_tensor``: a whole-tensor optimizer's work per parameter name (optim/kinds.py,
    ownership.py); with sp > 1 its masters are whole ones on whole owners (whole_tensor.py)."""
    tp_sharded = frozenset(tp_sharded_names(model) if world.tensor_parallel > 1 else ())  # before FSDP2 runs
    with compat.real_tensors():  # the mesh's rank tables are host data, real even in a dry run
        mesh = build_plan_mesh(plan, world, device_type=device.type,
                               timeout=datetime.timedelta(seconds=config.timeout),
                               two_level=config.all_reduce == "two_level",
                               tp_shard_mesh=data_parallel_mesh(model, plan, world)
                               if world.tensor_parallel > 1 and plan.sp > 1 else None)
    units = list_units(model, config.granularity)
    deferred = deferral(units, sharded=plan.sp > 1, device=device, overlap=config.overlap.allgather)
    if plan.sp > 1:
        apply_fsdp(model, units, mesh.shard_mesh, comm, name=mesh.name("param_shard"),
                   timeout=config.timeout, overlap_allgather=config.overlap.allgather,
                   reduce_dtype=reduce_dtype_of(config), deferred=deferred)
        refresh_params(units, model)
    rank, dtype = dist.get_rank(), compute_dtype(config)
    if initial is not None:
        materialize(model, device, dtype)
        refresh_params(units, model)
    whole_rows = whole_tensor is not None and plan.sp > 1 and not forward_only
    tensors = [] if forward_only else build_layout(
        units, plan=plan, world=world, rank=rank, bcast_ranks=mesh.ranks["optim_bcast"],
        shard_ranks=mesh.ranks["param_shard"], policy=config.ownership, tp_sharded=tp_sharded,
        by_global=whole_rows, costs=whole_tensor)
    owned = [t for t in tensors if t.owner_rank == rank]
    fp32_rows: dict[int, torch.Tensor] = {}
    if initial is not None:
        seed, source = initial
        fp32_rows = fill(model, device=device, seed=seed, source=source, init_buffers=True,
                         keep_fp32={id(t.param) for t in owned} if dtype != torch.float32 else set())
    with torch.no_grad():
        masters = _masters(owned, dtype, fp32_rows)
        if dtype != torch.float32 and initial is None:
            to_dtype_keep_buffers(model, dtype)
    whole = _whole_owners(tensors, masters, mesh, config, comm, rank) if whole_rows else None
    masters = whole.masters if whole is not None else masters
    norm = _norm_group(world, mesh, config, comm)
    grad_sync = GradSync(
        tensors, comm=comm, rank=rank, dtype=dtype, device=device, bucket_bytes=config.grad_bucket_bytes,
        dp_size=world.size, replica=mesh.handle("param_replica", timeout=config.timeout),
        grad=mesh.handle("grad", timeout=config.timeout),
        overlap=config.overlap.allreduce,
        exposure=_grad_exposure(tensors, plan, world, mesh, dtype, reduce_dtype_of(config)),
        modules=[u.module for u in units], reduce_dtype=reduce_dtype_of(config),
        split_units=plan.sp == 1, close_bytes=config.grad_bucket_close_bytes, deferred=deferred,
        fold_verdict=guard.fold if not norm.reduce else None,
        refuse=(list(model.parameters()), _forward_only_message(model, plan)) if forward_only else None,
        fsdp_root=model if plan.sp > 1 else None)
    fwd_prefetch = prefetch_targets(units)[0] if (plan.sp > 1 and config.overlap.allgather) else {}
    outer_gather = (OuterGather(model, units, tensors, plan=str(plan), forward_only=forward_only)
                    if plan.sp > 1 else None)
    param_sync = ParamSync(
        tensors, units, comm=comm, group=mesh.handle("optim_bcast", timeout=config.timeout), rank=rank,
        prefetch=fwd_prefetch, overlap=config.overlap.broadcast,
        bucket_bytes=config.broadcast_staging_bytes,
        after_wait=(lambda: fsdp_streams_wait_current(model)) if plan.sp > 1 and device.type != "cpu" else None,
        # outside_reads.py [Note: a gathered root after a step]
        params_changed=outer_gather.drop_stale if outer_gather is not None else None)
    if plan.sp > 1:  # its parameters are real now (meta ones fail it); see the compat note
        compat.fsdp_lazy_init(model)
    return EngineParts(plan=plan, world=world, mesh=mesh, config=config, units=units, tensors=tensors,
                       device=device, masters=masters, grad_sync=grad_sync, param_sync=param_sync,
                       outer_gather=outer_gather, norm_group=norm, comm=comm, whole=whole)


def _whole_owners(tensors: list[LocalTensor], rows: dict[int, nn.Parameter], mesh: PlanMesh,
                  config: ShardConfig, comm: C.CollectiveContext, rank: int) -> WholeTensors:
    """A whole-tensor optimizer on row shards: ``rows`` (the shard masters) stay this rank's
    fp32 rows, the whole masters it steps are gathered (optim/whole_tensor.py)."""
    return WholeTensors(tensors, rank=rank, group=mesh.handle("param_shard", timeout=config.timeout),
                        group_ranks=mesh.ranks["param_shard"], comm=comm, rows=rows,
                        aliased=compute_dtype(config) == torch.float32)


def _masters(owned: list[LocalTensor], dtype: torch.dtype,
             fp32_rows: dict[int, torch.Tensor]) -> dict[int, nn.Parameter]:
    """The owners' fp32 masters (step 5 of [Note: order of construction]): the parameter's own
    storage under fp32, the rows ``fill`` kept for a model that was on meta, else a copy."""
    masters = {}
    for t in owned:
        local = t.local()
        if dtype == torch.float32:
            masters[t.index] = nn.Parameter(local)  # same storage: see optimizer.py
        elif id(t.param) in fp32_rows:
            masters[t.index] = nn.Parameter(fp32_rows.pop(id(t.param)))
        else:
            masters[t.index] = nn.Parameter(local.detach().to(torch.float32, copy=True))
        # lets an optimizer_factory build param groups by name (e.g. no decay on norms)
        masters[t.index].amsp_name = t.name
    return masters


def install(model: nn.Module, engine: Engine) -> None:
    """Hooks in, and the model's class gains AMSPModule (``no_sync``, ``model.amsp``)."""
    engine.grad_sync.install()
    engine.param_sync.install()
    if engine.outer_gather is not None:
        engine.outer_gather.install()
    cls = type(model)
    # Same class name as the original: transformers writes ``type(model).__name__`` into
    # config.json's "architectures" on save_pretrained (it strips only FSDP's prefix), and
    # tools pick the class from there. ``isinstance(model, AMSPModule)`` tells them apart.
    model.__class__ = type(cls.__name__, (AMSPModule, cls), {"__qualname__": cls.__qualname__})
    model.amsp = engine
