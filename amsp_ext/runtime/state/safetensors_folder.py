"""A Hugging Face safetensors folder, read without trusting it: ``SafetensorsFolder(path)``.

One ``model.safetensors``, or the files a ``model.safetensors.index.json`` names. Opening checks
every file's header against the file's size; ``check_against`` compares names, shapes and
dtypes with the model before any collective; ``rows`` reads the byte range of some rows of one
tensor and nothing else (plain reads at the header's offsets, into a tensor of their size).

[Note: an untrusted folder]
Checkpoints are downloaded and passed around, so a folder is data and is read as data:
- nothing in it is executed or unpickled: ``.bin`` / ``.pt`` / ``.pth`` weights (pickles) are
  refused with the conversion to use, never loaded;
- every file the index names must resolve, symlinks followed, to a regular file inside the
  folder: ``../x``, an absolute path, or a link leaving the folder would otherwise let a shared
  checkpoint read any file this user can;
- every header is parsed by us before safetensors maps the file: its length and every tensor's
  ``data_offsets`` must lie inside the file and match the tensor's shape and dtype, so a
  truncated file or a header pointing past its end is one line naming the file, not a crash or
  a read of whatever follows;
- only float16, bfloat16 and float32 tensors are accepted: the engine's parameters are floating
  point and an integer tensor in their place is a mistake, not something to cast.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CheckpointFolderError", "SafetensorsFolder", "TensorEntry",
           "INDEX_NAME", "WEIGHTS_NAME"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_OTHER_DTYPES = {"F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2,
                 "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class CheckpointFolderError(ValueError):
    """A folder that cannot be loaded: one line naming the file or tensor."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


def _inside(folder: Path, name: str, what: str) -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
        raise CheckpointFolderError(f"{what} names file {name!r}, which is not a plain name inside "
                                    f"{folder}; refused")
    path = folder / name
    real = path.resolve()
    if not real.is_relative_to(folder.resolve()):
        raise CheckpointFolderError(f"{what} names file {name!r}, which leaves {folder} (a link to "
                                    f"{real}); refused")
    if not name.endswith(".safetensors"):
        raise CheckpointFolderError(f"{what} names file {name!r}; only .safetensors files are read")
    if not real.is_file():
        raise CheckpointFolderError(f"{what} names file {name!r}, which does not exist in {folder}")
    return path


def _read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFolderError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointFolderError(f"{path}: header of {n} bytes runs past the end of the file "
                                        f"({size} bytes): truncated or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFolderError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFolderError(f"{path}: header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_s, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointFolderError(f"{path}: tensor {name!r} has a malformed header entry")
        if dtype_s not in _DTYPES:
            raise CheckpointFolderError(
                f"{path}: tensor {name!r} has dtype {dtype_s}; allowed: float16, bfloat16, float32")
        nbytes = math.prod(shape) * _DTYPES[dtype_s].itemsize
        if not begin <= end <= data or end - begin != nbytes:
            raise CheckpointFolderError(
                f"{path}: tensor {name!r} claims bytes {begin}..{end} of a {data}-byte data section "
                f"(needs {nbytes}): the file is truncated or its header is wrong")
        out[name] = TensorEntry(file=path, dtype=_DTYPES[dtype_s], shape=shape, offset=8 + n + begin)
    return out


class SafetensorsFolder:
    """Names, shapes and dtypes of every tensor of a folder (headers only), and slice reads."""

    def __init__(self, path) -> None:
        path = Path(path)
        self.path = path
        if path.is_file():
            if path.suffix != ".safetensors":
                raise CheckpointFolderError(f"init_from {path}: only .safetensors files are read")
            files = [path]
        elif not path.is_dir():
            raise CheckpointFolderError(f"init_from {path}: no such file or folder")
        elif (path / INDEX_NAME).is_file():
            files = self._indexed(path)
        elif (path / WEIGHTS_NAME).is_file():
            files = [_inside(path, WEIGHTS_NAME, f"folder {path}")]
        else:
            pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLES)
            if pickles:
                raise CheckpointFolderError(
                    f"init_from {path}: {pickles[0]} is a pickle, which amsp never loads (it can run "
                    f"code); convert it once where you trust it: "
                    f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, "
                    f"safe_serialization=True)")
            raise CheckpointFolderError(f"init_from {path}: neither {WEIGHTS_NAME} nor {INDEX_NAME} "
                                        f"is there")
        self.tensors: dict[str, TensorEntry] = {}
        for f in files:
            for name, entry in _read_header(f).items():
                if name in self.tensors:
                    raise CheckpointFolderError(f"init_from {path}: tensor {name!r} is in both "
                                                f"{self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = entry

    @staticmethod
    def _indexed(path: Path) -> list[Path]:
        what = f"{path / INDEX_NAME}"
        try:
            index = json.loads((path / INDEX_NAME).read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointFolderError(f"{what}: not an index with a weight_map ({e!r})") from None
        return [_inside(path, name, what) for name in sorted(set(weight_map.values()))]

    def check_against(self, expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]]) -> dict[str, str]:
        """``expected``: name -> (shape, alias names). Returns name -> the key to read it from;
        raises one line naming the first tensor that is missing, extra or mis-shaped."""
        problems: list[str] = []
        source: dict[str, str] = {}
        used: set[str] = set()
        for name, (shape, aliases) in expected.items():
            key = next((k for k in (name, *aliases) if k in self.tensors), None)
            if key is None:
                problems.append(f"tensor {name!r} is missing")
                continue
            used.update(k for k in (name, *aliases) if k in self.tensors)
            got = self.tensors[key].shape
            if tuple(got) != tuple(shape):
                problems.append(f"tensor {key!r} has shape {list(got)}, the model's is {list(shape)}")
                continue
            source[name] = key
        problems += [f"tensor {k!r} is not in the model" for k in self.tensors if k not in used]
        if problems:
            more = f" (and {len(problems) - 1} other difference(s))" if len(problems) > 1 else ""
            raise CheckpointFolderError(f"init_from {self.path}: {problems[0]}{more}")
        return source

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` on dim 0 of tensor ``key`` (all of it with no bounds), as stored,
        on the CPU. Only their bytes are read, into a tensor of their size: a rank keeping
        1/64 of a 1 GiB embedding reads 16 MiB (a safetensors slice may map or copy the
        whole tensor first: a dispatch mode saw safetensors 0.8 build it before slicing)."""
        entry = self.tensors[key]
        shape = entry.shape
        if not shape or start is None:
            start, stop = 0, shape[0] if shape else None
        row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize if shape else entry.dtype.itemsize
        out = torch.empty((stop - start, *shape[1:]) if shape else (), dtype=entry.dtype)
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb") as f:
            f.seek(entry.offset + start * row_bytes)
            got = f.readinto(buf)
        if got != len(buf):
            raise CheckpointFolderError(f"{entry.file}: tensor {key!r} ends early (read {got} of "
                                        f"{len(buf)} bytes): the file changed while loading")
        return out

