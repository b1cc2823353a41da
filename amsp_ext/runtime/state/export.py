"""Consolidated, Hugging Face compatible weights: full tensors keyed by the model's own
``state_dict`` names (for a ``LlamaForCausalLM``, exactly what ``load_state_dict(strict=True)``
expects).

- ``consolidated_state_dict(model, dtype=None, rank0_only=True)``: from the live sharded model
  (collective).
- ``model.state_dict()`` on the integration routes gives full tensors too (runtime/engine.py
  ``full_state_dict``, [Note: state dicts on the integration routes]).
- ``save_pretrained(model, save_directory, dtype=None, max_shard_size="5GB")``: the same,
  written by rank 0 as Hugging Face sharded safetensors (``model-0000K-of-0000N.safetensors``
  + ``model.safetensors.index.json``, or one ``model.safetensors``) + ``config.json``: what
  ``from_pretrained`` and ``shard(init_from=...)`` read.
- ``export_checkpoint(path, save_directory=None, dtype=None, max_shard_size="5GB")``: from a
  saved checkpoint, in one process, no process group needed (DCP reads and stitches the chunks
  of any plan).

[Note: the writer holds one file]
A consolidated model is as large as the model, which is why it was sharded; so the writers
never hold it. The split into files is decided first, from the shapes and dtypes alone (greedy
in state-dict order, a new file when the next tensor would pass ``max_shard_size``, as
transformers splits), then the tensors of one file are gathered (or read from the checkpoint)
and written, and dropped before the next file's. Peak: one file's worth (or one tensor larger
than ``max_shard_size``, alone in its file).

[Note: which weights]
``dtype=None`` means fp32: ``shard()`` takes an fp32 model, so that is the model's original
dtype, and under bf16/fp16 the fp32 masters hold the trained weights at full precision. They
live on the owners only: each owner broadcasts its master inside its ``optim_bcast`` group (like
an optimizer step does with the parameters), then the ``param_shard`` group all-gathers the full
tensor (DTensor's all-gather). Asking for the compute dtype skips the broadcast: a parameter is
its master rounded to the compute dtype, on every replica. With ``rank0_only`` only the
``param_shard`` group of rank 0 gathers; the others only take part in the broadcasts.
Tied weights appear under every name, like ``state_dict()``; the safetensors file keeps the
first (``from_pretrained`` re-ties the rest).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.state import dcp_io
from amsp_ext.runtime.state.checkpoint import (MASTER, MODEL, dtype_name, hf_info, as_global, dcp_metadata,
                                         engine_of, trainable_by_id, verify_checkpoint)
from amsp_ext.runtime.state.checkpoint_files import resolve
from amsp_ext.runtime.config import compute_dtype
from amsp_ext.runtime.state.safetensors_folder import INDEX_NAME, WEIGHTS_NAME
from amsp_ext.choices import parse_size

__all__ = ["consolidated_state_dict", "export_checkpoint", "save_pretrained", "split_into_files"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    dtype = dtype if t.is_floating_point() else t.dtype
    return t.detach().to(device="cpu", dtype=dtype, copy=True)


@torch.no_grad()
def consolidated_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None,
                            rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU tensors keyed by ``model.state_dict()`` names; collective (every rank calls it).

    ``dtype``: of floating tensors (None: fp32, see [Note: which weights]). ``rank0_only``: the
    dict is returned on rank 0 and ``{}`` elsewhere; else every rank gets it.
    """
    return dict(_full_tensors(model, dtype=dtype, rank0_only=rank0_only))


def _full_tensors(model: nn.Module, *, dtype: torch.dtype | None, rank0_only: bool,
                  keys: set[str] | None = None):
    """Yields (key, full CPU tensor) in state-dict order (rank0_only: on rank 0 only), for
    ``keys`` (None: all); tied aliases are one tensor, gathered once."""
    e = engine_of(model)
    dtype = dtype or torch.float32
    e.wait_params()
    keep = not rank0_only or e.rank == 0
    # under TP a parameter's full tensor spans the TP group (and, sp > 1, the data-parallel one):
    # every rank takes part in its gather
    gather = not rank0_only or 0 in e.mesh.ranks["param_shard"] or e.world.tensor_parallel > 1
    # a forward-only engine has no masters: its parameters are the values
    use_masters = e.optimizer is not None and not e.optimizer._aliased and dtype != compute_dtype(e.config)
    by_id = trainable_by_id(e)
    seen: dict[int, torch.Tensor | None] = {}  # tied aliases: gathered (and broadcast) once
    for k, v in model.sharded_state_dict(keep_vars=True).items():
        if keys is not None and k not in keys:
            continue
        if id(v) in seen:
            if keep:
                yield k, seen[id(v)]
            continue
        t = by_id.get(id(v))
        value = v.detach()
        if t is not None and use_masters:
            value = as_global(t, _master_shard(e, t))
        full = _cast(C.full_tensor(e.comm, value, name=e.name("param_shard")), dtype) if gather else None
        seen[id(v)] = full if keep else None  # gatherers other than rank 0 drop it right away
        if keep:
            yield k, full


