"""Small objects as data: JSON with tagged tensors, dtypes, tuples and non-string keys.

What the engine writes beside a checkpoint's tensors (RNG states, step counters, LR scheduler,
loss scaler, param-group hyper-parameters, the caller's ``extra``) and what ranks exchange as
objects (collectives.all_gather_objects / gather_objects) goes through ``dumps``/``loads``.

[Note: data, not code]
A pickle is a program: whoever can write a checkpoint folder or speak on a rank's socket could
make ``pickle.load`` (or an unrestricted ``torch.load``) run anything. JSON can only ever
decode into dicts, lists, strings, numbers, booleans and None; the tags below turn a few of those
back into tensors (raw little-endian bytes in base64, dtype and shape named), ``torch.dtype``,
tuples and dicts with non-string keys, nothing else. An object of any other type is refused when
it is *encoded*, naming where it sits, so a bad ``extra`` fails at the save that wrote it.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

__all__ = ["WireError", "dumps", "from_data", "loads", "to_data"]

_T, _D, _TUP, _MAP, _F = "__tensor__", "__dtype__", "__tuple__", "__map__", "__float__"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class WireError(ValueError):
    """An object that cannot travel as data (encode), or bytes that are not such data (decode)."""


def to_data(obj: Any, where: str = "value") -> Any:
    """``obj`` as plain JSON values (tagged where JSON has no type for it)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_F: repr(obj)}  # JSON has no inf/nan
    if isinstance(obj, torch.dtype):
        return {_D: str(obj).removeprefix("torch.")}
    if torch.is_tensor(obj):
        t = obj.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise WireError(f"{where}: a tensor of dtype {name} cannot be stored")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_T: {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}}
    if isinstance(obj, tuple):
        return {_TUP: [to_data(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_data(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (set(obj) & {_T, _D, _TUP, _MAP, _F}):
            return {k: to_data(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_MAP: [[to_data(k, f"{where} key"), to_data(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    try:  # numpy scalars and arrays (numpy's RNG state)
        import numpy as np

        if isinstance(obj, np.generic):
            return to_data(obj.item(), where)
        if isinstance(obj, np.ndarray):  # as a list (numpy's RNG state is uint32)
            return to_data(obj.tolist(), where)
    except ImportError:  # pragma: no cover
        pass
    raise WireError(f"{where}: a {type(obj).__name__} cannot be stored as data (only None, bool, int, "
                    f"float, str, list, tuple, dict, torch.dtype and tensors)")


def _key(k: Any) -> Any:
    return tuple(_key(v) for v in k) if isinstance(k, list) else k


def from_data(obj: Any) -> Any:
    """The inverse of ``to_data`` (numpy arrays come back as lists)."""
    if isinstance(obj, list):
        return [from_data(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, v), = obj.items()
        if tag == _F:
            return float(v)
        if tag == _D:
            if v not in _DTYPES:
                raise WireError(f"unknown dtype {v!r}")
            return _DTYPES[v]
        if tag == _TUP:
            return tuple(from_data(x) for x in v)
        if tag == _MAP:
            return {_key(from_data(k)): from_data(x) for k, x in v}
        if tag == _T:
            dtype = _DTYPES.get(v.get("dtype"))
            if dtype is None:
                raise WireError(f"unknown tensor dtype {v.get('dtype')!r}")
            raw = bytearray(base64.b64decode(v["data"], validate=True))
            shape = [int(s) for s in v["shape"]]
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    return {k: from_data(v) for k, v in obj.items()}


def dumps(obj: Any, where: str = "value") -> bytes:
    return json.dumps(to_data(obj, where), separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes | str) -> Any:
    try:
        return from_data(json.loads(data))
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise WireError(f"not amsp data ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
