"""Consolidated, Hugging Face compatible weights: full tensors keyed by the model's own
``state_dict`` names (for a ``LlamaForCausalLM``, exactly what ``load_state_dict(strict=True)``
expects).

- ``consolidated_state_dict(model, dtype=None, rank0_only=True)``: from the live sharded model
  (collective).
- ``model.state_dict()`` on the integration routes gives full tensors too (runtime/engine.py
  ``full_state_dict``, [Note: state dicts on the integration routes]).
- ``save_pretrained(model, save_directory, dtype=None)``: the same, written by rank 0 as
  ``model.safetensors`` + ``config.json`` (what ``from_pretrained`` reads).
- ``export_checkpoint(path, save_directory=None, dtype=None)``: from a saved checkpoint, in one
  process, no process group needed (DCP reads and stitches the chunks of any plan).

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
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.state.checkpoint import (MASTER, MODEL, dtype_name, hf_info, as_global, dcp_metadata,
                                         engine_of, trainable_by_id, verify_checkpoint)
from amsp_ext.runtime.state.checkpoint_files import resolve
from amsp_ext.runtime.config import compute_dtype

__all__ = ["consolidated_state_dict", "export_checkpoint", "save_pretrained"]

WEIGHTS_NAME = "model.safetensors"


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
    e = engine_of(model)
    dtype = dtype or torch.float32
    e.wait_params()
    keep = not rank0_only or e.rank == 0
    gather = not rank0_only or 0 in e.mesh.ranks["param_shard"]
    use_masters = not e.optimizer._aliased and dtype != compute_dtype(e.config)
    by_id = trainable_by_id(e)
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor | None] = {}  # tied aliases: gathered (and broadcast) once
    for k, v in model.sharded_state_dict(keep_vars=True).items():
        if id(v) in seen:
            if keep:
                out[k] = seen[id(v)]
            continue
        t = by_id.get(id(v))
        value = v.detach()
        if t is not None and use_masters:
            value = as_global(t, _master_shard(e, t))
        full = _cast(C.full_tensor(e.comm, value, name=e.name("param_shard")), dtype) if gather else None
        seen[id(v)] = full if keep else None  # gatherers other than rank 0 drop it right away
        if keep:
            out[k] = full
    return out


def _master_shard(e, t) -> torch.Tensor:
    """The fp32 master of ``t``'s local shard on every rank of its optim_bcast group."""
    opt = e.optimizer
    if t.index in opt.masters:
        buf = opt.masters[t.index].detach()
    else:
        buf = torch.empty(t.local_shape, dtype=torch.float32, device=e.device)
    if e.size("optim_bcast") > 1 and t.numel:
        C.broadcast(e.comm, buf, t.owner_rank, e.group("optim_bcast"), name=e.name("optim_bcast"),
                    stream=None, async_op=False, timeout=e.config.timeout)
    return buf


def _write_pretrained(save_directory, state: dict[str, torch.Tensor], hf_config: dict | None,
                      dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    first: dict[int, str] = {}
    tensors = {}
    for k, v in state.items():
        if id(v) in first:  # safetensors refuses shared storage; from_pretrained re-ties
            continue
        first[id(v)] = k
        tensors[k] = v.contiguous()
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    if hf_config is not None:
        cfg = {**hf_config, "dtype": dtype_name(dtype)}
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def save_pretrained(model: nn.Module, save_directory, *, dtype: torch.dtype | None = None) -> None:
    """Rank 0 writes ``model.safetensors`` + ``config.json`` (``from_pretrained``-loadable).
    Collective; returns once the files exist."""
    e = engine_of(model)
    dtype = dtype or torch.float32
    state = consolidated_state_dict(model, dtype=dtype, rank0_only=True)
    if e.rank == 0:
        _write_pretrained(save_directory, state, hf_info(model)[1], dtype)
    C.barrier(e.comm, None, name="world", timeout=e.config.timeout)


@torch.no_grad()
def export_checkpoint(path, save_directory=None, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Consolidate a saved checkpoint in this process (no process group needed): full tensors
    keyed by the model's ``state_dict`` names, fp32 masters when the checkpoint has them. With
    ``save_directory``, also write ``model.safetensors`` + ``config.json`` there. Every file is
    checked against its checksum first."""
    path = resolve(Path(path))
    meta = verify_checkpoint(path)
    md = dcp_metadata(path)
    dtype = dtype or torch.float32
    src_of: dict[str, str] = {}
    for r in meta["model"]:
        name = r["param"] or r["key"]
        src_of[r["key"]] = MASTER + name if r["param"] and MASTER + name in md else MODEL + name
    sd = {}
    for src in set(src_of.values()):
        props = md[src]
        sd[src] = torch.empty(tuple(props.size), dtype=props.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the point
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        # one process, no collective: a context of its own only to satisfy the signature
        C.checkpoint_load(C.CollectiveContext(), sd, path, no_dist=True)
    full = {src: _cast(t, dtype) for src, t in sd.items()}
    out = {k: full[src] for k, src in src_of.items()}
    if save_directory is not None:
        _write_pretrained(save_directory, out, meta.get("hf_config"), dtype)
    return out