def _master_shard(e, t) -> torch.Tensor:
    """The fp32 master of ``t``'s local shard on every rank of its optim_bcast group."""
    opt = e.optimizer
    if opt.whole is not None:  # masters are whole tensors; the owner's fp32 rows are kept apart
        buf = (opt.whole.rows[t.index].detach() if t.index in opt.whole.rows
               else torch.empty(t.local_shape, dtype=torch.float32, device=e.device))
    elif t.index in opt.masters:
        buf = opt.masters[t.index].detach()
    else:
        buf = torch.empty(t.local_shape, dtype=torch.float32, device=e.device)
    if e.size("optim_bcast") > 1 and t.numel:
        C.broadcast(e.comm, buf, t.owner_rank, e.group("optim_bcast"), name=e.name("optim_bcast"),
                    stream=None, async_op=False, timeout=e.config.timeout)
    return buf


def split_into_files(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, grouped into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    files: list[list[str]] = []
    used = 0
    for key, n in sizes:
        if not files or (used + n > max_shard_bytes and files[-1]):
            files.append([])
            used = 0
        files[-1].append(key)
        used += n
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _unique_sizes(state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[tuple[str, int]]:
    """(key, bytes written) of each tensor once (the first name of tied aliases)."""
    first: set[int] = set()
    out = []
    for k, v in state.items():
        if id(v) in first:  # safetensors refuses shared storage; from_pretrained re-ties
            continue
        first.add(id(v))
        out.append((k, v.numel() * (dtype if v.is_floating_point() else v.dtype).itemsize))
    return out


def _write_files(out: Path, files: list[list[str]], tensors_of) -> None:
    """``tensors_of(keys)`` -> {key: tensor} for one file at a time (see [Note: the writer
    holds one file]); then the index when there are several files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    names = _file_names(len(files))
    weight_map, total = {}, 0
    for keys, name in zip(files, names):
        tensors = {k: v.contiguous() for k, v in tensors_of(keys).items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))


def _write_config(out: Path, hf_config: dict | None, dtype: torch.dtype) -> None:
    if hf_config is not None:
        cfg = {**hf_config, "dtype": dtype_name(dtype)}
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _max_bytes(max_shard_size) -> int:
    return parse_size(max_shard_size, field="max_shard_size") if isinstance(max_shard_size, str) \
        else int(max_shard_size)


def save_pretrained(model: nn.Module, save_directory, *, dtype: torch.dtype | None = None,
                    max_shard_size: "int | str" = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Rank 0 writes Hugging Face sharded safetensors + ``config.json`` (``from_pretrained``-
    loadable), one file's tensors at a time. Collective; returns once the files exist."""
    e = engine_of(model)
    dtype = dtype or torch.float32
    limit = _max_bytes(max_shard_size)
    sizes = _unique_sizes(model.sharded_state_dict(keep_vars=True), dtype)
    files = split_into_files(sizes, limit)
    out = Path(save_directory)

    def tensors_of(keys):
        return dict(_full_tensors(model, dtype=dtype, rank0_only=True, keys=set(keys)))

    if e.rank == 0:
        _write_files(out, files, tensors_of)
        _write_config(out, hf_info(model)[1], dtype)
    else:  # the same gathers, in the same order
        for keys in files:
            tensors_of(keys)
    C.barrier(e.comm, None, name="world", timeout=e.config.timeout)


@torch.no_grad()
def export_checkpoint(path, save_directory=None, *, dtype: torch.dtype | None = None,
                      max_shard_size: "int | str" = DEFAULT_MAX_SHARD_SIZE) -> dict[str, torch.Tensor] | None:
    """Consolidate a saved checkpoint in this process (no process group needed): full tensors
    keyed by the model's ``state_dict`` names, fp32 masters when the checkpoint has them. With
    ``save_directory``, write Hugging Face sharded safetensors + ``config.json`` there instead,
    one file's tensors in memory at a time, and return None. Every file is checked against its
    checksum first."""
    path = resolve(Path(path))
    meta = verify_checkpoint(path)
    md = dcp_metadata(path)
    dtype = dtype or torch.float32
    src_of: dict[str, str] = {}
    for r in meta["model"]:
        name = r["param"] or r["key"]
        src_of[r["key"]] = MASTER + name if r["param"] and MASTER + name in md else MODEL + name

    def read(keys) -> dict[str, torch.Tensor]:
        srcs = {src_of[k] for k in keys}
        sd = {src: torch.empty(tuple(md[src].size), dtype=md[src].properties.dtype) for src in srcs}
        dcp_io.read(sd, path)  # in this process alone, these keys only
        full = {src: _cast(t, dtype) for src, t in sd.items()}
        return {k: full[src_of[k]] for k in keys}

    if save_directory is None:
        return read(list(src_of))
    first: dict[str, str] = {}
    sizes = []
    for k, src in src_of.items():  # tied aliases share a source: written once, under the first key
        if src in first:
            continue
        first[src] = k
        props = md[src]
        item = (dtype if props.properties.dtype.is_floating_point else props.properties.dtype).itemsize
        sizes.append((k, int(torch.Size(props.size).numel()) * item))
    out = Path(save_directory)
    _write_files(out, split_into_files(sizes, _max_bytes(max_shard_size)), read)
    _write_config(out, meta.get("hf_config"), dtype)
    return None
