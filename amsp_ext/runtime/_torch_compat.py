"""Every access amsp_ext makes to a private part of torch, in one file.

[Note: why a compat file]
FSDP2, DTensor, DeviceMesh and autograd expose a few things only privately that the engine
needs: the comm base classes of ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, the
all-gather streams and the unshard ``async_op`` switch of an FSDP module, the local tensor of a
DTensor without autograd, a chunk's global offset, and the autograd engine's end-of-backward
callback. Private names move between releases without notice. Keeping them here means one
file to re-check on a torch upgrade, and ``tests/test_torch_compat.py`` fails if a private
``torch`` attribute shows up anywhere else in amsp_ext.

[Note: versions]
Each access below was read in the torch source and exercised by the test suite on the
versions in ``CHECKED_TORCH`` (major.minor). On any other version ``check_torch_version``
(run when this module is imported, i.e. when the engine is) raises a one-line error naming
the version and the checked ones; ``AMSP_ALLOW_UNCHECKED_TORCH=1`` turns that into one
warning, for whoever is doing the re-check.
"""

from __future__ import annotations

import contextlib

import os
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

__all__ = [
    "CHECKED_TORCH", "FSDPAllGatherBase", "FSDPReduceScatterBase", "UncheckedTorchError",
    "copy_state_dict_metadata", "check_torch_version", "default_group", "dtensor_local",
    "end_coalescing", "flatten_dense_tensors",
    "fake_store", "fake_tensor_mode", "nominal_fake_scalars", "fsdp_all_gather_streams",
    "fsdp_unsharded_tensors", "fsdp_params_of", "fsdp_unit_state", "fsdp_unsharded_param", "fsdp_param_home", "tensor_version",
    "fsdp_lazy_init", "live_process_groups", "local_chunk", "local_chunk_offset", "mem_tracker", "mesh_flatten",
    "mesh_root",
    "mesh_unflatten", "op_observer",
    "real_device_meshes", "real_tensors", "optimizer_hooks",
    "label", "profiling", "queue_backward_callback", "RaisingTensor",
    "set_fsdp_unshard_async_op", "start_coalescing",
]

CHECKED_TORCH = ("2.13",)
ALLOW_ENV = "AMSP_ALLOW_UNCHECKED_TORCH"


class UncheckedTorchError(RuntimeError):
    """torch is a version the private accesses of this file were not checked against."""


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_torch_version(version: str | None = None) -> None:
    v = _major_minor(version or torch.__version__)
    if v in CHECKED_TORCH:
        return
    msg = (f"amsp_ext: torch {version or torch.__version__} is not a version amsp_ext's private "
           f"torch accesses (amsp_ext/runtime/_torch_compat.py) were checked against "
           f"({', '.join(CHECKED_TORCH)}); install one of those, or set {ALLOW_ENV}=1 to run unchecked")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(msg, stacklevel=2)
        return
    raise UncheckedTorchError(msg)


check_torch_version()

# -- FSDP2 (torch/distributed/fsdp/_fully_shard) ---------------------------------------------
# The base classes FSDP2 expects from set_custom_all_gather / set_custom_reduce_scatter.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGatherBase  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatterBase  # noqa: E402


def fsdp_all_gather_streams(root: nn.Module) -> list:
    """The all-gather copy-in and all-gather streams FSDP2 shares across a root's modules
    (``FSDPState._comm_ctx``); empty before FSDP2's lazy init or on CPU."""
    ctx = getattr(root._get_fsdp_state(), "_comm_ctx", None)  # type: ignore[operator]
    if ctx is None:
        return []
    return [getattr(ctx, n) for n in ("all_gather_copy_in_stream", "all_gather_stream") if hasattr(ctx, n)]


def fsdp_lazy_init(root: nn.Module) -> None:
    """``FSDPState._lazy_init`` of the root: what FSDP2 runs at the root's first forward (the
    root marked, every module's state sharing its comm context), run now, so that a forward
    entered below the root (``PeftModel.generate`` calls the base model's forward) finds the
    states initialized rather than each module making itself a root."""
    root._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def fsdp_backward_unfinished(root: nn.Module) -> bool:
    """Whether FSDP2 began a backward on ``root``'s modules whose final callback never ran
    (the backward raised): its root pre-backward queued the callback, which clears the flag."""
    return bool(root._get_fsdp_state()._state_ctx.post_backward_final_callback_queued)  # type: ignore[operator]


