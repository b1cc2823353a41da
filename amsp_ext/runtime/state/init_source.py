"""Where a model's initial weights come from when ``shard()`` is given ``config.init_from``:
a Hugging Face safetensors folder or an amsp checkpoint, opened and checked against the model
(names, shapes, dtypes) in this process, before any collective.

Both answer ``rows(name, start, stop)``: rows ``start:stop`` on dim 0 of one tensor, in fp32 on
the CPU. A safetensors folder reads only those rows' bytes; an amsp checkpoint (DCP) reads the
one whole tensor and cuts it, so a rank never holds more than one full tensor beyond its share.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from amsp_ext.runtime.state.safetensors_folder import CheckpointFolderError, SafetensorsFolder

__all__ = ["InitSource", "expected_tensors", "open_init_source"]


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """What a checkpoint of ``model`` holds: each parameter under its first name (tied aliases
    accepted in its place) and each persistent buffer; name -> (shape, alias names)."""
    aliases: dict[int, list[str]] = {}
    first: dict[int, tuple[str, torch.Tensor]] = {}
    # state_dict: the parameters (tied ones under every name) and the persistent buffers
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[id(t)].append(name)
        else:
            first[id(t)], aliases[id(t)] = (name, t), []
    return {name: (tuple(t.shape), tuple(aliases[i])) for i, (name, t) in first.items()}


class InitSource:
    """Initial values read from files; ``keys`` maps each expected name to its name in the files."""

    def __init__(self, path: Path, keys: dict[str, str], reader) -> None:
        self.path, self.keys, self._reader = path, keys, reader

    def __contains__(self, name: str) -> bool:
        return name in self.keys

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return self._reader(self.keys[name], start, stop).to(torch.float32)


def open_init_source(path, model: nn.Module) -> InitSource:
    """Open ``path`` and check it against ``model``; a one-line CheckpointFolderError otherwise."""
    path = Path(path)
    from amsp_ext.runtime.state.checkpoint_files import resolve

    if path.is_dir() and (resolve(path) / "amsp.json").is_file():
        return _amsp_checkpoint(resolve(path), model)
    folder = SafetensorsFolder(path)
    return InitSource(path, folder.check_against(expected_tensors(model)), folder.rows)


def _amsp_checkpoint(path: Path, model: nn.Module) -> InitSource:
    from amsp_ext.runtime.state import dcp_io
    from amsp_ext.runtime.state.checkpoint import MASTER, MODEL, CheckpointError, dcp_metadata, verify_checkpoint

    try:
        meta = verify_checkpoint(path)
        md = dcp_metadata(path)
    except CheckpointError as e:
        raise CheckpointFolderError(f"init_from {e}") from None
    shapes: dict[str, tuple[int, ...]] = {}
    src: dict[str, str] = {}
    for r in meta["model"]:
        name = r["param"] or r["key"]
        key = MASTER + name if r["param"] and MASTER + name in md else MODEL + name
        src[r["key"]] = key
        shapes[r["key"]] = tuple(md[key].size)
        dtype = md[key].properties.dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise CheckpointFolderError(f"init_from {path}: tensor {r['key']!r} has dtype "
                                        f"{str(dtype).removeprefix('torch.')}; allowed: float16, "
                                        f"bfloat16, float32")
    expected = expected_tensors(model)
    problems = []
    keys = {}
    for name, (shape, alias) in expected.items():
        k = next((a for a in (name, *alias) if a in src), None)
        if k is None:
            problems.append(f"tensor {name!r} is missing")
        elif shapes[k] != tuple(shape):
            problems.append(f"tensor {k!r} has shape {list(shapes[k])}, the model's is {list(shape)}")
        else:
            keys[name] = k
    known = {a for name, (_, alias) in expected.items() for a in (name, *alias)}
    problems += [f"tensor {k!r} is not in the model" for k in src if k not in known]
    if problems:
        more = f" (and {len(problems) - 1} other difference(s))" if len(problems) > 1 else ""
        raise CheckpointFolderError(f"init_from {path}: {problems[0]}{more}")

    def read(key: str, start: int | None, stop: int | None) -> torch.Tensor:
        props = md[src[key]]
        full = {src[key]: torch.empty(tuple(props.size), dtype=props.properties.dtype)}
        dcp_io.read(full, path)  # DCP reads the requested key only
        t = full[src[key]]
        return t if start is None or t.dim() == 0 else t[start:stop]

    return InitSource(path, keys, read)
