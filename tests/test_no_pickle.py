"""Data, not code: nothing in amsp_ext unpickles what it reads from disk or from a peer.

A static scan of the package source (the reference is the rule itself, not the code's output):
no ``pickle.load``/``loads``, no ``weights_only=False``, every ``torch.load(`` passes
``weights_only=True``, and no torch.distributed ``*_object`` collective (they pickle). Plus the
wire codec's round trip against hand-built values and its refusal of other types."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

PKG = Path(__file__).resolve().parents[1] / "amsp_ext"


def _sources():
    return sorted(PKG.rglob("*.py"))


def _code(text: str) -> str:
    # drop comments and string-only lines (docstrings mention what is forbidden)
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def test_no_unpickling_anywhere_in_amsp_ext():
    bad = []
    for f in _sources():
        code = _code(f.read_text())
        for pat in (r"\bpickle\.loads?\(", r"\bcloudpickle\b", r"\bdill\b", r"weights_only\s*=\s*False",
                    r"\bUnpickler\b", r"\bdist\.(all_)?gather_object\(", r"\bbroadcast_object_list\(",
                    r"\bscatter_object_list\(", r"\brecv_object_list\("):
            for m in re.finditer(pat, code):
                bad.append(f"{f.relative_to(PKG.parent)}:{code[:m.start()].count(chr(10)) + 1}: {m.group(0)}")
        for m in re.finditer(r"\btorch\.load\(", code):
            call = code[m.start(): m.start() + 300].split(")\n", 1)[0]
            if "weights_only=True" not in call:
                bad.append(f"{f.relative_to(PKG.parent)}:{code[:m.start()].count(chr(10)) + 1}: torch.load "
                           f"without weights_only=True")
    # the one exception: `amsp checkpoint convert --trust` reads an old, trusted checkpoint
    # (runtime/state/convert.py: [Note: converting a trusted checkpoint]); its refusal without
    # --trust, before anything is read, is tested in test_checkpoint_convert.py
    trusted = [b for b in bad if b.startswith(TRUSTED)]
    assert len(trusted) <= 2, trusted  # weights_only=False and that torch.load, on one line
    bad = [b for b in bad if b not in trusted]
    assert not bad, bad


TRUSTED = "amsp_ext/runtime/state/convert.py:"


def test_the_trusted_unpickling_is_only_behind_trust():
    import inspect

    from amsp_ext.runtime.state import convert

    src = inspect.getsource(convert)
    assert src.count("weights_only=False") == 1 and src.count("_unpack_trusted(") == 2  # def + one call
    body = inspect.getsource(convert.convert_checkpoint)
    assert body.index("if not trust:") < body.index("read_metadata") < body.index("_unpack_trusted(")


@pytest.mark.distributed
def test_two_rank_save_and_resharding_load_unpickle_nothing(tmp_path):
    """2 ranks (under the CPU lock: the suite's multi-rank tests are run so): save under sp=2 and
    load under sp=1 while every pickle entry point (pickle.load/loads/dumps/Pickler/Unpickler,
    torch.distributed's own pickler/unpickler, torch.load) raises; the loaded weights equal the
    saved ones and the next loss equals the saving run's. Negative control in the same launch:
    DCP's own load with a process group trips the trap (so the trap can fail the test)."""
    import json

    from dist_utils import run_ranks

    p = run_ranks(2, "tests.no_pickle_worker", str(tmp_path), timeout=300)
    r = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert r["pickle_calls_during_save_and_load"] == [], r
    assert r["weights_max_abs_diff"] == 0.0 and r["extra"] == {"step": 1}
    assert r["loaded_next_loss"] == r["ref_next_loss"], r
    assert r["control_error"] and r["control_error"].startswith("Trapped"), r
    assert r["control_calls"], r


def test_the_scan_finds_what_it_forbids(tmp_path, monkeypatch):
    """The scan can fail: a planted offender is reported."""
    (tmp_path / "amsp_ext").mkdir()
    (tmp_path / "amsp_ext" / "bad.py").write_text("import torch\nx = torch.load(f, weights_only=False)\n")
    monkeypatch.setattr(__import__(__name__), "PKG", tmp_path / "amsp_ext")
    with pytest.raises(AssertionError, match="bad.py:2"):
        test_no_unpickling_anywhere_in_amsp_ext()


def test_wire_round_trip_and_refusal():
    from amsp_ext.runtime import wire

    obj = {"step": 3, "lr": 1e-3, "betas": (0.9, 0.95), "inf": float("inf"), "none": None,
           "dtype": torch.bfloat16, 7: ["a", True], "t": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
           "s": torch.tensor(4.0), "empty": torch.empty(0, 2, dtype=torch.int64)}
    back = wire.loads(wire.dumps(obj))
    assert back["betas"] == (0.9, 0.95) and back[7] == ["a", True] and back["dtype"] is torch.bfloat16
    assert back["inf"] == float("inf") and back["none"] is None and back["step"] == 3
    assert back["t"].dtype == torch.bfloat16 and back["t"].tolist() == [[1.5, -2.0]]
    assert back["s"].shape == () and float(back["s"]) == 4.0 and back["empty"].shape == (0, 2)
    with pytest.raises(wire.WireError, match=r"extra\['f'\]: a function cannot be stored"):
        wire.dumps({"f": lambda: 0}, "extra")
    with pytest.raises(wire.WireError, match="not amsp data"):
        wire.loads(b"\x80\x04\x95")  # the start of a pickle