def fsdp_drop_unsharded_grads(root: nn.Module) -> None:
    """Drop the gradients FSDP2 holds on its unsharded parameters (and their accumulation in the
    reduce dtype): a backward that raised before their unit's reduce-scatter left them there,
    and ``reset_iter_state`` keeps them, so the next backward would add into them."""
    for state in root._get_fsdp_state()._state_ctx.all_states:  # type: ignore[operator]
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = None


def set_fsdp_unshard_async_op(module: nn.Module, async_op: bool) -> None:
    """``FSDPModule._set_unshard_async_op``: FSDP2 then asks the custom all-gather for
    ``async_op=async_op`` in its pre-forward/pre-backward unshards and prefetches, and waits
    for the returned Work itself in ``wait_for_unshard``."""
    module._set_unshard_async_op(async_op)  # type: ignore[operator]


def fsdp_unsharded_tensors(root: nn.Module) -> Callable[[], list[torch.Tensor]]:
    """A function giving the storage of every parameter FSDP2 gathers whole under ``root``: each
    FSDPParam's ``all_gather_outputs`` (the unsharded parameter is a view of them; made at the
    first all-gather, sized only while gathered: FSDP2 frees them by resizing to 0). Reads 2.13's
    ``FSDPModule._get_fsdp_state``, ``FSDPState._fsdp_param_groups``, ``FSDPParamGroup.fsdp_params``
    and ``FSDPParam.all_gather_outputs``."""
    from torch.distributed.fsdp import FSDPModule

    params = [fp for m in root.modules() if isinstance(m, FSDPModule)
              for group in m._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
              for fp in group.fsdp_params]
    return lambda: [t for fp in params for t in fp.all_gather_outputs]


def fsdp_params_of(module: nn.Module) -> list:
    """The FSDPParams of one FSDP module (not recursive; empty when it holds none): each has
    ``sharded_param`` (the DTensor Parameter), ``_unsharded_param`` once gathered, and
    ``_module_info`` (``module``, ``param_name``). Reads 2.13's ``FSDPState._fsdp_param_groups``
    and ``FSDPParamGroup.fsdp_params``."""
    return [fp for group in module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
            for fp in group.fsdp_params]


def fsdp_unit_state(module: nn.Module) -> tuple[bool, bool]:
    """(every param group unsharded, every param group reshards after forward) of one FSDP
    module: ``FSDPParamGroup.is_unsharded`` and ``_reshard_after_forward`` (2.13)."""
    groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    return (all(g.is_unsharded for g in groups), all(g._reshard_after_forward for g in groups))


def fsdp_unsharded_param(fsdp_param) -> nn.Parameter | None:
    """An FSDPParam's gathered Parameter (``_unsharded_param``), None before its first gather."""
    return getattr(fsdp_param, "_unsharded_param", None)


def fsdp_param_home(fsdp_param) -> tuple[nn.Module, str]:
    """(module, attribute name) an FSDPParam is registered on (``_module_info``, 2.13)."""
    info = fsdp_param._module_info
    return info.module, info.param_name


def post_accumulate_grad_hook_count(p: torch.Tensor) -> int:
    """How many post-accumulate-grad hooks ``p`` has (torch keeps them in a private dict, and
    FSDP2 runs that dict itself after a reduce-scatter)."""
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {})


def tensor_version(t: torch.Tensor) -> int:
    """The in-place write counter of a tensor (``Tensor._version``): it moves on every in-place
    op on the tensor or a view of its storage made through it."""
    return t._version


# -- DTensor ---------------------------------------------------------------------------------
def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, as stored (no autograd view; ``to_local()`` is one under
    grad mode); a plain tensor's own data."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t.data  # type: ignore[attr-defined]


def local_chunk_offset(t: torch.Tensor) -> list[int]:
    """The global offset of this rank's chunk of a DTensor (zeros for a plain tensor)."""
    return local_chunk(t)[1]


