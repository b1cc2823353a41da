"""The ``"amsp"`` block of a ``ds_config.json``, and the DeepSpeed keys AMSP honours.

One config file serves both systems: DeepSpeed ignores unknown *top-level* keys (its
``zero_optimization`` block forbids extra keys, so the block cannot live there), and AMSP reads
DeepSpeed's own batch, precision, clipping, optimizer and scheduler keys.

    "amsp": {
      "enabled": true,
      "plan": "auto",                       # "auto" | "zero3" | "mics:8" | "p=8x1,g=8x1,os=8x4"
                                            #   | {"p": [8, 1], "g": [8, 1], "os": [8, 4]}
      "seq_len": 4096,                      # the planner's sequence length (plan "auto" and
                                            #   adaptive need it)
      "gpu_memory": "80GiB",                # plan "auto"'s memory per GPU; default: the device's
      "profile": "cluster",                 # this cluster's (cached or measured), a bundled name or a JSON path
      "missing_mesh": "error",              # a mesh the profile lacks: "error" or "fit"
      "objective": "comm",                  # "comm" (paper Eq. 1) or "step"
      "frozen_models": 1,                   # frozen models of this shape beside it (a DPO/GRPO
                                            #   reference) that plan "auto" prices; absent: the
                                            #   forward-only engines this process already built
      "adaptive": {"band": [0.67, 1.5], "window": 20, "min_steps_between_switches": 50,
                   "hysteresis": 0.1, "allow_replan": true,
                   "horizon_steps": 1000},          # absent or null: off
      "log_plan": true,
      # the engine's own settings: any field of amsp_ext.engine_config.EngineConfig, by its name,
      # with its default and validation (one definition for every route), e.g.
      "gpus_per_node": 8, "nodes_per_leaf": null,
      "grad_bucket_bytes": "25MiB",         # absent: DeepSpeed's reduce_bucket_size, if given
      "granularity": "layer", "recompute": false, "ownership": "greedy", "timeout": 600,
      "overlap": {"allgather": true, "allreduce": true, "broadcast": true},
      "max_bad_steps": 3
    }

The engine's precision, reduce dtype and loss scaling come from DeepSpeed's own keys (``bf16``,
``fp16``, ``communication_data_type``), not from the block.

Every key is optional but ``enabled``. Errors are one line naming the field (``amsp.<key>``).

[Note: what `enabled` means]
``enabled`` is the routing switch, on every route (the start-up hook, or ``patch_deepspeed()``):
``false`` runs DeepSpeed unchanged with the same file; ``true`` sends ``deepspeed.initialize`` to
AMSP - and so does a block whose ``enabled`` is missing or misspelt, so that the validation
stops it with one line instead of DeepSpeed running silently (``amsp_enabled``).
``amsp_ext.initialize`` itself always runs AMSP.

This module is pure Python (no torch): ``amsp migrate`` uses it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from amsp_ext import schema
from amsp_ext.choices import (MISSING_MESH, OBJECTIVES, check_bool, check_int, check_one_of, is_int,
                              reduce_dtypes)
from amsp_ext.engine_config import AutoPlanConfig, EngineConfig, FP16Config
from amsp_ext.planner.adaptive import AdaptiveConfig, check_replannable
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.defaults import (DEFAULT_MISSING_MESH, DEFAULT_OBJECTIVE, DEFAULT_PRECISION, CLUSTER_PROFILE,
                                       DEFAULT_REDUCE_DTYPE)

__all__ = [
    "AMSPSettings",
    "BatchSettings",
    "ConfigError",
    "ENGINE_KEYS",
    "OLD_KEYS_UNTIL",
    "PrecisionSettings",
    "amsp_enabled",
    "check_optimizer_block",
    "ds_bucket_bytes",
    "load_ds_config",
    "resolve_batch",
    "upgrade_block",
]



class ConfigError(ValueError):
    """A ds_config / amsp block that cannot run. One line, naming the field."""


def _check_keys(d: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{where}.{k}: unknown key; allowed: {', '.join(allowed)}")


def _positive_int_or_none(v: Any, name: str) -> None:
    if v is not None:
        check_int(v, name, minimum=1, error=ConfigError)


def _bool(v: Any, name: str) -> None:
    check_bool(v, name, error=ConfigError)


def _size(v: Any, name: str) -> int | None:
    """Bytes from ``"25MiB"`` or an integer; None stays None."""
    if v is None:
        return None
    if is_int(v):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1 byte, got {v}")
        return v
    if isinstance(v, str):
        from amsp_ext.planner.specs import parse_size

        return parse_size(v, field=name)
    raise ConfigError(f"{name} must be a size like '25MiB' or a number of bytes, got {v!r}")


def _plan_text(v: Any) -> str:
    """The ``plan`` value as the engine's text form (factor dicts become ``p=..,g=..,os=..``)."""
    if isinstance(v, str):
        if not v.strip():
            raise ConfigError("amsp.plan must be 'auto', a baseline name or factors, got ''")
        return v.strip()
    if isinstance(v, Mapping):
        _check_keys(v, ("p", "g", "os"), "amsp.plan")
        parts = []
        for comp in ("p", "g", "os"):
            if comp not in v:
                if comp == "g":
                    continue
                raise ConfigError(f"amsp.plan.{comp} is required in a factor plan, e.g. [8, 1]")
            mesh = v[comp]
            if (not isinstance(mesh, (list, tuple)) or len(mesh) != 2
                    or not all(is_int(x) and x >= 1 for x in mesh)):
                raise ConfigError(f"amsp.plan.{comp} must be [s0, s1] (two integers >= 1), got {mesh!r}")
            parts.append(f"{comp}={mesh[0]}x{mesh[1]}")
        return ",".join(parts)
    raise ConfigError(
        f"amsp.plan must be 'auto', a baseline name (ddp, zero1, zero2, zero3, mics:K), factors "
        f"'p=S0xS1,g=S0xS1,os=S0xS1' or {{\"p\": [s0, s1], ...}}, got {v!r}")


