"""Sharded checkpoints of an AMSP model and optimizer, on torch.distributed.checkpoint (DCP).

``save_checkpoint(model, optimizer, path, *, lr_scheduler=None, extra=None)`` and
``load_checkpoint(model, optimizer, path, *, lr_scheduler=None) -> extra``; both are collective
(every rank calls them, between optimizer steps). The plan and the world size may differ
between save and load.

[Note: why DCP]
A checkpoint written under one plan must load under another: a different sp re-cuts every
parameter, a different sos (or world) moves every optimizer state to another owner. DCP already
solves "every rank writes the chunks it holds, every rank reads the chunks it needs": each
value is a *global* tensor described by (global shape, chunk offsets); on save the planner
keeps one writer per (key, offset) and records every chunk in ``.metadata``; on load each rank
asks for the boxes of its own targets and DCP reads the overlapping parts of whichever chunks
hold them, in any layout. So the engine's only job is to express each local tensor as a
global tensor with the right offsets, and to choose which keys each rank presents.

[Note: the layout as DCP chunks]
- Parameters: ``model.sharded_state_dict()`` as is. For sp > 1 they are FSDP2's DTensors (Shard(0) on
  the ``param_shard`` mesh), so DCP sees chunk offsets directly. The ``param_replica`` ranks
  hold the same chunks; dcp_io.assign_writers keeps one writer per chunk (balancing bytes per rank).
- fp32 masters and inner optimizer states exist only on the owner of each local tensor
  (inter-tensor sharding: the whole local tensor on one rank of its ``optim_bcast`` group).
  The owner presents each as a DTensor built on the parameter's own mesh and placements
  (``DTensor.from_local(..., shape=, stride=)``, no communication), so a state chunk has
  exactly its parameter chunk's offsets; other ranks simply do not present the key. Owner
  replicas (dp / sos of them) are deduplicated like parameter replicas.
- 0-d states (Adam's ``step``) are replicated scalars; any other shape is per-shard and can
  only be reloaded under the same sp (checked before any collective), except a whole-tensor
  optimizer's (see [Note: whole-tensor optimizers in a checkpoint]).
- Non-tensor values are JSON (runtime/wire.py, [Note: data, not code]): the param-group
  hyper-parameters and non-tensor optimizer states of each chunk in its row of ``amsp.json``;
  the step counter, loss scaler, LR scheduler and ``extra`` in ``amsp.state.json`` (rank 0);
  each rank's RNG states in ``rng-<rank>.json``. All are files of the SHA-256 table.
  See [Note: nothing is unpickled].
- ``amsp.json`` (rank 0, written after every rank finished: it marks the checkpoint complete) is
  the human-readable table: plan, world, precision, every model tensor (name, shape, dtype),
  every optimizer chunk (name, global and local shape, shard index, offset, owner ranks), the
  size and SHA-256 of every file, and the caller's ``info``. Loading validates the model
  against it on every rank before any collective. The directory is staged next to ``path``
  and published by one rename (see checkpoint_files.py: [Note: atomic publish]).

[Note: whole-tensor optimizers in a checkpoint]
A whole-tensor optimizer (runtime/optim/kinds.py) keeps whole masters and states: under sp = 1
because every local tensor is whole, under sp > 1 on whole owners (optim/whole_tensor.py). Its
masters and param-shaped states are written as one plain chunk at offset 0 (the whole tensor),
and its other states (Adafactor's row and column factors) as kind ``whole``: one key with no
shard suffix. So a checkpoint of it loads under any plan and world where the masters are whole
again - sp = 1, or sp > 1 with whole owners - and DCP cuts the parameters' rows out of the
masters where the loading plan shards them. Loading whole masters re-gathers them from the rows
just read (one all-to-all per param_shard group), so only the rows are read from the files.
Invariant: a ``whole`` state is never loaded by an engine that steps row shards (one line).

[Note: nothing is unpickled]
DCP's FileSystemWriter pickles its ``.metadata`` (FileSystemReader.read_metadata is
``pickle.load``) and DefaultLoadPlanner.load_bytes is an unrestricted ``torch.load``: a
checkpoint in that format is a program. So the tensors go through DCP's Hugging Face storage
(``HuggingFaceStorageWriter``: one safetensors file per rank, each chunk's
offsets as JSON in the file's safetensors header; ``HuggingFaceStorageReader`` rebuilds DCP's
metadata from those headers and reads slices with safetensors), DCP carries no bytes items, and
everything else is JSON. DCP is never given a process group, since its own plan exchange pickles
objects between ranks (dcp_io.py: [Note: DCP without its object collectives]); the ranks agree
on who writes which chunk through a JSON all-gather instead. Loading a checkpoint therefore parses JSON and safetensors headers and
copies raw tensor bytes; it never unpickles. Optional authenticity (an HMAC over ``amsp.json``,
whose SHA-256 table covers every other file) is in checkpoint_files.py ([Note: signatures]).

[Note: async save]
``save_checkpoint(..., async_save=True)`` stalls training only for DCP's staging (a copy of
every tensor this rank writes, into fresh CPU memory); the files are written, hashed and
published by a background thread, which coordinates over a separate gloo group (collectives
of two threads must never share a group). It returns a :class:`PendingSave`; the next save or
load of the same model waits for it first, and a training loop waits before it exits.

[Note: precision]
Under fp32 the master *is* the parameter (aliased), so only ``model.*`` is written and every
rank loads its parameters from the best source (``optim.master.*`` if the checkpoint was
mixed precision, else ``model.*``). Under bf16/fp16 the owners load their fp32 masters
(``optim.master.*``, or an fp32 ``model.*``) and set their local parameter to the master
rounded to the compute dtype, which is what the optimizer step does; the other ranks load the
saved parameters when they have this compute dtype (they are that same rounding), else the
master, rounded by DCP's copy into the parameter (a bf16 parameter widened to fp16 would not
be). So every replica holds round(master) and no broadcast is needed.

[Note: exactness]
Same plan: every byte is restored, so training continues bit-for-bit. Another plan or world:
parameters, masters and states are restored bit-for-bit, so the next forward on the same batch
gives the same loss up to the order of the cross-rank loss reduction; the steps after differ
only by the order in which gradients are summed across ranks (the plans reduce in different
groups), the same ~1e-7 relative effect the parity suite measures between plans (on
tiny-llama in fp32 it stays below the parameters' resolution: the tests observe bit-exact
losses across plans and 4 <-> 8 ranks; bf16/fp16 across plans ~2e-6 relative).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import random
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.planner.specs import format_size
from amsp_ext.runtime import wire
from amsp_ext.runtime.state import dcp_io
from amsp_ext.runtime.state.checkpoint_files import (FORMAT, RNG_FILE, STATE_FILE, CheckpointError, begin_staging,
                                               damage, file_digest, publish, rank_files, read_meta,
                                               resolve, staging_path, verify_files, write_meta)

if TYPE_CHECKING:
    from amsp_ext.runtime.engine import Engine
    from amsp_ext.runtime.optim.layout import LocalTensor

__all__ = ["CheckpointError", "PendingSave", "checkpoint_step", "load_checkpoint", "read_checkpoint_meta",
           "save_checkpoint", "verify_checkpoint", "wait_for_save"]

MODEL = "model."  # + state_dict key
MASTER = "optim.master."  # + tensor name (mixed precision only)
STATE = "optim.state."  # + tensor name + "." + state key


# -- shared helpers (also used by export.py) -------------------------------------------------------
def engine_of(model: nn.Module, optimizer=None) -> "Engine":
    e = getattr(model, "amsp", None)
    if e is None:
        raise CheckpointError("amsp checkpoint: the model is not sharded by amsp_ext.shard")
    if optimizer is not None and optimizer is not e.optimizer:
        raise CheckpointError("amsp checkpoint: optimizer is not the one amsp_ext.shard returned for this model")
    return e


def as_global(t: "LocalTensor", local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped like ``t``'s local shard) as a global tensor with ``t``'s chunk offsets."""
    p = t.param
    if isinstance(p, DTensor):
        return DTensor.from_local(local.detach(), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local.detach()


def _encode(obj: Any, where: str) -> bytes:
    try:
        return wire.dumps(obj, where)
    except wire.WireError as e:
        raise CheckpointError(f"amsp checkpoint: {e}") from None


def _read_json(path: Path, name: str) -> Any:
    try:
        return wire.loads((path / name).read_bytes())
    except (OSError, wire.WireError) as e:
        raise CheckpointError(f"amsp checkpoint {path}: file {name} is damaged ({e})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_checkpoint_meta(path) -> dict:
    """The ``amsp.json`` table of a complete checkpoint, its own checksum verified (no collective)."""
    return read_meta(Path(path), format=FORMAT)


def verify_checkpoint(path) -> dict:
    """Check every file of the checkpoint against its recorded size and SHA-256 in this process
    (no collective); return its ``amsp.json`` table. Raises a one-line CheckpointError naming
    the first damaged file."""
    path = resolve(Path(path))
    meta = read_checkpoint_meta(path)
    verify_files(path, meta)
    return meta


def dcp_metadata(path) -> dict:
    """DCP's key -> storage metadata (global size, dtype, chunks) of ``path`` (no collective)."""
    path = Path(path)
    try:
        return dcp_io.metadata(path)
    except Exception as e:  # noqa: BLE001 - a damaged safetensors header: name the file if we can
        verify_files(path, read_checkpoint_meta(path))
        raise CheckpointError(f"amsp checkpoint {path}: a tensor file cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def trainable_by_id(e: "Engine") -> dict[int, "LocalTensor"]:
    return {id(t.param): t for t in e.tensors}


# -- save ------------------------------------------------------------------------------------------
class PendingSave:
    """An async save in flight (see [Note: async save]). ``wait()`` returns once the checkpoint
    is published (re-raising what went wrong); ``done()`` does not block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def wait_for_save(model: nn.Module) -> None:
    """Wait for the model's async save in flight, if any (every rank)."""
    e = engine_of(model)
    pending = getattr(e, "pending_save", None)
    if pending is not None:
        e.pending_save = None
        pending.wait()


@torch.no_grad()
def save_checkpoint(model: nn.Module, optimizer, path, *, lr_scheduler=None, extra: Any = None,
                    rng: bool = True, info: dict | None = None,
                    async_save: bool = False) -> PendingSave | None:
    """Write a sharded checkpoint of ``model`` + ``optimizer`` into the directory ``path``.

    Collective. ``extra``: data (None, bool, int, float, str, lists, tuples, dicts, tensors;
    rank 0's is saved as JSON), returned by ``load_checkpoint``. ``rng``: also save each rank's RNG states (restored under the same
    world size). ``info``: a small JSON-able dict recorded in ``amsp.json`` (readable without
    torch). Call between steps; pending parameter broadcasts are awaited first. ``path`` is
    replaced atomically: until the new checkpoint is complete on every rank, the previous one
    of that name stays as it was. ``async_save``: return a :class:`PendingSave` as soon as the
    state is staged (see [Note: async save]).
    """
    e = engine_of(model, optimizer)
    wait_for_save(model)  # one save at a time; the staging directory is reused
    path = Path(path)
    if e.rank == 0:
        begin_staging(path)
    staging = staging_path(path)
    C.barrier(e.comm, None, name="world", timeout=e.config.timeout)  # nobody writes before it is empty
    e.wait_params()
    sd, rows = _tensors_and_rows(model, e)
    # encoded now: what cannot be stored fails at this call, and async saves write this state
    files = _json_files(e, lr_scheduler=lr_scheduler, extra=extra, rng=rng)
    # one writer per chunk, chosen alike on every rank from a JSON table ([Note: DCP without its
    # object collectives] in dcp_io.py); each rank then writes its own file, no collective inside DCP
    tables = C.all_gather_objects(e.comm, dcp_io.chunk_table(sd), None, name="world", timeout=e.config.timeout)
    mine_keys = dcp_io.assign_writers(tables)[e.rank]
    sd = {k: v for k, v in sd.items() if k in mine_keys}
    out = _Staged(path=path, staging=staging, rows=rows, files=files,
                  meta=_meta(model, e, rng, info) if e.rank == 0 else None,
                  needed=sum(_local_bytes(v) for v in sd.values()) + sum(len(d) for d in files.values()))
    if not async_save:
        write_error = None
        try:
            dcp_io.write(sd, staging, rank=e.rank)
        except BaseException as err:  # noqa: BLE001 - shared by the finishing all-gather (DCP's is a BaseException)
            write_error = err
        _finish_save(e, out, None, "world", write_error)
        C.barrier(e.comm, None, name="world", timeout=e.config.timeout)  # published when any rank returns
        return None
    group, name = C.checkpoint_group(e.comm)
    written = dcp_io.write_async(sd, staging, rank=e.rank, group=group)  # staged on return
    pending = PendingSave(path)

    def background() -> None:
        write_error = None
        try:
            written.result()
        except BaseException as err:  # noqa: BLE001 - shared by the finishing all-gather
            write_error = err
        _finish_save(e, out, group, name, write_error)
        C.barrier(e.comm, group, name=name, timeout=e.config.timeout)

    threading.Thread(target=pending._run, args=(background,), name="amsp-async-save", daemon=True).start()
    e.pending_save = pending
    return pending


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Staged:
    """What a save has prepared before DCP writes the tensors: where, this rank's optimizer
    rows and JSON files, rank 0's ``amsp.json`` contents, and the bytes it needs on disk."""

    path: Path
    staging: Path
    rows: list[dict]
    files: dict[str, bytes]
    meta: dict | None
    needed: int


def _master_tensor(e, idx: int) -> "LocalTensor":
    """The tensor a master of the optimizer describes: its local tensor, or - whole masters on
    whole owners (optim/whole_tensor.py) - the whole parameter as one chunk at offset 0, a plain
    tensor DCP writes once and any layout reads its rows of ([Note: whole-tensor optimizers in
    a checkpoint])."""
    t = e.tensors[idx]
    if e.optimizer.whole is None:
        return t
    return dataclasses.replace(t, local_shape=t.global_shape, shard_index=0, param=e.optimizer.masters[idx])


def _tensors_and_rows(model: nn.Module, e) -> tuple[dict[str, Any], list[dict]]:
    """The state dict DCP writes (model, masters unless aliased, tensor states) and one row per
    owned tensor (its layout, state kinds, param-group hyper-parameters and object states)."""
    opt = e.optimizer
    by_id = trainable_by_id(e)
    # a tied alias is stored once, under its first name (safetensors refuses shared storage)
    sd: dict[str, Any] = {MODEL + k: v.detach() for k, v in model.sharded_state_dict(keep_vars=True).items()
                          if by_id.get(id(v)) is None or by_id[id(v)].name == k}
    group_of = {id(p): g for g in opt.inner.param_groups for p in g["params"]}
    rows = []
    for idx, m in opt.masters.items():
        t = _master_tensor(e, idx)
        if opt.mixed_precision:
            sd[MASTER + t.name] = as_global(t, m)
        kinds, objects = {}, {}
        for k, v in opt.inner.state.get(m, {}).items():
            kinds[k] = _state_item(sd, t, k, v, e.plan.sp, whole=opt.kind == "whole_tensor")
            if kinds[k] == "object":
                objects[k] = v
        hps = {k: v for k, v in group_of[id(m)].items() if k != "params"}
        try:
            row_data = wire.to_data({"group": hps, "objects": objects}, f"optimizer state of {t.name!r}")
        except wire.WireError as err:
            raise CheckpointError(f"amsp checkpoint: {err}") from None
        rows.append({"name": t.name, "index": t.index, "shard_index": t.shard_index,
                     "global_shape": list(t.global_shape), "local_shape": list(t.local_shape),
                     "offset": _chunk_offset(t), "state": kinds, **row_data})
    return sd, rows


def _json_files(e, *, lr_scheduler, extra: Any, rng: bool) -> dict[str, bytes]:
    """This rank's JSON files, encoded: rank 0's global state, every rank's RNG states."""
    opt = e.optimizer
    files: dict[str, bytes] = {}
    if e.rank == 0:
        files[STATE_FILE] = _encode({
            "num_steps": opt.num_steps, "scaler": opt.scaler.state_dict() if opt.scaler else None,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "extra": extra}, "extra / LR scheduler state")
    if rng:
        files[RNG_FILE.format(rank=e.rank)] = _encode(rng_state(e.device), "RNG state")
    return files


def _finish_save(e, out: _Staged, group, name: str, write_error: BaseException | None = None) -> None:
    """After DCP wrote the tensors: every rank writes its JSON and hashes the files it wrote;
    rank 0 records them and publishes. A rank that cannot write (its tensors: ``write_error``,
    or its JSON) says so through the same all-gather, so no rank waits for it."""
    failed, mine = None, {}
    try:
        if write_error is not None:
            raise write_error
        for f, data in out.files.items():
            (out.staging / f).write_bytes(data)
        mine = {f: file_digest(out.staging / f) for f in [*rank_files(out.staging, e.rank), *out.files]}
    except BaseException as err:  # DCP wraps its failures in a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        failed = str(_disk_full(out.path, out.staging, out.needed) if _no_space(err) else
                     f"amsp checkpoint {out.path}: cannot write {out.staging} ({_one_line(err)})")
    table = C.all_gather_objects(e.comm, (out.rows, mine, failed), group, name=name,
                                 timeout=e.config.timeout)
    errors = [f for _, _, f in table if f]
    if errors:
        _drop_staging(e.rank, out.staging)
        raise CheckpointError(errors[0])
    if e.rank == 0:
        files = {}
        for _, digests, _ in table:
            files.update(digests)
        write_meta(out.staging, {**out.meta, "tensors": _chunks([r for r, _, _ in table])}, files)
        publish(out.staging, out.path)


# [Note: a full disk]
# A save that runs out of space must say so once, in words a cluster operator acts on: which
# folder, about how much this save needs, how much is free, and that nothing was published (the
# previous checkpoints are intact: a save only ever writes its own staging folder). A rank's
# write failure (DCP wraps it in its CheckpointException) becomes its line in the all-gather that
# ends every save (``_finish_save``), so every rank raises the first rank's line and the launcher
# prints it once; the staging folder is removed so that the disk is not left full.
def _no_space(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps, DCP's per-rank failures included) is ENOSPC."""
    stack, seen = [err], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if (isinstance(x, OSError) and x.errno == errno.ENOSPC) or "No space left on device" in str(x):
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [v for v in failures.values() if isinstance(v, BaseException)]
            stack += [v[0] for v in failures.values() if isinstance(v, tuple) and v and isinstance(v[0], BaseException)]
        stack += [x.__cause__, x.__context__]
    return False


def _disk_full(path: Path, staging: Path, needed: int) -> CheckpointError:
    folder = staging.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = 0
    return CheckpointError(
        f"amsp checkpoint {path}: no space left on {folder} (this save needs about "
        f"{format_size(needed)} per rank, {format_size(free)} free); nothing was published: {path} "
        f"and the checkpoints next to it are unchanged; free space or save elsewhere")


def _local_bytes(v: torch.Tensor) -> int:
    local = v.to_local() if isinstance(v, DTensor) else v
    return local.numel() * local.element_size()


def _one_line(err: BaseException) -> str:
    """The innermost cause of ``err`` in one line (DCP wraps each rank's failure)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            err = inner
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _drop_staging(rank: int, staging: Path) -> None:
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)


def _state_item(sd: dict, t: "LocalTensor", k: str, v: Any, sp: int, *, whole: bool = False) -> str:
    """The kind of one optimizer state, written into ``sd``: object, scalar, param (shaped like
    its tensor), whole (another shape, of a whole-tensor optimizer's whole tensor: one key any
    whole layout reads) or shard (another shape, of a row shard: its sp only)."""
    key = f"{STATE}{t.name}.{k}"
    if not torch.is_tensor(v):
        return "object"  # in the chunk's row of amsp.json
    if v.dim() == 0:
        sd[key] = v.detach()
        return "scalar"
    if tuple(v.shape) == tuple(t.local_shape):
        sd[key] = as_global(t, v)
        return "param"
    if whole:
        sd[key] = v.detach()
        return "whole"
    sd[f"{key}.shard{t.shard_index}of{sp}"] = v.detach()
    return "shard"


def _chunk_offset(t: "LocalTensor") -> list[int]:
    return compat.local_chunk_offset(t.param)


def rng_state(device: torch.device) -> dict:
    import numpy as np

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state().clone()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    import numpy as np

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def hf_info(model: nn.Module) -> tuple[str, dict | None]:
    from torch.distributed.fsdp import FSDPModule

    from amsp_ext.runtime.engine import AMSPModule

    # the user's class, under FSDP2's and our dynamic subclasses
    cls = next(c for c in type(model).__mro__ if not issubclass(c, (AMSPModule, FSDPModule)))
    cfg = getattr(model, "config", None)
    hf = json.loads(cfg.to_json_string(use_diff=False)) if hasattr(cfg, "to_json_string") else None
    if hf is not None:
        hf["architectures"] = [cls.__name__]
    return cls.__name__, hf


def _same_ranks(saved: dict, world) -> bool:
    """Whether rng-<rank>.json holds this rank's own states: the same data-parallel world and the
    same T, so the same number of processes (a checkpoint from before T was saved had T = 1).
    ``size`` alone is the data-parallel world: a 2-rank DDP checkpoint and 4 ranks under TP 2
    have the same one but not the same ranks."""
    return saved.get("size") == world.size and saved.get("tensor_parallel", 1) == world.tensor_parallel


def _meta(model: nn.Module, e: "Engine", rng: bool, info: dict | None) -> dict:
    by_id = trainable_by_id(e)
    model_rows = []
    for k, v in model.sharded_state_dict(keep_vars=True).items():
        t = by_id.get(id(v))
        model_rows.append({"key": k, "shape": list(v.shape), "dtype": dtype_name(v.dtype),
                           "param": t.name if t is not None else None})
    cls, hf = hf_info(model)
    return {
        "format": FORMAT, "plan": str(e.plan), "sp": e.plan.sp,
        "world": {"num_nodes": e.world.num_nodes, "gpus_per_node": e.world.gpus_per_node,
                  "size": e.world.size, "tensor_parallel": e.world.tensor_parallel},
        "precision": e.config.precision, "ownership": e.config.ownership,
        "step": e.optimizer.num_steps, "optimizer": type(e.optimizer.inner).__name__,
        "masters": e.optimizer.mixed_precision, "rng": rng, "torch": torch.__version__,
        "info": json.loads(json.dumps(info or {})),
        "model_class": cls, "hf_config": hf, "model": model_rows,
    }


def _chunks(table: list) -> list[dict]:
    """Every optimizer chunk once, with the ranks that own it."""
    chunks: dict[tuple[str, int], dict] = {}
    for rank, rows in enumerate(table):
        for r in rows:
            c = chunks.setdefault((r["name"], r["shard_index"]), {**r, "owners": []})
            c["owners"].append(rank)
    return sorted(chunks.values(), key=lambda c: (c["index"], c["shard_index"]))


# -- load ------------------------------------------------------------------------------------------
def _check_model(path: Path, meta: dict, current: dict[str, torch.Tensor]) -> None:
    saved = {r["key"]: r for r in meta["model"]}
    for k, v in current.items():
        r = saved.get(k)
        if r is None:
            raise CheckpointError(f"amsp checkpoint {path}: tensor {k!r} of the model is not in the checkpoint")
        if list(v.shape) != r["shape"]:
            raise CheckpointError(f"amsp checkpoint {path}: tensor {k!r} has shape {list(v.shape)} in the "
                                  f"model but {r['shape']} in the checkpoint")
    for r in meta["model"]:
        if r["key"] not in current:
            raise CheckpointError(f"amsp checkpoint {path}: tensor {r['key']!r} of the checkpoint is not in the model")


def _check_optimizer(path: Path, meta: dict, e: "Engine") -> None:
    inner = type(e.optimizer.inner).__name__
    if meta["optimizer"] != inner:
        raise CheckpointError(f"amsp checkpoint {path}: optimizer states were saved from "
                              f"{meta['optimizer']}, this optimizer is {inner}")
    whole_here = e.plan.sp == 1 or e.optimizer.whole is not None  # every master a whole tensor
    for r in meta["tensors"]:
        for k, kind in r["state"].items():
            if kind == "shard" and e.optimizer.whole is not None:
                raise CheckpointError(
                    f"amsp checkpoint {path}: optimizer state {k!r} of {r['name']!r} belongs to a row shard "
                    f"(saved by an optimizer declared elementwise under plan {meta['plan']}); this one steps "
                    f"whole tensors: load it with the same optimizer_kind")
            if kind == "whole" and not whole_here:
                raise CheckpointError(
                    f"amsp checkpoint {path}: optimizer state {k!r} of {r['name']!r} belongs to a whole "
                    f"tensor (a whole-tensor optimizer saved it); this optimizer steps row shards under "
                    f"plan {e.plan}: declare it whole-tensor (optimizer_kind) or load with sp = 1")
    if meta["sp"] == e.plan.sp:
        return
    # decided from the checkpoint's table, not from what this rank owns: every rank must agree
    for r in meta["tensors"]:
        for k, kind in r["state"].items():
            if kind == "shard":
                raise CheckpointError(
                    f"amsp checkpoint {path}: optimizer state {k!r} of {r['name']!r} is per-shard (not "
                    f"shaped like the parameter) and was saved with sp={meta['sp']} (plan "
                    f"{meta['plan']}); it can only be loaded with the same sp, not sp={e.plan.sp}")


@torch.no_grad()
def load_checkpoint(model: nn.Module, optimizer, path, *, lr_scheduler=None, rng: bool = True,
                    optimizer_states: bool = True, verify: bool = True) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` under any plan and world size.

    Collective. Restores parameters, fp32 masters, inner optimizer states and param-group
    hyper-parameters, the step counter, the fp16 loss scaler, ``lr_scheduler`` (if given and
    saved) and, under the same world size, each rank's RNG states. Returns the saved ``extra``.
    ``optimizer_states=False``: weights (parameters and masters) only; the optimizer keeps its
    fresh state, step counter and loss scale, and may be of another class.
    Raises CheckpointError (before any collective) for a missing or incomplete checkpoint, or
    one of another model (first mismatched tensor named) or optimizer class; and, after one
    small all-gather, for a damaged file (``verify``: every file's size and SHA-256 checked
    against ``amsp.json``, each rank reading its share; the error names the file).
    """
    path = resolve(Path(path))
    meta = read_checkpoint_meta(path)
    e = engine_of(model, optimizer)
    restore_rng = rng and meta.get("rng") and _same_ranks(meta["world"], e.world)
    # the JSON every rank reads is checked (and parsed) by every rank: one line on all of them
    verify_files(path, meta, [STATE_FILE])
    glob = _read_json(path, STATE_FILE)
    if not isinstance(glob, dict) or not {"num_steps", "scaler", "lr_scheduler", "extra"} <= set(glob):
        raise CheckpointError(f"amsp checkpoint {path}: file {STATE_FILE} is damaged (not the training state)")
    rng_file = RNG_FILE.format(rank=e.rank)
    saved_rng, rng_error = None, None
    if restore_rng:  # this rank's alone: what is wrong with it is shared by _verify_shared
        rng_error = damage(path, rng_file, meta["files"].get(rng_file, {}))
        if rng_error is None:
            try:
                saved_rng = wire.loads((path / rng_file).read_bytes())
            except wire.WireError as err:
                rng_error = f"is damaged ({err})"
    opt = e.optimizer
    md = dcp_metadata(path)
    current = model.sharded_state_dict(keep_vars=True)
    _check_model(path, meta, current)
    if optimizer_states:
        _check_optimizer(path, meta, e)
    # -- no collective above this line ------------------------------------------------------
    wait_for_save(model)
    if verify or restore_rng:
        _verify_shared(path, meta, e, files=verify, own=(rng_file, rng_error) if rng_error else None)
    e.wait_params()  # no broadcast may land after the load
    reshard_all(model)
    opt.zero_grad()
    sd: dict[str, Any] = {}
    masters_to_params = _param_targets(e, current, md, sd)
    names = [t.name for t in e.tensors]
    if optimizer_states:
        states = _state_targets(e, meta, md, sd)
    _read_shared(sd, path, e)

    for idx in masters_to_params:
        e.tensors[idx].local().copy_(opt.local_masters[idx])
    if opt.whole is not None:  # the whole masters from the rows just read (one all-to-all)
        opt.whole.refresh_masters()
    if optimizer_states:
        _load_inner(e, meta, states, names)
        opt.num_steps = int(glob["num_steps"])
        if opt.scaler is not None and glob["scaler"]:
            opt.scaler.load_state_dict(glob["scaler"])
    if lr_scheduler is not None:
        if glob["lr_scheduler"] is None:
            warnings.warn(f"amsp checkpoint {path}: no LR scheduler state was saved; lr_scheduler left as is")
        else:
            lr_scheduler.load_state_dict(glob["lr_scheduler"])
    if restore_rng:
        set_rng_state(saved_rng, e.device)
    elif rng and meta.get("rng") and e.rank == 0:
        saved = meta["world"]
        warnings.warn(f"amsp checkpoint {path}: saved on {saved['size']} data-parallel ranks x TP "
                      f"{saved.get('tensor_parallel', 1)}, loaded on {e.world.size} x TP {e.world.tensor_parallel}: "
                      f"RNG states not restored")
    return glob["extra"]


def _verify_shared(path: Path, meta: dict, e: "Engine", *, files: bool = True,
                   own: tuple[str, str] | None = None) -> None:
    """Every data file checked once across the ranks (rank r reads files r, r + W, ...); one
    all-gather of the findings, so every rank refuses with the same line, naming the file."""
    names = sorted(meta["files"])
    found = f"{own[0]}\0{own[1]}" if own else ""
    for i in (range(e.rank, len(names), e.world.size) if files and not found else ()):
        what = damage(path, names[i], meta["files"][names[i]])
        if what is not None:
            found = f"{names[i]}\0{what}"
            break
    got = [g.decode(errors="replace") for g in C.all_gather_bytes(e.comm, found.encode()[:200], None, name="world",
                                                                  width=200, timeout=e.config.timeout)]
    bad = sorted(tuple(g.split("\0", 1)) for g in got if "\0" in g)
    if bad:
        name, what = bad[0]
        raise CheckpointError(f"amsp checkpoint {path}: file {name} {what}; the checkpoint "
                              f"cannot be used (load an older one)")


def _read_shared(sd: dict, path: Path, e: "Engine") -> None:
    """Each rank reads its targets alone (dcp_io: [Note: DCP without its object collectives]);
    one all-gather of what went wrong, so a rank that cannot read stops every rank with its line."""
    found = ""
    try:
        dcp_io.read(sd, path)
    except BaseException as err:  # DCP wraps its failures in a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        found = f"rank {e.rank}: {_one_line(err)}"
    got = [g.decode(errors="replace") for g in C.all_gather_bytes(e.comm, found.encode()[:200], None, name="world",
                                                                  width=200, timeout=e.config.timeout)]
    bad = [g for g in got if g]
    if bad:
        raise CheckpointError(f"amsp checkpoint {path}: the tensors cannot be read ({bad[0]})")


def reshard_all(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # no-op when already sharded; never a collective


def _param_targets(e: "Engine", current: dict, md: dict, sd: dict) -> list[int]:
    """Fill ``sd`` with the parameter (and master) targets; return the owned tensor indices
    whose local parameter must then be set from the loaded master."""
    opt = e.optimizer
    by_id = trainable_by_id(e)
    after = []
    for k, v in current.items():
        t = by_id.get(id(v))
        if t is None:  # frozen parameter or persistent buffer
            sd[MODEL + k] = v.detach()
            continue
        if t.name != k:  # a tied alias: loaded through its first name
            continue
        src = MASTER + t.name if MASTER + t.name in md else MODEL + t.name
        if not opt.mixed_precision:
            sd[src] = v.detach()  # the parameter is the master (or, whole masters, its rows)
        elif t.index in opt.local_masters:
            sd[src] = as_global(t, opt.local_masters[t.index])
            after.append(t.index)
        elif md[MODEL + k].properties.dtype == v.dtype:
            sd[MODEL + k] = v.detach()  # the owner's rounding of the same master
        else:
            sd[src] = v.detach()  # e.g. bf16 saved, fp16 here: round the master, like the owner
    return after


def _state_targets(e: "Engine", meta: dict, md: dict, sd: dict) -> dict[int, dict[str, Any]]:
    """Allocate the owned optimizer states (shapes and dtypes from the checkpoint) in ``sd``."""
    kinds = {r["name"]: r["state"] for r in meta["tensors"]}
    out: dict[int, dict[str, Any]] = {}
    for idx in e.optimizer.masters:
        t = _master_tensor(e, idx)
        st: dict[str, Any] = {}
        for k, kind in kinds.get(t.name, {}).items():
            key = f"{STATE}{t.name}.{k}"
            if kind == "object":
                st[k] = (k,)  # from the chunk's row of amsp.json, after the load
                continue
            if kind == "shard":
                key = f"{key}.shard{t.shard_index}of{e.plan.sp}"
            props = md[key]
            if kind == "scalar":
                local = torch.empty((), dtype=props.properties.dtype)
                sd[key] = local
            elif kind == "param":
                local = torch.empty(t.local_shape, dtype=props.properties.dtype, device=e.device)
                sd[key] = as_global(t, local)
            else:
                local = torch.empty(tuple(props.size), dtype=props.properties.dtype, device=e.device)
                sd[key] = local
            st[k] = local
        out[idx] = st
    return out


def _rows_by_name(meta: dict) -> dict[str, dict]:
    """The first chunk row of every tensor (param-group hyper-parameters are per tensor)."""
    out: dict[str, dict] = {}
    for r in meta["tensors"]:
        out.setdefault(r["name"], r)
    return out


def _load_inner(e: "Engine", meta: dict, states: dict[int, dict[str, Any]], names: list[str]) -> None:
    """Hand the loaded states and hyper-parameters to the inner optimizer's own load_state_dict
    (which casts ``step`` & co. the way that optimizer wants)."""
    opt = e.optimizer
    inner_sd = opt.inner.state_dict()
    pos = {id(p): i for i, p in enumerate(p for g in opt.inner.param_groups for p in g["params"])}
    rows = _rows_by_name(meta)
    chunk = {(r["name"], r["shard_index"]): r for r in meta["tensors"]}

    def obj(t, k):
        r = chunk.get((t.name, t.shard_index), rows[t.name])
        return wire.from_data(r.get("objects", {})[k])

    new_state = {}
    for idx, st in states.items():
        if st:
            t = e.tensors[idx]
            new_state[pos[id(opt.masters[idx])]] = {
                k: obj(t, v[0]) if isinstance(v, tuple) else v for k, v in st.items()}
    inner_sd["state"] = new_state
    for g_sd, g in zip(inner_sd["param_groups"], opt.inner.param_groups):
        gnames = [p.amsp_name for p in g["params"] if hasattr(p, "amsp_name")]
        if not gnames and not opt.masters:
            gnames = names[:1]  # the placeholder group of a rank that owns nothing
        if not gnames:
            continue  # a group with none of this rank's tensors keeps what the factory gave it
        hps = [wire.from_data(rows[n]["group"]) for n in gnames]
        if any(_hp_key(h) != _hp_key(hps[0]) for h in hps[1:]):
            warnings.warn(f"amsp checkpoint: a param group mixes tensors saved with different "
                          f"hyper-parameters (e.g. {gnames[0]!r}); using those of {gnames[0]!r}")
        g_sd.update(hps[0])
    opt.inner.load_state_dict(inner_sd)


def _hp_key(h: dict) -> str:
    return repr(sorted((k, v.tolist() if torch.is_tensor(v) else v) for k, v in h.items()))


def checkpoint_step(path) -> int:
    """The optimizer step a checkpoint was saved at (no collective)."""
    return int(read_checkpoint_meta(path)["step"])

