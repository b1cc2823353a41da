"""Private torch accesses live in amsp_ext/runtime/_torch_compat.py only.

Two scans of every other module of amsp_ext: a text grep for private torch module paths
(``torch.<...>._x``, ``from torch.<...>._x import``), and an AST walk for private attributes
(``obj._x``) that amsp_ext does not define itself, i.e. someone else's private name; the few
that belong to other libraries are listed with their owner.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "amsp_ext"
COMPAT = PKG / "runtime" / "_torch_compat.py"
# private names of other libraries (not torch), each with its owner
NOT_TORCH = {
    "_exit": "os._exit",
    "_actions": "argparse.ArgumentParser._actions",
    "_attn_implementation": "transformers PretrainedConfig",
    "_shared_state": "accelerate PartialState / AcceleratorState (integrations/patches)",
}
TORCH_PATH = re.compile(r"\btorch(\.[A-Za-z_]\w*)*\._[A-Za-z]\w*")


def modules():
    return [f for f in sorted(PKG.rglob("*.py")) if f != COMPAT]


def own_names() -> set[str]:
    """Names amsp_ext defines: functions, classes, assigned names, attributes of self/cls."""
    names = set()
    for f in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.keyword) and n.arg:  # e.g. parser.set_defaults(_run=...)
                names.add(n.arg)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                names.add(n.attr)
    return names


def private_uses(source: str, own: set[str]) -> list[str]:
    out = [m.group(0) for m in TORCH_PATH.finditer(source)]
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if n.attr not in own and n.attr not in NOT_TORCH:
                out.append(f"line {n.lineno}: .{n.attr}")
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("torch"):
            if any(p.startswith("_") for p in n.module.split(".")):
                out.append(f"line {n.lineno}: from {n.module}")
    return out


def test_no_private_torch_outside_compat():
    own = own_names()
    found = {str(f.relative_to(PKG)): u for f in modules() if (u := private_uses(f.read_text(), own))}
    assert not found, f"private torch access outside runtime/_torch_compat.py: {found}"


def test_the_scan_catches_what_it_is_for():
    own = own_names()
    for src in ("x = model._get_fsdp_state()._comm_ctx\n",
                "from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather\n",
                "o = dist.ProcessGroupGloo._Options()\n",
                "t = p._local_tensor\n",
                "torch.autograd.Variable._execution_engine.queue_callback(f)\n"):
        assert private_uses(src, own), src
    assert not private_uses("self._x = 1\nopt._aliased\nos._exit(0)\n", own | {"_x"})
    assert "_get_fsdp_state" in COMPAT.read_text()  # the compat file is where it went


def test_unknown_torch_version_is_one_clear_line(monkeypatch):
    from amsp_ext.runtime import _torch_compat as compat

    compat.check_torch_version()  # the installed one was checked
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(compat.UncheckedTorchError) as e:
        compat.check_torch_version("2.99.0+cpu")
    msg = str(e.value)
    assert "\n" not in msg and "2.99.0" in msg and "2.13" in msg and compat.ALLOW_ENV in msg
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="2.99.0"):
        compat.check_torch_version("2.99.0")