# The engine keys of the block are EngineConfig's fields, but these, which DeepSpeed's own keys set.
_FROM_DEEPSPEED = {"precision": "bf16.enabled / fp16.enabled",
                   "reduce_dtype": "communication_data_type (or data_types.grad_accum_dtype)",
                   "fp16": "the fp16 block (initial_scale_power, loss_scale_window, min_loss_scale)"}
ENGINE_KEYS = tuple(f.name for f in fields(EngineConfig)
                    if f.name not in _FROM_DEEPSPEED and f.name not in ("auto", "adaptive"))
# [Note: renamed keys]
# A file the project wrote keeps loading: a key of the block's old shape (the one `amsp migrate`
# wrote before the engine had one config) is read at its new place, as DeepSpeed reads its
# renamed keys, until OLD_KEYS_UNTIL; `amsp migrate` rewrites such a block in the new shape
# (upgrade_block). Giving a key at both places is an error: which one was meant is not for the
# loader to guess. The user must see it: one FutureWarning line per config that names where the
# config came from (its file, or who passed the dict) and every moved key. Not a
# DeprecationWarning: Python's default filters show those only when attributed to __main__, and
# the config is loaded deep inside a framework (the HF Trainer, Accelerate, deepspeed.initialize);
# the warning is attributed to the first frame outside amsp_ext and the installed packages, the
# user's own line.
OLD_KEYS_UNTIL = "0.2"  # the minor version that stops reading them
_OLD_CLUSTER_KEYS = ("gpus_per_node", "nodes_per_leaf", "gpu_memory")  # amsp.cluster.<k> -> amsp.<k>
_RENAMED_KEYS = {"bucket_size": "grad_bucket_bytes"}


