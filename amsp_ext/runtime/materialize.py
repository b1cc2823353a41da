"""A model built on ``meta`` made real by ``shard()``: each rank allocates only what its plan
keeps, and fills it from the seed or from ``config.init_from``.

[Note: starting a model larger than one device]
``shard()`` of a model whose parameters are on ``meta`` (built under ``torch.device("meta")``,
as with FSDP2 and torchtitan) never holds the whole model: after ``fully_shard`` (sp > 1) the
parameters are converted to the compute dtype while still on meta and ``to_empty`` allocates
only the local tensors - the FSDP2 shard when sp > 1, the compute-dtype parameters when
sp = 1 - then ``fill`` writes their values and hands back the fp32 rows of the tensors this
rank owns, which become its masters. Beyond the plan's own bytes a rank holds, at any moment,
one module's parameters in fp32 (seeded) or one tensor's rows (a file): for LLaMA-65B that is
the 1 GiB embedding instead of 260 GB. An fp32 model already on its device keeps the old
path (engine.py [Note: order of construction]).

[Note: TP blocks]
A tensor-parallel model (runtime/tensor_parallel.py) may be built on meta too: its DTensors
carry the full shape, and each rank's local tensor is one block of it - rows for a colwise
weight, columns for a rowwise one, a block of that block once FSDP2 shards it over the
data-parallel ranks. ``fill`` builds the module's parameters whole, as below, and copies into
each local tensor the block its DTensor's layout assigns it
(``compute_local_shape_and_global_offset``); from files it reads the block's rows and cuts its
columns, so a rank reads at most T times its share of a rowwise weight (all its rows) and no
row it does not need. The values are therefore the same bits as under T = 1, whatever T and
the plan.

[Note: initial values independent of the plan]
A run must not train different weights because it was sharded differently, and a user who
changes the plan or the world size mid-project must be able to trust that the seed means the
same model. So each module's parameters are built whole, in fp32, on the engine's device, by
the model's own initializer (a Hugging Face model's ``_init_weights``, else the module's
``reset_parameters``), under a generator seeded by the seed and the module's name alone; each
rank then keeps the rows it stores. The full weights are therefore the same bits under every
plan and on any number of ranks of the same device type (tested for 1, 2 and 4 ranks and five
plans). The temporaries start as NaN, so an initializer that forgets a parameter is caught
rather than training on uninitialised memory.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable

import torch
import torch.nn as nn

from amsp_ext.runtime import _torch_compat as compat

__all__ = ["check_initializable", "fill", "model_on_meta", "materialize", "to_dtype_keep_buffers"]


def model_on_meta(model: nn.Module) -> bool:
    """True when every parameter is on ``meta``; a one-line error when only some are."""
    on_meta = [(n, p.is_meta) for n, p in model.named_parameters()]
    meta = [n for n, m in on_meta if m]
    if meta and len(meta) != len(on_meta):
        real = next(n for n, m in on_meta if not m)
        raise ValueError(f"amsp_ext.shard: parameter {meta[0]!r} is on meta but {real!r} is not; "
                         f"build the whole model under torch.device('meta') or none of it")
    return bool(meta)


def _initializer(model: nn.Module) -> Callable[[nn.Module], None] | None:
    init = getattr(model, "_init_weights", None)  # Hugging Face PreTrainedModel
    return init if callable(init) and hasattr(model, "config") else None


def check_initializable(model: nn.Module, *, from_files: bool = False) -> None:
    """Every module ``fill`` will run the initializer on has one (before any collective): each
    holding parameters or buffers, or with ``from_files`` each holding buffers (a file has no
    non-persistent buffer, such as rotary frequencies)."""
    if _initializer(model) is not None:
        return
    for name, m in model.named_modules():
        holds = any(True for _ in m.buffers(recurse=False)) or (
            not from_files and any(True for _ in m.parameters(recurse=False)))
        if holds and not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(
                f"amsp_ext.shard: module {name or '<root>'!r} ({type(m).__name__}) holds tensors on "
                f"meta but has no reset_parameters(); give it one"
                f"{'' if from_files else ', load weights with init_from=PATH'}, or build the model "
                f"on a device")


def to_dtype_keep_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters to the compute dtype; buffers (e.g. rotary inv_freq) keep their precision."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    # FSDP2's _apply re-registers its shards, and a TP DTensor's local tensor is converted only by
    # _apply; a dry run's fake plain tensors cannot take _apply's swap (weak references): there
    # only an all-DTensor model (FSDP2) takes it, a TP one (sp = 1) the loop below
    if dtensors and (len(dtensors) == len(params) or not compat.is_fake(compat.dtensor_local(dtensors[0]))):
        saved = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
        model.to(dtype)
        for m, n, b in saved:
            setattr(m, n, b)  # nn.Module.__setattr__ puts a tensor back into its buffer slot
        return
    # plain tensors: ``p.data = ...`` is what ``model.to`` does for them; written out because
    # ``.to`` swaps tensor subclasses (a dry run's fake tensors), failing for weak-referenced ones
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Storage for what this rank keeps, in the compute dtype; values come from ``fill``.

    FSDP2's units (sp > 1) take ``to_empty``, which re-makes their sharded parameters. Plain
    parameters and TP DTensors (sp = 1) are replaced by new ones (tied aliases by one), since
    ``to_empty``'s in-place swap fails for a dry run's fake tensors."""
    from torch.distributed.tensor import DTensor

    if dtype != torch.float32:
        to_dtype_keep_buffers(model, dtype)  # still on meta: no bytes move
    if all(isinstance(p, DTensor) for p in model.parameters()):  # FSDP2's units
        model.to_empty(device=device)
        return
    made: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for n, p in list(m.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(_empty_like(p, device), requires_grad=p.requires_grad)
            setattr(m, n, made[id(p)])
        for n, b in list(m.named_buffers(recurse=False)):
            setattr(m, n, torch.empty_like(b, device=device))  # keeps the buffer's persistence


def _empty_like(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Storage for ``p``'s local data on ``device``; a TP DTensor (sp = 1) stays one, on its mesh."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return torch.empty_like(p, device=device)
    local = torch.empty_like(compat.dtensor_local(p), device=device)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _seed_of(seed: int, module_name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{module_name}".encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def _seeded(seed: int, module_name: str, device: torch.device):
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_seed_of(seed, module_name))
        yield


def _block_of(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(the local tensor, the block of the full tensor it holds: one slice per dimension; None
    for all of it). A block, not rows: a TP rowwise weight is Shard(1), and FSDP2 over TP shards
    the TP block again ([Note: TP blocks])."""
    local = compat.dtensor_local(p)
    shape, offset = compat.local_chunk(p)
    if p.dim() == 0 or (list(shape) == list(p.shape) and not any(offset)):
        return local, None
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _read_block(source, name: str, block: tuple[slice, ...] | None) -> torch.Tensor:
    """The block from the files: its rows read (files store row-major), the columns cut here."""
    if block is None:
        return source.rows(name)
    rows = source.rows(name, block[0].start, block[0].stop)
    return rows[(slice(None), *block[1:])] if len(block) > 1 else rows


@torch.no_grad()
def _run_initializer(init, module_name: str, m: nn.Module, seed: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """``m``'s direct parameters built whole in fp32 by ``init`` (its buffers in place)."""
    saved = dict(m.named_parameters(recurse=False, remove_duplicate=False))
    full = {n: torch.full(tuple(p.shape), float("nan"), dtype=torch.float32, device=device)
            for n, p in saved.items()}
    try:
        for n, t in full.items():
            setattr(m, n, nn.Parameter(t, requires_grad=False))
        with _seeded(seed, module_name, device):
            init(m)
    finally:
        for n, p in saved.items():
            setattr(m, n, p)
    if device.type != "meta" and not compat.is_fake(next(iter(full.values()), None)):
        for n, t in full.items():
            # A NaN makes the sum NaN, so the scalar screens every tensor without the numel-byte
            # mask isnan() builds (0.24 GiB for LLaMA-65B's embedding); an overflow to inf - inf
            # is told apart by the exact check it then runs.
            if t.numel() and torch.isnan(t.sum()) and torch.isnan(t).any():
                raise ValueError(f"amsp_ext.shard: the initializer of module {module_name or '<root>'!r} "
                                 f"({type(m).__name__}) left parameter {n!r} unset")
    return full


@torch.no_grad()
def fill(model: nn.Module, *, device: torch.device, seed: int, source=None, init_buffers: bool,
         keep_fp32: set[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Write every parameter's local rows, from ``source`` (an init_source.InitSource) when
    given, else from the model's initializer seeded by ``seed``; with ``init_buffers`` (a model
    that was on meta) run the initializer for every module's buffers too, then take persistent
    buffers from ``source``. Returns id(parameter) -> fp32 rows for the parameters in
    ``keep_fp32`` (the masters this rank owns), shaped like the local tensor."""
    init = _initializer(model)
    fp32: dict[int, torch.Tensor] = {}
    done: set[int] = set()
    for mod_name, m in model.named_modules():
        params = dict(m.named_parameters(recurse=False, remove_duplicate=False))
        buffers = dict(m.named_buffers(recurse=False, remove_duplicate=False))
        full: dict[str, torch.Tensor] = {}
        if (source is None and params) or (init_buffers and buffers):
            run = init if init is not None else (lambda mod: mod.reset_parameters())
            full = _run_initializer(run, mod_name, m, seed, device)
        for n, p in params.items():
            if id(p) in done:  # a tied alias: filled under its first name
                continue
            done.add(id(p))
            name = f"{mod_name}.{n}" if mod_name else n
            local, block = _block_of(p)
            if source is not None:
                rows = _read_block(source, name, block).to(device)
            else:
                rows = full[n] if block is None else full[n][block]
            local.copy_(rows.reshape(local.shape))
            if id(p) in keep_fp32:
                fp32[id(p)] = rows.reshape(local.shape).clone()
            # a view of the whole fp32 tensor: dropped here, not at the next module's rows, so
            # one module's fp32 initialisation is alive at a time (planner/memory.py
            # [Note: start-up memory])
            del rows
        if source is not None:
            for n, b in buffers.items():
                name = f"{mod_name}.{n}" if mod_name else n
                if name in source:  # the files' persistent buffers (init_source.expected_tensors)
                    b.copy_(source.rows(name).to(device=device, dtype=b.dtype).reshape(b.shape))
    return fp32
