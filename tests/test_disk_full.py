"""A full disk during a save (issue 21): `amsp train` stops with ONE line that names the folder,
what the save needs and what is free, and the checkpoint written before it stays intact.

The disk is a tmpfs sized from a first, unconstrained run: room for one checkpoint and a half,
so the first save of the constrained run fits and the second does not. Needs root (mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import REPO

pytestmark = pytest.mark.distributed

ARGS = ["--steps", "2", "--seq-len", "32", "--micro-batch-size", "1", "--micro-batches", "1",
        "--nproc-per-node", "2", "--save-every", "1", "--keep", "5"]


def _train(save_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "amsp_ext.cli", "train", *ARGS, "--save-dir", str(save_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a tmpfs")
    free = tmp_path / "free"
    first = _train(free)
    assert first.returncode == 0, first.stderr[-3000:]
    one = _size(free / "step-00000001")
    size_kib = int(one * 1.5 / 1024) + 16
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)])


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(small_disk):
    proc = _train(small_disk / "ckpt")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "no space left on" in lines[0] and "free" in lines[0] and "nothing was published" in lines[0], lines
    kept = small_disk / "ckpt" / "step-00000001"
    assert (kept / "amsp.json").is_file()
    from amsp_ext.runtime.state.checkpoint import verify_checkpoint

    verify_checkpoint(kept)  # every file against its checksum
    assert not list((small_disk / "ckpt").glob(".*staging*")), "the failed save's staging folder is left"