def upgrade_block(block: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The ``"amsp"`` block in the current shape, and ``(old key, new key)`` of each key moved
    (key paths, ``amsp.cluster.gpus_per_node``). A block already in the current shape comes back
    equal, with no moves."""
    out = dict(block)
    moved: list[tuple[str, str]] = []

    def move(old_path: str, key: str, value: Any) -> None:
        if key in block:
            raise ConfigError(f"{old_path} and amsp.{key} are the same setting; give only amsp.{key}")
        out[key] = value
        moved.append((old_path, f"amsp.{key}"))

    if "cluster" in out:
        cluster = out.pop("cluster")
        if not isinstance(cluster, Mapping):
            raise ConfigError(f"amsp.cluster must be an object, got {type(cluster).__name__}")
        _check_keys(cluster, _OLD_CLUSTER_KEYS, "amsp.cluster")
        for key, value in cluster.items():
            move(f"amsp.cluster.{key}", key, value)
    for old, new in _RENAMED_KEYS.items():
        if old in out:
            move(f"amsp.{old}", new, out.pop(old))
    return out, moved


@dataclass(frozen=True, kw_only=True)
class AMSPSettings:
    """The ``"amsp"`` block. Build it with ``AMSPSettings.from_dict``. ``engine`` holds the block's
    engine keys (EngineConfig's own fields and defaults); ``engine_keys`` the ones it gave."""

    enabled: bool = False
    plan: str = "auto"
    seq_len: int | None = None
    gpu_memory: str | int | None = None
    profile: str = CLUSTER_PROFILE
    missing_mesh: str = DEFAULT_MISSING_MESH
    objective: str = DEFAULT_OBJECTIVE
    frozen_models: int | None = None
    adaptive: AdaptiveConfig | None = None
    log_plan: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _bool(self.enabled, "amsp.enabled")
        object.__setattr__(self, "plan", _plan_text(self.plan))
        self._check_plan_text()
        _positive_int_or_none(self.seq_len, "amsp.seq_len")
        _size(self.gpu_memory, "amsp.gpu_memory")
        if self.frozen_models is not None and (isinstance(self.frozen_models, bool)
                                               or not isinstance(self.frozen_models, int) or self.frozen_models < 0):
            raise ConfigError(f"amsp.frozen_models must be an integer >= 0, got {self.frozen_models!r}")
        if not isinstance(self.profile, str) or not self.profile:
            raise ConfigError(f"amsp.profile must be a bundled profile name or a JSON path, got {self.profile!r}")
        for name, allowed in (("missing_mesh", MISSING_MESH), ("objective", OBJECTIVES)):
            check_one_of(getattr(self, name), allowed, f"amsp.{name}", error=ConfigError)
        _bool(self.log_plan, "amsp.log_plan")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise ConfigError(f"amsp.adaptive must be an object or null, got {self.adaptive!r}")
        try:
            check_replannable(self.plan, self.adaptive, flag="amsp.adaptive.allow_replan")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if is_auto(self.plan) and self.enabled and self.seq_len is None:
            raise ConfigError("amsp.seq_len is required when amsp.plan is 'auto' (the planner sizes "
                              "activations by it); or give amsp.plan as factors or a baseline name")
        if self.adaptive is not None and self.enabled and self.seq_len is None:
            raise ConfigError("amsp.seq_len is required with amsp.adaptive (the monitor predicts "
                              "each step's collectives with the planner); or remove amsp.adaptive")
        if is_auto(self.engine.all_reduce) and self.enabled and self.seq_len is None:
            raise ConfigError("amsp.seq_len is required when amsp.all_reduce is 'auto' (the planner "
                              "prices both modes for the step); or give flat or two_level")

    def _check_plan_text(self) -> None:
        """Catch a misspelt plan now (one line), not after the ranks started."""
        from amsp_ext.planner.plan import PlanError, check_plan_text

        try:
            check_plan_text(self.plan, "amsp.plan")
        except PlanError as e:
            raise ConfigError(str(e)) from None

    @property
    def gpu_memory_bytes(self) -> int | None:
        return _size(self.gpu_memory, "amsp.gpu_memory")

    @property
    def bucket_bytes(self) -> int | None:
        """The block's gradient bucket, or None when it gave none (DeepSpeed's then counts)."""
        return self.engine.grad_bucket_bytes if "grad_bucket_bytes" in self.engine_keys else None

    @classmethod
    def from_dict(cls, block: Any, *, origin: str = "the ds_config") -> "AMSPSettings":
        """The block of a ds_config; ``origin``: where that config came from (``config_origin``),
        named by the warning an old-shape block gets ([Note: renamed keys])."""
        if block is None:
            return cls()
        if not isinstance(block, Mapping):
            raise ConfigError(f"amsp must be an object, got {type(block).__name__}")
        block, moved = upgrade_block(block)
        if moved:
            warn_old_keys(moved, origin)
        for k in block:
            if k in _FROM_DEEPSPEED:
                raise ConfigError(f"amsp.{k}: set by DeepSpeed's own {_FROM_DEEPSPEED[k]}, not in "
                                  f"the amsp block")
        route = tuple(f.name for f in fields(cls) if f.name not in ("engine", "engine_keys"))
        _check_keys(block, route + ENGINE_KEYS, "amsp")
        kw = {k: v for k, v in block.items() if k in route}
        if "enabled" not in kw:
            raise ConfigError("amsp.enabled is required (true routes deepspeed.initialize to AMSP)")
        engine = {k: v for k, v in block.items() if k in ENGINE_KEYS}
        try:
            kw["engine"] = schema.from_dict(EngineConfig, engine, where="amsp")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kw["engine_keys"] = frozenset(engine)
        if kw.get("adaptive") is not None:
            try:
                kw["adaptive"] = AdaptiveConfig.from_dict(kw["adaptive"], where="amsp.adaptive")
            except ValueError as e:
                msg = str(e)
                raise ConfigError(msg if msg.startswith("amsp.") else f"amsp.{msg}") from None
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what ``amsp migrate`` writes): the route keys and the engine keys given."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("engine", "engine_keys"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, AdaptiveConfig):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
                v["band"] = list(v["band"])
            out[f.name] = v
        engine = schema.to_dict(self.engine)
        out.update({k: engine[k] for k in sorted(self.engine_keys)})
        return out

    def engine_config(self, *, precision: str, reduce_dtype: str, fp16: FP16Config,
                      ds_bucket_bytes: int | None, auto: AutoPlanConfig | None) -> EngineConfig:
        """The engine's config of this run: the block's engine keys, DeepSpeed's precision,
        reduce dtype and loss scaling, the bucket (the block's, else DeepSpeed's
        reduce_bucket_size, else the engine's default), plan auto's inputs and adaptive."""
        kw: dict[str, Any] = {}
        if self.bucket_bytes is None and ds_bucket_bytes is not None:
            kw["grad_bucket_bytes"] = ds_bucket_bytes
        try:
            return dataclasses.replace(self.engine, precision=precision, reduce_dtype=reduce_dtype,
                                       fp16=fp16, auto=auto, adaptive=self.adaptive, **kw)
        except ValueError as e:
            raise ConfigError(str(e)) from None


# -- DeepSpeed's own keys ------------------------------------------------------------------------

def warn_old_keys(moved: list[tuple[str, str]], origin: str) -> None:
    """One FutureWarning line for the keys an old-shape block moved ([Note: renamed keys])."""
    old, new = ", ".join(a for a, _ in moved), ", ".join(b for _, b in moved)
    warnings.warn(f"amsp_ext: {origin}: {old} {'is' if len(moved) == 1 else 'are'} deprecated, read as "
                  f"{new} until amsp_ext {OLD_KEYS_UNTIL}; run `amsp migrate` to upgrade the file",
                  FutureWarning, stacklevel=_user_stacklevel())


def _outside(filename: str) -> bool:
    """A frame of the user's code: not amsp_ext, not an installed package, not the interpreter's."""
    package = str(Path(__file__).resolve().parents[1])
    return not (filename.startswith(package) or "-packages" in filename or filename.startswith("<"))


def _installed_package(filename: str) -> str | None:
    """The installed package a file belongs to (``transformers``), None for other code."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1].split("/", 1)[0]
    return None


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel (from a function that warns) of the first frame outside
    amsp_ext and the installed packages (``_outside``), else of that function's caller."""
    frame, level = inspect.currentframe().f_back.f_back, 2  # the caller of the function that warns
    while frame is not None:
        if _outside(frame.f_code.co_filename):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def config_origin(config: Any, args: Any = None) -> str:
    """Where a ds_config came from, for messages: its file, or what passed a dict (the
    ``accelerate launch`` config's file, else the caller of ``deepspeed.initialize``)."""
    path = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None) or config
    if isinstance(path, (str, os.PathLike)) and Path(path).is_file():
        return f"ds_config {Path(path).resolve()}"
    launched = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launched and Path(launched).is_file():
        return f"ds_config of {Path(launched).resolve()} (accelerate launch)"
    frame, by = inspect.currentframe().f_back, None
    while frame is not None and not _outside(frame.f_code.co_filename):
        package = _installed_package(frame.f_code.co_filename)
        if package not in (None, "deepspeed"):
            by = package  # the outermost: the framework the user called (transformers, trl, accelerate)
        frame = frame.f_back
    where = f" from {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    return f"the ds_config dict {by + ' ' if by else ''}passed to deepspeed.initialize{where}"


