"""Faults speak once (issue 21 item 3): the staging folder an interrupted save left is removed at
the next start; `--resume auto` names what it skipped; a damaged newest checkpoint is refused
with the newest intact one offered. (Ctrl-C, one line and exit 130: test_train_supervise.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from dist_utils import REPO


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_resume_auto_names_what_it_skipped_and_staging_is_removed(tmp_path, capsys):
    from amsp_ext.train.state import clean_staging, resolve_resume

    (tmp_path / "step-00000004").mkdir()  # no amsp.json
    (tmp_path / ".step-00000008.amsp-staging").mkdir()
    (tmp_path / ".step-00000008.amsp-staging" / "x").write_text("partial")
    assert resolve_resume("auto", str(tmp_path)) is None
    err = capsys.readouterr().err
    assert "--resume auto skipped step-00000004 (no amsp.json: not a complete checkpoint)" in err, err
    assert clean_staging(tmp_path) == [tmp_path / ".step-00000008.amsp-staging"]
    assert not (tmp_path / ".step-00000008.amsp-staging").exists() and (tmp_path / "step-00000004").is_dir()


def test_checkpoint_key_flag_refuses_unsigned_and_wrongly_signed_before_launch(tmp_path):
    """`amsp train --checkpoint-key` (and AMSP_CHECKPOINT_KEY) refuse, in the launcher and in one
    line, a checkpoint without a signature or signed with another key; no rank starts."""
    from amsp_ext.runtime.state.checkpoint_files import FORMAT, write_meta

    def ckpt(name, key):
        d = tmp_path / name
        d.mkdir()
        (d / "amsp.state.json").write_text("{}")
        env_old = os.environ.pop("AMSP_CHECKPOINT_KEY", None)
        if key:
            os.environ["AMSP_CHECKPOINT_KEY"] = key
        try:
            write_meta(d, {"format": FORMAT, "info": {"samples": 0}}, {})
        finally:
            os.environ.pop("AMSP_CHECKPOINT_KEY", None)
            if env_old is not None:
                os.environ["AMSP_CHECKPOINT_KEY"] = env_old
        return d

    cases = {"unsigned": (ckpt("unsigned", None), "not signed, and this run has a checkpoint key"),
             "other-key": (ckpt("other", "key-B"), "signed with another key than this run's")}
    env = _env()
    env.pop("AMSP_CHECKPOINT_KEY", None)
    # the four launchers are independent (each refuses before any rank): started together, they
    # share the two cores instead of taking turns (~3 s of imports each)
    procs = {}
    for name, (path, text) in cases.items():
        for how in ("flag", "env"):
            args = ["--checkpoint-key", "key-A"] if how == "flag" else []
            e = {**env, "AMSP_CHECKPOINT_KEY": "key-A"} if how == "env" else env
            procs[name, how] = subprocess.Popen(
                [sys.executable, "-m", "amsp_ext.cli", "train", "--nproc-per-node", "2", "--steps", "1", *args,
                 "--resume", str(path)], cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for (name, how), p in procs.items():
            _, err = p.communicate(timeout=120)
            text = cases[name][1]
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert p.returncode != 0 and len(lines) == 1 and text in lines[0], (name, how, err[-2000:])
    finally:
        for p in procs.values():  # a failed or timed-out check leaves no launcher behind
            if p.poll() is None:
                p.kill()
                p.wait()