def local_chunk(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """(shape, global offset) of this rank's chunk of a DTensor, on any mesh and placements (TP's
    Shard(1), FSDP2's strided shard over TP); a plain tensor is its own whole chunk."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return list(t.shape), [0] * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(shape), list(offset)


def op_observer(callback):
    """A context in which ``callback(op_name, args)`` sees every op dispatched (``op_name`` as
    "namespace::name", e.g. "_c10d_functional::all_reduce"), before the op runs as it would
    without it: a TorchDispatchMode, private in torch 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Observer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            callback(func._schema.name, args)
            return func(*args, **(kwargs or {}))

    return _Observer()


def op_recorder(callback):
    """Like ``op_observer``, with ``callback(op_name, op, args, kwargs)`` also given the
    OpOverload itself (a recorded collective is issued again through it:
    runtime/collectives.py [Note: a step's collectives replayed alone])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            callback(func._schema.name, func, args, kwargs)
            return func(*args, **(kwargs or {}))

    return _Recorder()


# -- DeviceMesh ------------------------------------------------------------------------------
# FSDP2 under TP needs its shard mesh cut from the TP DTensors' own root mesh
# (runtime/tensor_parallel.py [Note: FSDP2's mesh under TP]); DeviceMesh exposes the root and
# the reshaping (torchtitan's dims are built the same way) only privately in torch 2.13.
def mesh_root(mesh):
    """The mesh ``mesh`` was sliced from (itself if it is a root)."""
    return mesh._get_root_mesh()


def mesh_unflatten(mesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``mesh`` with its dimension ``dim`` split into ``sizes``, named ``names``."""
    return mesh._unflatten(dim, sizes, names)


def mesh_flatten(mesh, name: str):
    """``mesh``'s dimensions flattened into one named ``name``."""
    return mesh._flatten(name)


# -- nn.Module state dicts ---------------------------------------------------------------------
def copy_state_dict_metadata(src, dst) -> None:
    """``nn.Module.state_dict`` attaches the modules' versions as ``_metadata`` (which
    ``load_state_dict`` reads back); carry it over to a state dict built from ``src``."""
    if hasattr(src, "_metadata"):
        dst._metadata = src._metadata


# -- torch.optim.Optimizer -------------------------------------------------------------------
_OPTIMIZER_HOOKS = ("state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post")


def optimizer_hooks(opt: torch.optim.Optimizer, kind: str) -> list[Callable]:
    """The hooks registered with ``register_<kind>_hook`` on ``opt`` (``Optimizer`` keeps them
    in ``_optimizer_<kind>_hooks``), in the order they run, for an optimizer that overrides
    ``state_dict``/``load_state_dict`` and must still run them."""
    if kind not in _OPTIMIZER_HOOKS:
        raise ValueError(f"kind must be one of {', '.join(_OPTIMIZER_HOOKS)}, got {kind!r}")
    return list(getattr(opt, f"_optimizer_{kind}_hooks").values())


# -- autograd ------------------------------------------------------------------------------
class RaisingTensor(torch.Tensor):
    """A tensor with a shape, dtype and device and no storage, whose every operation raises
    ``RuntimeError(why)`` (a wrapper subclass: ``_make_wrapper_subclass`` and
    ``__torch_dispatch__``, both private). Printing it does not raise."""

    why: str

    @staticmethod
    def __new__(cls, shape, *, dtype: torch.dtype, device: torch.device, why: str) -> "RaisingTensor":
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                requires_grad=False)
        t.why = why
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        flat, _ = tree_flatten((args, kwargs or {}))
        raise RuntimeError(next(a.why for a in flat if isinstance(a, RaisingTensor)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}: {self.why})"


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the current backward pass ends (what FSDP2 and DDP use too)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a hook, an activation-checkpoint
    recompute), from autograd's current graph task (-1 outside every backward)."""
    return torch._C._current_graph_task_id() != -1


# -- profiler labels ---------------------------------------------------------------------------------
# [Note: labels cost nothing unprofiled]
# ``record_function`` builds a RecordFunction through the dispatcher on every entry, whether or
# not anything records it: about 6 us in a loop, and about 70 us per gradient hook timed inside
# a backward, where the matmuls just before leave the caches cold. Skipping them (with the hooks'
# cheaper contexts, grad_sync.py) took 2.1-2.6 ms a step off one rank's 39 gradient hooks of a
# ~0.65 s small-llama step (comparisons/engine_cpu_overhead.py toggle; its report is in
# comparisons/results/).
# The engine's labels (a project rule, docs/DESIGN.md) are read only from profiler traces, so
# ``label`` enters one only while a profiler records: torch.autograd.profiler's flag, which every
# profiler started from Python sets (torch.profiler.profile, the legacy profile, emit_nvtx,
# emit_itt; torch's dynamo and inductor read it for the same reason), or a profiler started from
# C++ on this thread. A profiler started while a label is open sees only the labels entered
# after its start, as it would see only the ops run after it.
def profiling() -> bool:
    """Whether a profiler is recording ([Note: labels cost nothing unprofiled])."""
    return torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled()