def load_ds_config(config: Any) -> dict[str, Any]:
    """A ds_config given as a dict, a path, or a JSON string (as ``deepspeed.initialize`` takes)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_file():
            try:
                return _json_object(json.loads(path.read_text()), f"ds_config {path}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"ds_config {path}: not valid JSON "
                                  f"({getattr(e, 'msg', e)}, line {getattr(e, 'lineno', '?')})") from None
        text = str(config).strip()
        if text.startswith("{"):
            try:
                return _json_object(json.loads(text), "ds_config")
            except json.JSONDecodeError as e:
                raise ConfigError(f"ds_config: not valid JSON ({e.msg})") from None
        raise ConfigError(f"ds_config: no such file {str(config)!r}")
    raise ConfigError(f"ds_config must be a dict, a path or a JSON string, got {type(config).__name__}")


def _json_object(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: must be a JSON object ({{...}}), got a JSON {type(v).__name__}")
    return v


_MAX_BUCKET_ELEMENTS = 1e12  # 4 TB of fp32 gradients: beyond any model, and an int64 count of bytes


def ds_bucket_bytes(cfg: Mapping[str, Any], precision: str) -> int | None:
    """The config's explicit ``zero_optimization.reduce_bucket_size`` in bytes (DeepSpeed counts
    elements), or None when it is absent or "auto"; anything else is a ConfigError."""
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization must be an object, got {zero!r}")
    v = zero.get("reduce_bucket_size")
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= _MAX_BUCKET_ELEMENTS:
        raise ConfigError(f"zero_optimization.reduce_bucket_size must be a number of elements in "
                          f"1..{_MAX_BUCKET_ELEMENTS:.0e} or 'auto', got {v!r}")
    return int(v) * (4 if precision == "fp32" else 2)


def amsp_enabled(config: Mapping[str, Any]) -> bool:
    """The routing question (no validation): does this config ask for AMSP? Yes when it has an
    ``"amsp"`` block whose ``enabled`` is anything but ``false``: ``true``, and also a missing or
    misspelt value (``"yes"``, ``"true"``), which then fails validation with one line instead
    of DeepSpeed running silently behind a block the user meant to switch on."""
    block = config.get("amsp") if isinstance(config, Mapping) else None
    return isinstance(block, Mapping) and block.get("enabled") is not False


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def _batch_value(cfg: Mapping[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if v == "auto":
        raise ConfigError(f"{key} is 'auto': the launcher (HF Trainer / Accelerate) fills it; "
                          f"called directly, give a number")
    if not is_int(v) or v < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {v!r}")
    return v


def _divide(total: int, total_key: str, parts: list[tuple[str, int]]) -> int:
    """``total / product(parts)`` when it is a whole number >= 1; else a one-line error naming
    the keys (never an impossible derived value such as 0 accumulation steps)."""
    div = 1
    for _, v in parts:
        div *= v
    if total % div or total < div:
        names = " x ".join(f"{k}={v}" for k, v in parts)
        raise ConfigError(f"{total_key}={total} is not a multiple of {names} = {div}; change "
                          f"{total_key} or the others so that it divides")
    return total // div


def resolve_batch(cfg: Mapping[str, Any], world_size: int) -> BatchSettings:
    """DeepSpeed's rules (``DeepSpeedConfig._set_batch_related_parameters``): any two of
    train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps give the
    third; train_batch_size alone means GAS = 1; the three must agree with the world size."""
    tbs = _batch_value(cfg, "train_batch_size")
    mbs = _batch_value(cfg, "train_micro_batch_size_per_gpu")
    gas = _batch_value(cfg, "gradient_accumulation_steps")
    world = ("world size", world_size)
    if tbs is not None and mbs is not None and gas is not None:
        pass
    elif tbs is not None and mbs is not None:
        gas = _divide(tbs, "train_batch_size", [("train_micro_batch_size_per_gpu", mbs), world])
    elif tbs is not None and gas is not None:
        mbs = _divide(tbs, "train_batch_size", [("gradient_accumulation_steps", gas), world])
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * world_size
    elif tbs is not None:
        gas, mbs = 1, _divide(tbs, "train_batch_size", [world])
    elif mbs is not None:
        gas, tbs = 1, mbs * world_size
    else:
        raise ConfigError("train_batch_size or train_micro_batch_size_per_gpu must be given "
                          "(the DeepSpeed batch keys)")
    if tbs != mbs * gas * world_size:
        raise ConfigError(
            f"train_batch_size={tbs} must equal train_micro_batch_size_per_gpu={mbs} x "
            f"gradient_accumulation_steps={gas} x world size {world_size}")
    return BatchSettings(train_batch_size=tbs, micro_batch_size=mbs, gradient_accumulation_steps=gas)


@dataclass(frozen=True, kw_only=True)
class PrecisionSettings:
    """``bf16`` / ``fp16`` blocks. Dynamic loss scaling follows DeepSpeed's keys."""

    precision: str = DEFAULT_PRECISION
    reduce_dtype: str = DEFAULT_REDUCE_DTYPE  # ShardConfig.reduce_dtype; see reduce_dtype_from_ds
    initial_scale: float = 2.0**16
    growth_interval: int = 1000
    min_scale: float = 1.0
    notes: tuple[str, ...] = ()  # keys honoured only approximately (reported, never silent)

    @classmethod
    def from_ds(cls, cfg: Mapping[str, Any]) -> "PrecisionSettings":
        prec = cls._from_ds_blocks(cfg)
        return dataclasses.replace(prec, reduce_dtype=reduce_dtype_from_ds(cfg, prec.precision))

    @classmethod
    def _from_ds_blocks(cls, cfg: Mapping[str, Any]) -> "PrecisionSettings":
        def enabled(block: str) -> bool:
            b = cfg.get(block)
            if b is None:
                return False
            if not isinstance(b, Mapping):
                raise ConfigError(f"{block} must be an object like {{\"enabled\": true}}, got {b!r}")
            v = b.get("enabled", False)
            if v == "auto":
                raise ConfigError(f"{block}.enabled is 'auto': the launcher fills it; called directly, "
                                  f"give true or false")
            _bool(v, f"{block}.enabled")
            return v

        bf16 = enabled("bf16") or enabled("bfloat16")
        fp16 = enabled("fp16")
        amp = cfg.get("amp")
        if isinstance(amp, Mapping) and amp.get("enabled") is True:
            raise ConfigError("amp.enabled: NVIDIA Apex AMP is not supported by AMSP; use bf16 or fp16")
        if bf16 and fp16:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable one")
        if bf16:
            return cls(precision="bf16")
        if not fp16:
            return cls()
        f = cfg["fp16"]
        notes = []
        static = f.get("loss_scale", 0)
        power = f.get("initial_scale_power", 16)
        if not is_int(power) or not 0 <= power < 64:
            raise ConfigError(f"fp16.initial_scale_power must be an integer in 0..63, got {power!r}")
        initial = 2.0**power
        if static not in (0, 0.0):
            if not isinstance(static, (int, float)) or static <= 0:
                raise ConfigError(f"fp16.loss_scale must be 0 (dynamic) or a positive number, got {static!r}")
            notes.append(f"fp16.loss_scale={static}: static scaling is run as dynamic scaling "
                         f"starting at {static}")
            initial = float(static)
        window = f.get("loss_scale_window", 1000)
        if not is_int(window) or window < 1:
            raise ConfigError(f"fp16.loss_scale_window must be an integer >= 1, got {window!r}")
        min_scale = f.get("min_loss_scale", 1)
        if not isinstance(min_scale, (int, float)) or isinstance(min_scale, bool) or min_scale <= 0:
            raise ConfigError(f"fp16.min_loss_scale must be a number > 0, got {min_scale!r}")
        if f.get("hysteresis", 2) not in (1,):
            notes.append(f"fp16.hysteresis={f.get('hysteresis', 2)}: AMSP backs off on every "
                         f"overflow (hysteresis 1)")
        return cls(precision="fp16", initial_scale=initial, growth_interval=window,
                   min_scale=float(min_scale), notes=tuple(notes))


