"""A checkpoint directory on disk: staged in a temporary sibling, published by one rename,
checksummed file by file and verified before anything is read. It needs no process group, so the
launcher checks a checkpoint before it starts any rank.

[Note: atomic publish]
``save_checkpoint(path)`` never writes into ``path``. Rank 0 empties the sibling
``.<name>.amsp-staging`` (what a killed save left behind), every rank writes its files there,
rank 0 writes ``amsp.json`` last and then publishes the directory in one step:
``renameat2(RENAME_EXCHANGE)`` swaps it with an existing ``path`` (the old checkpoint lands in
the staging name and is removed afterwards), or a plain ``rename`` when ``path`` is new. So at
every instant ``path`` is either the complete previous checkpoint or the complete new one; a
kill at any point loses at most the save in progress. Where the file system lacks
RENAME_EXCHANGE (checked on first use), the old directory is first renamed to
``.<name>.amsp-previous``; a save cut between the two renames leaves ``path`` missing and the
previous checkpoint there, which readers (:func:`resolve`) use and the next save puts back.

[Note: checksums]
``amsp.json`` records the size and SHA-256 of every other file of the checkpoint (each rank
hashes the files it wrote, from the page cache, right after writing them) and a SHA-256 of its
own content (canonical JSON without the ``checksum`` field). Loading checks all of them before
DCP reads a byte, and refuses a damaged checkpoint with one line naming the file. A single
flipped byte in ``amsp.json`` either breaks the JSON (a byte of its whitespace or punctuation)
or changes its content, so it is caught too.

[Note: signatures]
A checksum only detects damage: whoever can write the folder can recompute it. With a key
(``AMSP_CHECKPOINT_KEY``, which ``amsp train --checkpoint-key`` sets for its ranks) ``amsp.json``
also carries ``signature``, an HMAC-SHA256 of the same canonical JSON the checksum covers; since
that JSON holds the size and SHA-256 of every other file, the signature vouches for the whole
checkpoint. A keyed process refuses an unsigned checkpoint and one signed with another key before
it reads anything else; an unkeyed one loads signed checkpoints too (it cannot check them).
Checkpoints carry no code either way ([Note: nothing is unpickled] in checkpoint.py); the key
adds "written by someone who holds the key".
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["CheckpointError", "FORMAT", "KEY_ENV", "META_FILE", "RNG_FILE", "STATE_FILE", "begin_staging",
           "checkpoint_key", "file_digest", "meta_checksum", "publish", "rank_files", "read_meta", "resolve", "staging_path",
           "verify_files", "write_meta"]

FORMAT = "amsp-checkpoint/3"  # /2: atomic publish, checksums of every file; /3: no pickle anywhere
PICKLED_FORMATS = ("amsp-checkpoint/1", "amsp-checkpoint/2")
META_FILE = "amsp.json"
STATE_FILE = "amsp.state.json"  # rank 0: step counter, loss scaler, LR scheduler, extra
RNG_FILE = "rng-{rank}.json"
KEY_ENV = "AMSP_CHECKPOINT_KEY"
_CHUNK = 8 << 20
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded here (missing, incomplete, damaged, or another model)."""


def staging_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.amsp-staging")


def aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.amsp-previous")


def resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint a publish without RENAME_EXCHANGE left aside when
    it was cut between its two renames (see [Note: atomic publish])."""
    path = Path(path)
    if not path.exists() and aside_path(path).is_dir():
        return aside_path(path)
    return path


def begin_staging(path: Path) -> Path:
    """Rank 0, before any rank writes: an empty staging directory next to ``path``."""
    path = Path(path)
    aside = aside_path(path)
    if aside.is_dir():  # a fallback publish was cut: put the previous checkpoint back first
        if path.exists():
            shutil.rmtree(aside)
        else:
            os.rename(aside, path)
    staging = staging_path(path)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def rank_files(directory: Path, rank: int) -> list[str]:
    """The safetensors files DCP's HuggingFaceStorageWriter(save_distributed=True) wrote for
    ``rank`` (``shard-<rank + 1>-model-00001-of-00001.safetensors``; none if it wrote nothing)."""
    return sorted(p.name for p in Path(directory).glob(f"shard-{rank + 1:05d}-model-*.safetensors"))


def checkpoint_key() -> bytes | None:
    key = os.environ.get(KEY_ENV)
    return key.encode() if key else None


def _signature(meta: dict, key: bytes) -> str:
    body = {k: v for k, v in meta.items() if k not in ("checksum", "signature")}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), "sha256").hexdigest()


def _self_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k not in ("checksum", "signature")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def meta_checksum(meta: dict) -> str:
    """The SHA-256 ``amsp.json`` records of its own content (see [Note: checksums])."""
    return _self_checksum(meta)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(directory: Path, meta: dict, files: dict[str, dict]) -> None:
    """Write ``amsp.json`` (the table plus ``files`` and its own checksum) durably."""
    meta = {**meta, "files": dict(sorted(files.items()))}
    meta["checksum"] = _self_checksum(meta)
    key = checkpoint_key()
    if key is not None:
        meta["signature"] = {"hmac-sha256": _signature(meta, key)}
    tmp = Path(directory) / (META_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(directory) / META_FILE)
    _fsync_dir(Path(directory))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def publish(staging: Path, path: Path) -> None:
    """Make the complete ``staging`` directory visible as ``path`` in one rename."""
    staging, path = Path(staging), Path(path)
    _fsync_dir(staging)
    sys.audit("amsp.checkpoint.publish", str(staging), str(path))  # a kill point for the tests
    if not path.exists():
        os.rename(staging, path)
    elif _exchange(staging, path):
        shutil.rmtree(staging)  # now the previous checkpoint
    else:
        aside = aside_path(path)
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        os.rename(staging, path)
        shutil.rmtree(aside)
    _fsync_dir(path.parent)


def meta_object(meta_file: Path, where: str) -> dict:
    """``amsp.json`` read as a JSON object, or a one-line CheckpointError starting with ``where``."""
    try:
        meta = json.loads(meta_file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: file {META_FILE} is damaged "
                              f"(not valid JSON: {str(e).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: file {META_FILE} is damaged (not a JSON object)")
    return meta


def read_meta(path: Path, *, format: str) -> dict:
    """The ``amsp.json`` of a complete checkpoint, its own checksum verified (no collective)."""
    path = resolve(Path(path))
    if not path.exists():
        raise CheckpointError(f"amsp checkpoint: {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"amsp checkpoint: {path} is not a directory")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"amsp checkpoint: {path} is not a complete amsp checkpoint "
                              f"(no {META_FILE}: another format, or the save did not finish)")
    meta = meta_object(meta_file, f"amsp checkpoint {path}")
    if meta.get("format") in PICKLED_FORMATS and format == FORMAT:
        raise CheckpointError(
            f"amsp checkpoint: {path} has the old format {meta['format']!r}, whose .metadata and state are "
            f"pickles (loading them could run code): refused. To convert a checkpoint you trust: "
            f"amsp checkpoint convert --trust {path} NEW_FOLDER")
    if meta.get("format") != format:
        raise CheckpointError(f"amsp checkpoint: {path} has format {meta.get('format')!r}, expected {format!r}")
    if meta.get("checksum") != _self_checksum(meta) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"amsp checkpoint {path}: file {META_FILE} is damaged (checksum mismatch)")
    _check_signature(path, meta)
    _check_listing(path, meta)
    return meta


def _check_signature(path: Path, meta: dict) -> None:
    key = checkpoint_key()
    if key is None:
        return
    sig = meta.get("signature")
    if not isinstance(sig, dict) or "hmac-sha256" not in sig:
        raise CheckpointError(f"amsp checkpoint {path}: not signed, and this run has a checkpoint key "
                              f"(--checkpoint-key / {KEY_ENV}); refused")
    if not hmac.compare_digest(str(sig["hmac-sha256"]), _signature(meta, key)):
        raise CheckpointError(f"amsp checkpoint {path}: signed with another key than this run's "
                              f"(--checkpoint-key / {KEY_ENV}); refused")


def _check_listing(path: Path, meta: dict) -> None:
    """Every tensor file in the folder is one the table records: DCP's reader takes every
    ``*.safetensors`` file it finds, so an added one would add chunks nobody checked."""
    for f in sorted(path.glob("*.safetensors")):
        if f.name not in meta["files"]:
            raise CheckpointError(f"amsp checkpoint {path}: file {f.name} is not one this checkpoint "
                                  f"wrote (not in {META_FILE}); refused")


def damage(path: Path, name: str, expected: dict) -> str | None:
    """What is wrong with file ``name`` of the checkpoint (None if it matches its record)."""
    f = Path(path) / name
    if not f.is_file():
        return "is missing"
    size = f.stat().st_size
    if size != expected.get("bytes"):
        return f"has {size} bytes, {expected.get('bytes')} were written (truncated or overwritten)"
    if file_digest(f)["sha256"] != expected.get("sha256"):
        return "is damaged (sha256 mismatch)"
    return None


def verify_files(path: Path, meta: dict, names=None) -> None:
    """Check ``names`` (default: every file ``amsp.json`` records) against their checksums."""
    files = meta["files"]
    for name in (sorted(files) if names is None else names):
        what = damage(path, name, files[name])
        if what is not None:
            raise CheckpointError(f"amsp checkpoint {path}: file {name} {what}; the checkpoint "
                                  f"cannot be used (load an older one)")