def label(name: str):
    """``record_function(name)`` while a profiler records, else a no-op context
    ([Note: labels cost nothing unprofiled])."""
    if profiling():
        return record_function(name)
    return contextlib.nullcontext()


# -- undoing fully_shard (runtime/replan/switch.py) -----------------------------------------------------
def fsdp_remove(module: nn.Module) -> None:
    """Undo ``fully_shard`` on ``module`` (FSDP2 has no public inverse): remove the forward
    hooks of its FSDPState, the state-dict hooks of its param group(s), each FSDPParam's
    load-state-dict post-hook, its entries in the composable-API registry and the module-state
    map, FSDP's marker attributes, and its ``FSDP<cls>`` class. The parameters registered on
    the modules stay what they are (the sharded DTensors after ``reshard()``): the caller
    replaces them. Read in torch 2.13's ``_fully_shard/_fully_shard.py``, ``_fsdp_state.py``,
    ``_fsdp_param_group.py``, ``_fsdp_param.py``, ``_composable/contract.py`` and
    ``_composable_state.py``."""
    import importlib

    from torch.distributed import _composable_state
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # the module, not the ``contract`` decorator the package re-exports under the same name
    contract = importlib.import_module("torch.distributed._composable.contract")

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    if state is None:
        raise ValueError(f"fsdp_remove: {type(module).__name__} is not fully_shard-ed")
    handles = {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}
    for h in handles.values():
        h.remove()
    for group in state._fsdp_param_groups:
        for hs in (group._module_to_pre_save_state_dict_hook_handle,
                   group._module_to_pre_load_state_dict_hook_handle):
            for h in hs.values():
                h.remove()
            hs.clear()
        for fp in group.fsdp_params:
            fp._post_load_hook_handle.remove()
    for m in state._modules:
        all_state = m.__dict__.get(contract.STATE_KEY, {})
        for k in [k for k, v in all_state.items() if v is state]:
            del all_state[k]
        m.__dict__.get(contract.REGISTRY_KEY, {}).pop("fully_shard", None)
        _composable_state._module_state_mapping.pop(m, None)
        if isinstance(m, FSDPModule):
            m.__class__ = type(m).__mro__[FSDPModule._orig_cls_mro_index]
    for m in module.modules():
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            m.__dict__.pop(attr, None)