_NUMBER_PARAMS = ("lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "lr_decay")


def check_optimizer_block(cfg: Mapping[str, Any]) -> None:
    """The ``optimizer`` block's shape and its common numeric params, torch-free (``amsp
    migrate``); ``integrations.optim`` checks every param against the optimizer class."""
    block = cfg.get("optimizer")
    if block is None:
        return
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise ConfigError("optimizer must be an object with 'type' (a string) and 'params'")
    params = block.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"optimizer.params must be an object, got {params!r}")
    for k, v in params.items():
        if v == "auto":
            continue  # the launcher fills it
        if k in _NUMBER_PARAMS and (isinstance(v, bool) or not isinstance(v, (int, float))
                                    or v != v or v in (float("inf"), float("-inf"))):
            raise ConfigError(f"optimizer.params.{k} must be a finite number, got {v!r}")
        if k == "lr" and v <= 0:
            raise ConfigError(f"optimizer.params.lr must be > 0, got {v!r}")
        if k in ("weight_decay", "eps") and v < 0:
            raise ConfigError(f"optimizer.params.{k} must be >= 0, got {v!r}")
        if k == "betas" and not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in v)):
            raise ConfigError(f"optimizer.params.betas must be a list of 2 numbers in [0, 1), got {v!r}")


def reduce_dtype_from_ds(cfg: Mapping[str, Any], precision: str) -> str:
    """``communication_data_type`` (else ``data_types.grad_accum_dtype``) as ShardConfig's
    reduce_dtype: AMSP reduces and accumulates gradients in one dtype, fp32 or the precision.
    Absent, AMSP's default fp32 (DeepSpeed's is the compute dtype; the note in
    runtime/config.py says why AMSP differs, and ``amsp_ext.initialize`` prints the choice)."""
    return named_reduce_dtype(cfg, precision) or DEFAULT_REDUCE_DTYPE


