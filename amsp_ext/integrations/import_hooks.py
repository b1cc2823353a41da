"""Run a callback right after a module is imported (a post-import hook), without importing it.

The start-up hook uses it to patch ``deepspeed`` and ``accelerate`` the moment the user's script
imports them, so a script that never imports amsp_ext still gets AMSP, and processes that never
import them (the launcher, tools) pay nothing.

[Note: how]
A ``sys.meta_path`` finder answers only for the watched names: it asks the other finders for the
real spec and wraps its loader, whose ``exec_module`` runs the module and then the callbacks.
Everything else about the loader is delegated, so ``importlib.resources`` and friends still see
the real one. A module already imported gets its callbacks at once.

[Note: no importlib.abc]
This module is imported by the start-up hook in every interpreter of the environment, so it
must cost next to nothing: ``importlib.abc`` pulls in ``importlib.resources`` (tens of ms).
The import system only needs the protocol (``find_spec``; ``create_module``/``exec_module``),
so the two classes are plain classes.
"""

from __future__ import annotations

import sys

__all__ = ["when_imported"]

_callbacks: dict[str, list] = {}  # module name -> callbacks(module)


class _Loader:
    def __init__(self, inner, name: str) -> None:
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        for cb in _callbacks.pop(self._name, []):
            cb(module)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _Finder:
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_FINDER = _Finder()


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` has been imported (now, if it already is)."""
    if name in sys.modules and getattr(sys.modules[name], "__spec__", None) is not None:
        module = sys.modules[name]
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            callback(module)
            return
    _callbacks.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
