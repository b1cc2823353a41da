"""``amsp checkpoint convert --trust SRC DST``: an old checkpoint with pickled parts, rewritten in
the current pickle-free format.

[Note: converting a trusted checkpoint]
Formats amsp-checkpoint/1 and /2 kept their tensors in DCP's FileSystemWriter layout, whose
``.metadata`` is a pickle, and every non-tensor value (param-group hyper-parameters, non-tensor
optimizer states, the step counter / loss scaler / LR scheduler / ``extra`` as ``amsp.state``,
each rank's RNG states as ``amsp.rng.<rank>``) as ``torch.save`` bytes inside DCP. Reading any
of them runs whatever the pickles say, so the loader refuses those formats
(checkpoint_files.read_meta); this module is the one place that reads them, and only when the
caller says it trusts the files (``trust=True``, the CLI's ``--trust``), checked before a byte is
read. It runs in one process, without a process group: the tensors come back whole (DCP reads
every chunk of each key into a tensor of the global shape), the pickled values become JSON
(runtime/wire.py; a value JSON cannot hold, e.g. an ``extra`` of a user's class, is refused
naming it), and the result is written exactly as a 1-rank ``save_checkpoint`` would write it:
one safetensors file, ``amsp.state.json``, ``rng-<rank>.json`` per saved rank, and ``amsp.json``
with the old table (plan, world, model and optimizer-chunk rows) plus the new checksums and,
with a key, the signature. Loading it then reshards like any checkpoint (the saved plan and
world are kept, so a load under the same world restores the RNG states too).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from amsp_ext.runtime import wire
from amsp_ext.runtime.state import dcp_io
from amsp_ext.runtime.state.checkpoint_files import (FORMAT, META_FILE, PICKLED_FORMATS, RNG_FILE, STATE_FILE,
                                                     CheckpointError, begin_staging, file_digest, meta_checksum,
                                                     meta_object, publish, rank_files, resolve, staging_path,
                                                     verify_files, write_meta)

__all__ = ["convert_checkpoint"]

_GROUP = "optim.param_groups."  # + tensor name (formats /1 and /2)
_STATE = "optim.state."
_GLOBAL = "amsp.state"
_RNG = "amsp.rng."  # + rank


def _unpack_trusted(data: bytes) -> Any:
    # amsp: trusted - the only unpickling in amsp_ext, reached only with trust=True (--trust)
    return torch.load(io.BytesIO(data), weights_only=False)


def _data(obj: Any, where: str, src: Path) -> Any:
    try:
        return wire.to_data(obj, where)
    except wire.WireError as e:
        raise CheckpointError(f"amsp checkpoint convert: {src}: {e}; it cannot be converted") from None


def _old_meta(src: Path) -> dict:
    meta_file = src / META_FILE
    if not src.is_dir():
        raise CheckpointError(f"amsp checkpoint convert: {src} is not a directory")
    if not meta_file.is_file():
        raise CheckpointError(f"amsp checkpoint convert: {src} is not an amsp checkpoint (no {META_FILE})")
    meta = meta_object(meta_file, f"amsp checkpoint convert: {src}")
    fmt = meta.get("format")
    if fmt == FORMAT:
        raise CheckpointError(f"amsp checkpoint convert: {src} already has the current format {FORMAT!r}")
    if fmt not in PICKLED_FORMATS:
        raise CheckpointError(f"amsp checkpoint convert: {src} has format {fmt!r}; convertible: "
                              f"{', '.join(PICKLED_FORMATS)}")
    if not (src / ".metadata").is_file():
        raise CheckpointError(f"amsp checkpoint convert: {src} has no .metadata (the save did not finish)")
    if fmt != PICKLED_FORMATS[0]:  # /2 recorded every file's size and SHA-256
        if meta.get("checksum") != meta_checksum(meta) or not isinstance(meta.get("files"), dict):
            raise CheckpointError(f"amsp checkpoint convert: {src}: file {META_FILE} is damaged (checksum mismatch)")
        verify_files(src, meta)
    return meta


def convert_checkpoint(src, dst, *, trust: bool = False) -> dict:
    """Rewrite the old-format checkpoint ``src`` (pickled parts) as a current one at ``dst``
    (which must not exist), in this process; returns the new ``amsp.json`` table. ``trust``
    must be True: reading ``src`` unpickles it (see [Note: converting a trusted checkpoint])."""
    src, dst = resolve(Path(src)), Path(dst)
    if not trust:
        raise CheckpointError(
            f"amsp checkpoint convert: {src} would be unpickled (its .metadata and state are pickles, which "
            f"can run any code): pass --trust only for a checkpoint you or someone you trust wrote")
    if dst.exists():
        raise CheckpointError(f"amsp checkpoint convert: {dst} exists; give a new folder")
    if not dst.parent.is_dir():
        raise CheckpointError(f"amsp checkpoint convert: {dst.parent} is not a directory")
    meta = _old_meta(src)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dcp_io.quiet_single_process()
    reader = dcp.FileSystemReader(str(src))
    try:
        md = reader.read_metadata().state_dict_metadata  # a pickle: trusted
        sd: dict[str, Any] = {k: b"" if isinstance(m, BytesStorageMetadata) else
                              torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(src)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - a damaged old checkpoint: one line naming it
        raise CheckpointError(f"amsp checkpoint convert: {src} cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    objects = {k: _unpack_trusted(v) for k, v in sd.items() if isinstance(v, bytes)}
    tensors = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    # a tied alias is stored once, under its first name (as save_checkpoint does)
    for r in meta.get("model", []):
        if r.get("param") and r["param"] != r["key"]:
            tensors.pop("model." + r["key"], None)

    if _GLOBAL not in objects:
        raise CheckpointError(f"amsp checkpoint convert: {src} has no training state ({_GLOBAL})")
    state = _data(objects[_GLOBAL], "the training state (step, scaler, LR scheduler, extra)", src)
    rows = []
    for r in meta.get("tensors", []):
        name = r["name"]
        group = objects.get(_GROUP + name)
        if group is None:
            raise CheckpointError(f"amsp checkpoint convert: {src} has no param-group state of {name!r}")
        row = {k: v for k, v in r.items() if k not in ("group", "objects")}
        row["group"] = _data(group, f"param group of {name!r}", src)
        row["objects"] = {k: _data(objects[f"{_STATE}{name}.{k}"], f"optimizer state {k!r} of {name!r}", src)
                          for k, kind in r["state"].items() if kind == "object"}
        rows.append(row)
    rng = {int(k[len(_RNG):]): _data(v, f"RNG state of rank {k[len(_RNG):]}", src)
           for k, v in objects.items() if k.startswith(_RNG)}

    staging = begin_staging(dst)
    try:
        dcp_io.write(tensors, staging, rank=0)
        json_files = {STATE_FILE: json.dumps(state, separators=(",", ":"), allow_nan=False).encode()}
        for rank, data in rng.items():
            json_files[RNG_FILE.format(rank=rank)] = json.dumps(data, separators=(",", ":"),
                                                                allow_nan=False).encode()
        for f, data in json_files.items():
            (staging / f).write_bytes(data)
        files = {f: file_digest(staging / f) for f in [*rank_files(staging, 0), *json_files]}
        new = {k: v for k, v in meta.items() if k not in ("files", "checksum", "signature", "tensors")}
        new.update(format=FORMAT, tensors=rows, rng=bool(rng) and bool(meta.get("rng", True)),
                   info={**(meta.get("info") or {}), "converted_from": meta["format"]})
        write_meta(staging, new, files)
        publish(staging, dst)
    except BaseException:
        shutil.rmtree(staging_path(dst), ignore_errors=True)
        raise
    return json.loads((dst / META_FILE).read_bytes())