def named_reduce_dtype(cfg: Mapping[str, Any], precision: str) -> str | None:
    """The reduce dtype the ds_config names (checked, lower case), None where it names none."""
    allowed = reduce_dtypes(precision)
    got = {}
    comm = cfg.get("communication_data_type")
    if comm is not None:
        got["communication_data_type"] = comm
    types = cfg.get("data_types")
    if types is not None:
        if not isinstance(types, Mapping):
            raise ConfigError(f"data_types must be an object like {{\"grad_accum_dtype\": \"fp32\"}}, got {types!r}")
        _check_keys(types, ("grad_accum_dtype",), "data_types")
        if types.get("grad_accum_dtype") is not None:
            got["data_types.grad_accum_dtype"] = types["grad_accum_dtype"]
    for key, v in got.items():
        if not isinstance(v, str) or v.lower() not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)} with {precision} training "
                              f"(AMSP reduces in fp32 or the compute dtype), got {v!r}")
    values = {v.lower() for v in got.values()}
    if len(values) > 1:
        raise ConfigError("communication_data_type and data_types.grad_accum_dtype differ "
                          f"({', '.join(f'{k}={v!r}' for k, v in got.items())}); AMSP accumulates "
                          "gradients in the dtype it reduces them in: give one value")
    return values.pop() if values else None


def gradient_clipping(cfg: Mapping[str, Any]) -> float:
    v = cfg.get("gradient_clipping", 0.0)
    if v == "auto":
        raise ConfigError("gradient_clipping is 'auto': the launcher fills it; called directly, give a number")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ConfigError(f"gradient_clipping must be a finite number >= 0 (0: off), got {v!r}")
    return float(v)
