"""A checkpoint's tensors through torch.distributed.checkpoint (DCP), each rank on its own.

``write`` (and ``write_async``) saves the chunks this rank was assigned into its own safetensors
file, ``read`` fills a state dict from the folder's safetensors files, ``metadata`` rebuilds DCP's
table of chunks from the files' safetensors headers. None of them issues a collective: who
writes which chunk is decided beforehand by :func:`assign_writers` from a table every rank sees
(exchanged as JSON by the caller, collectives.all_gather_objects).

[Note: DCP without its object collectives]
Called with a process group, ``dcp.save`` and ``dcp.load`` coordinate through DCP's
``_DistWrapper``: the save gathers every rank's ``SavePlan`` on rank 0 (``dist.gather_object``),
scatters the global plans back (``scatter_object_list``), gathers the ``WriteResult`` lists and
broadcasts the ``Metadata`` (``broadcast_object_list``); the load gathers and scatters
``LoadPlan`` objects the same way and ends with an ``all_gather_object`` of each rank's outcome.
Each of those pickles an object on one rank and unpickles it on another: a peer that can speak
on the group's sockets could send a pickle that runs code. So we never hand DCP a process group
(``no_dist=True``):

- load: every rank's reads depend only on its own targets and the chunk table, and the table is
  rebuilt by each rank from the safetensors headers (JSON parsed by the safetensors library)
  (``HuggingFaceStorageReader.read_metadata``; no ``.metadata`` pickle exists or is read). DCP's
  global load plan adds nothing a single rank needs, so each rank plans and reads alone. What
  went wrong on one rank is shared by the caller with one all-gather of a short string.
- save: DCP's global plan is where replicated chunks are deduplicated (one writer per chunk) and
  each rank gets its file name. We do both ourselves: every rank's chunk list (key, offset,
  shape, bytes) is all-gathered as JSON, every rank runs the same greedy assignment
  (:func:`assign_writers`) and drops the chunks another rank writes, and each rank writes
  ``shard-<rank + 1>-model-00001-of-00001.safetensors`` (the name DCP's distributed save would
  give it, so the loader and the file table are those of a distributed save). Each chunk's
  global offset travels in its file's safetensors header, which is how the reader finds it.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from torch.profiler import record_function

from amsp_ext.runtime import _torch_compat as compat

__all__ = ["assign_writers", "chunk_table", "metadata", "quiet_single_process", "read", "reader", "write",
           "write_async"]

# DCP says so whenever it runs without a process group; here that is the design
_SINGLE = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load)"


def quiet_single_process() -> None:
    warnings.filterwarnings("ignore", message=_SINGLE)  # process-wide: the async save warns in a thread


def _writer(path, rank: int):
    import torch.distributed.checkpoint as dcp

    class RankWriter(dcp.HuggingFaceStorageWriter):
        """The distributed save's file name for ``rank``, written by this process alone."""

        def prepare_global_plan(self, plans):
            return [dataclasses.replace(p, storage_data={"shard_index": rank + 1}) for p in plans]

    return RankWriter(str(path), save_distributed=True)


def reader(path):
    import torch.distributed.checkpoint as dcp

    return dcp.HuggingFaceStorageReader(str(path))


def metadata(path) -> dict:
    """DCP's key -> storage metadata (global size, dtype, chunks), from the safetensors headers."""
    return reader(path).read_metadata().state_dict_metadata


def chunk_table(state_dict: dict[str, Any]) -> list[list]:
    """This rank's chunks as JSON data: [key, global offset, local shape, bytes] per tensor."""
    from torch.distributed.tensor import DTensor

    rows = []
    for k, v in sorted(state_dict.items()):
        local = v.to_local() if isinstance(v, DTensor) else v
        rows.append([k, compat.local_chunk_offset(v), list(local.shape), local.numel() * local.element_size()])
    return rows


def assign_writers(tables: list[list[list]]) -> list[set[str]]:
    """Given every rank's ``chunk_table`` (rank order), the keys each rank writes: every distinct
    chunk (key, offset, shape) exactly once, by the holder with the fewest bytes so far (largest
    chunks first; ties to the lower rank). Deterministic, so every rank computes the same answer."""
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for rank, rows in enumerate(tables):
        for key, offset, shape, nbytes in rows:
            c = (key, tuple(offset), tuple(shape))
            holders.setdefault(c, []).append(rank)
            size[c] = int(nbytes)
    load = [0] * len(tables)
    out: list[set[str]] = [set() for _ in tables]
    for c in sorted(holders, key=lambda c: (-size[c], c)):
        r = min(holders[c], key=lambda r: (load[r], r))
        load[r] += size[c]
        out[r].add(c[0])
    return out


def write(state_dict: dict[str, Any], path, *, rank: int) -> None:
    """Write ``state_dict`` (this rank's assigned chunks) into ``path`` (no collective)."""
    import torch.distributed.checkpoint as dcp

    quiet_single_process()
    with record_function("amsp::checkpoint_write"):
        dcp.save(state_dict, storage_writer=_writer(path, rank), no_dist=True)


def write_async(state_dict: dict[str, Any], path, *, rank: int, group):
    """DCP's ``async_save`` of this rank's chunks: returns once they are staged in CPU memory,
    with a future that completes when this rank's file is written (no collective; ``group``, a
    gloo group, only satisfies async_save's check that a CPU backend exists)."""
    import torch.distributed.checkpoint as dcp

    quiet_single_process()
    with record_function("amsp::checkpoint_write_async"):
        return dcp.async_save(state_dict, storage_writer=_writer(path, rank), process_group=group, no_dist=True)


def read(state_dict: dict[str, Any], path) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (no collective)."""
    import torch.distributed.checkpoint as dcp

    quiet_single_process()
    with record_function("amsp::checkpoint_read"):
        dcp.load(state_dict, storage_reader=reader(Path(path)), no_dist=True)
