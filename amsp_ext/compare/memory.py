"""Per-rank memory on CPU: peak RSS (from the kernel) and live tensor bytes (from the heap).

[Note: what "peak memory per rank" means here]
There is no caching allocator on CPU to ask, so we report two figures and say which is which:
- **peak RSS delta**: ``VmHWM`` (the kernel's high-water mark of resident memory) at the end of
  the run minus ``VmRSS`` just before the model is built. ``VmHWM`` is reset at that point by
  writing 5 to ``/proc/self/clear_refs``. It covers everything the system allocates - model
  states, activations, communication buffers - but also allocator slack and glibc arenas, so
  it is an upper bound on what a GPU allocator would report.
- **live tensor bytes**: after the last step, every live ``torch.Tensor`` reachable by the
  garbage collector, deduplicated by storage, minus the same count before the model is built.
  That is the model states and persistent buffers a rank holds between steps (not the
  activation peak); tensors held only by C++ (e.g. inside a gloo work object) are missed.
"""

from __future__ import annotations

import gc
from pathlib import Path

__all__ = ["live_tensor_bytes", "peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def live_tensor_bytes() -> int:
    import warnings

    import torch

    gc.collect()
    seen: set[tuple[int, int]] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() on lazy modules' proxies can warn
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except Exception:  # tensor subclasses without storage (DTensor wrappers, fakes)
            continue
        if key[0] == 0 or key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total