# -- for the DeepSpeed patches (integrations/patches/) ----------------------------------------
def flatten_dense_tensors(tensors):
    """``torch._utils._flatten_dense_tensors``: what DeepSpeed's ZeRO-1/2 flat buffer is built with
    (the zero12 flat-buffer patch probes it)."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def default_group():
    """``distributed_c10d._get_default_group()``: the world ProcessGroup object itself."""
    return dist.distributed_c10d._get_default_group()


def start_coalescing(group, device: torch.device) -> None:
    """``ProcessGroup._start_coalescing``: what DeepSpeed-MiCS's coalescing manager calls (gloo
    raises RuntimeError; the MiCS-on-gloo patch probes for that)."""
    group._start_coalescing(device)


def end_coalescing(group, device: torch.device) -> None:
    group._end_coalescing(device)


def live_process_groups() -> list:
    """Every process group this process has created and not destroyed (``c10d._world.pg_map``),
    in creation order: what `amsp tune` destroys after each plan."""
    return list(dist.distributed_c10d._world.pg_map)


# -- dry run (tools/dryrun.py): one rank of a huge world, tensors without storage -----
def fake_store():
    """``torch.testing._internal.distributed.fake_pg.FakeStore``: the store of the ``"fake"``
    backend (every collective returns at once, moving no data), checked with 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode():
    """``FakeTensorMode`` (torch._subclasses): tensors with shapes, dtypes and devices but no
    storage; ``device="cuda"`` works on a CPU-only build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    """A dry run's fake tensor (no data to inspect)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def real_tensors():
    """A context in which tensors are real again inside a FakeTensorMode (host-side bookkeeping
    such as the fingerprint all-gather); a no-op outside one."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@contextlib.contextmanager
def real_device_meshes():
    """Inside a FakeTensorMode, every DeviceMesh is built on real tensors: its rank table is host
    data, and the meshes FSDP2 makes on its own (the (dp, tp) mesh it joins under TP,
    ``DeviceMesh._concatenate``) find this rank's coordinates with ``nonzero``, which a fake
    tensor cannot answer. Patches ``DeviceMesh.__init__`` for the duration (a dry run's)."""
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(self, *args, **kwargs):
        with real_tensors():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def mem_tracker(grads_of: Callable[[], list] | None = None,
                gathered_of: Callable[[], list] | None = None,
                on_new_peak: Callable[[set, bool], None] | None = None):
    """``torch.distributed._tools.mem_tracker.MemTracker`` (memory of a step by category), with
    additions that read its private state (2.13's ``_peak_mem``, ``_peak_mem_snap``,
    ``_curr_mem_snap``, ``_update_peak_stats``, ``_update_and_maybe_create_winfos``,
    ``_pre_fw_hook``, ``memory_tracking``, ``_mod_tracker``):

    * ``reset_peak()``: the peak restarts from the current memory, so a run can measure its
      last step only (the first creates the optimizer states and gradient buffers);
    * ``grads_of()`` (tensors): the engine's gradient storage, filed under ``Grad`` whenever a
      new peak is about to be recorded. MemTracker files a tensor by where it was allocated;
      gradients reduced into buckets, owned or kept buffers and FSDP2's sharded ``.grad`` are
      allocated in backward outside any parameter's grad hook, so it would file them as
      ``Temp``. See dryrun.py [Note: categories at the peak];
    * ``gathered_of()`` (tensors): parameters gathered whole for compute (FSDP2's unsharded
      parameters, ``fsdp_unsharded_tensors``), filed under ``Temp`` the same way. MemTracker
      files them by where they were gathered: ``Parameter`` when a module's hook registers them,
      ``Activation`` when a forward (a recomputation's too) gathers them;
    * ``on_new_peak(parents, is_bw)``: called when a new peak is recorded, with the names of the
      modules running then and whether it is in backward (the dry run's peak moment);
    * tensors DTensor makes to propagate shapes (``ShardingPropagator.
      _propagate_tensor_meta_non_cached``: global-shape tensors under the ambient fake mode) are
      not counted. Outside a dry run they live in a FakeTensorMode of DTensor's own and take no
      memory; inside one they are the dry run's fake tensors, and a whole embedding in fp32 and
      bf16 looked like the start-up peak of a TP model."""
    import threading

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagating = threading.local()

    class _StepMemTracker(MemTracker):
        def reset_peak(self) -> None:
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}

        def _update_peak_stats(self, peak_state) -> None:
            new = any(self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]
                      for dev, snap in self._curr_mem_snap.items())
            if new:
                for of, kind in ((grads_of, _MemRefType.GRAD), (gathered_of, _MemRefType.TEMP)):
                    for t in of() if of is not None else ():
                        self._update_and_maybe_create_winfos(t, kind)
            super()._update_peak_stats(peak_state)
            if new and on_new_peak is not None:
                on_new_peak(set(self._mod_tracker.parents), bool(self._mod_tracker.is_bw))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(propagating, "depth", 0):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def __enter__(self):
            propagate = self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached

            def uncounted(prop, op_schema):
                propagating.depth = getattr(propagating, "depth", 0) + 1
                try:
                    return propagate(prop, op_schema)
                finally:
                    propagating.depth -= 1

            ShardingPropagator._propagate_tensor_meta_non_cached = uncounted
            return super().__enter__()

        def __exit__(self, *exc):
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
            return super().__exit__(*exc)

        def _pre_fw_hook(self, module, args) -> None:
            # per-module stats are not used; forget them so a module may run forward once per
            # micro-batch (MemTracker refuses a second forward of a module it has stats for)
            self.memory_tracking.pop(module, None)
            super()._pre_fw_hook(module, args)

    return _StepMemTracker()


class nominal_fake_scalars:
    """Host reads of fake values (``float(norm)``, ``bool(found_inf)``, ``.item()``) return a
    nominal healthy value (1.0, 0, False, zeros) instead of raising DataDependentOutputException:
    a dry run's control flow then takes the finite, no-skip path of an ordinary step."""

    _names = ("item", "__float__", "__int__", "__bool__", "tolist")

    def __enter__(self):
        from torch._subclasses.fake_tensor import FakeTensor

        self._cls, self._saved = FakeTensor, {n: FakeTensor.__dict__.get(n) for n in self._names}
        FakeTensor.item = lambda t: 1.0 if t.dtype.is_floating_point else 0
        FakeTensor.__float__ = lambda t: 1.0
        FakeTensor.__int__ = lambda t: 0
        FakeTensor.__bool__ = lambda t: False
        FakeTensor.tolist = lambda t: [0] * t.numel()
        return self

    def __exit__(self, *exc):
        for n, v in self._saved.items():
            if v is None:
                delattr(self._cls, n)
            else:
                setattr(self._cls, n, v)
