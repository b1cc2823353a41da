"""The one warning a patch gives when it meets a library version it was not checked against."""

from __future__ import annotations

import warnings

__all__ = ["warn_unchecked"]


def warn_unchecked(name: str, package: str, version: str, checked: tuple[str, ...], doing: str) -> None:
    """``doing``: what the patch does anyway, and why that is safe."""
    if version not in checked:
        warnings.warn(f"{name}: {package} {version} is not among the checked versions {checked}; {doing}",
                      stacklevel=3)
