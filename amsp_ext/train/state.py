"""Where ``amsp train`` keeps its checkpoints, and which one ``--resume`` means. No process group: the
launcher resolves and verifies the checkpoint before any rank starts, the ranks resolve it again
(after an elastic restart, the newest may be one they wrote themselves).

    <save-dir>/step-00000004/   one checkpoint (amsp_ext.save_checkpoint), published whole
    <save-dir>/step-00000008/   amsp.json "info": {"samples": ..., "step": ..., "global_batch": ...}

[Note: the data position is a number of samples]
A checkpoint records how many samples (sequences) the job has consumed, not how many optimizer
steps it took: a step skipped by the non-finite guard or the fp16 loss scaler still consumed its
batch, and a resume under another world size (with the same global batch) must start at the
very next sample. The loop reads global batch ``k`` from sample ``samples`` (data.micro_batch_at),
so the sequence of samples a model has seen is the same whatever the world size or restarts.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from amsp_ext.runtime.state.checkpoint_files import FORMAT, CheckpointError, read_meta, resolve, verify_files

__all__ = ["checkpoint_name", "clean_staging", "list_checkpoints", "newest_checkpoint", "newest_intact",
           "prune", "resolve_resume", "verify"]

_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def clean_staging(save_dir) -> list[Path]:
    """Remove what interrupted saves left in ``save_dir`` (``.step-*.amsp-staging``: never a
    published checkpoint, see checkpoint_files.py [Note: atomic publish]); the launcher calls it
    before any rank starts. Returns what it removed."""
    save_dir = Path(save_dir) if save_dir else None
    if save_dir is None or not save_dir.is_dir():
        return []
    gone = sorted(save_dir.glob(".step-*.amsp-staging"))
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def list_checkpoints(save_dir: Path, skipped: list[str] | None = None) -> list[tuple[int, Path]]:
    """``(samples, path)`` of every published checkpoint in ``save_dir``, oldest first. A
    directory with a damaged ``amsp.json`` is an error (never skipped in silence); one without
    it is skipped, and named with the reason in ``skipped``."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    names = {p.name for p in save_dir.iterdir() if _NAME.match(p.name)}
    # a publish cut between its two renames (file systems without RENAME_EXCHANGE)
    names |= {p.name[1:-len(".amsp-previous")] for p in save_dir.glob(".step-*.amsp-previous")}
    out = []
    for name in sorted(names):
        path = resolve(save_dir / name)
        if not (path / "amsp.json").is_file():
            # not published (cannot happen with our saves; someone else's directory)
            if skipped is not None:
                skipped.append(f"{path.name} (no amsp.json: not a complete checkpoint)")
            continue
        info = read_meta(path, format=FORMAT).get("info") or {}
        if not isinstance(info.get("samples"), int):
            raise CheckpointError(f"amsp train: {path} is an amsp checkpoint but not one of `amsp train` "
                                  f"(no samples count in its amsp.json)")
        out.append((info["samples"], save_dir / name))
    return sorted(out)


def newest_checkpoint(save_dir: Path) -> Path | None:
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str | None, save_dir: str | None) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` the newest in ``save_dir`` (None: none yet),
    else the path itself (which must be a complete checkpoint)."""
    if not resume:
        return None
    if resume == "auto":
        if not save_dir:
            return None
        skipped: list[str] = []
        found = list_checkpoints(Path(save_dir), skipped)
        if skipped:
            print(f"amsp train: --resume auto skipped {', '.join(skipped)}", file=sys.stderr, flush=True)
        return found[-1][1] if found else None
    path = Path(resume)
    read_meta(path, format=FORMAT)  # one line if it is not a complete checkpoint
    return path


def verify(path: Path) -> dict:
    """Every file of the checkpoint against its checksum (one line naming a damaged one)."""
    path = resolve(Path(path))
    meta = read_meta(path, format=FORMAT)
    verify_files(path, meta)
    return meta


def newest_intact(save_dir, below: Path) -> Path | None:
    """The newest checkpoint older than ``below`` whose every file matches its checksum."""
    for _, p in reversed(list_checkpoints(Path(save_dir))):
        if p.name >= Path(below).name:
            continue
        try:
            verify(p)
            return p
        except CheckpointError:
            continue
    return None


def prune(save_dir: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints (only ``step-*`` ones of this job)."""
    found = list_checkpoints(save_dir)
    gone = [p for _, p in found[:-keep]] if keep > 0 else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
