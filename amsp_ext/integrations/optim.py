"""The optimizer and LR scheduler of a DeepSpeed-style job, rebuilt over AMSP's master weights.

[Note: the inner optimizer runs over the masters, with the caller's param groups]
AMSP steps fp32 masters of the local tensors each rank owns (amsp_ext.runtime.optim.optimizer), so the
optimizer has to hold those masters instead of the model's parameters. A param group is kept as
the set of parameter *names* it held (each master carries ``amsp_name``) plus its
hyper-parameters, so weight-decay / no-decay splits and per-group learning rates survive. A
client optimizer *object* becomes the inner optimizer itself: its groups' ``params`` lists are
swapped for the masters (its state, empty before training, is dropped), so its group dicts -
what an LR scheduler bound to it writes, and what the script reads back - stay the same objects
(Accelerate, for one, keeps such a scheduler bound to the client optimizer). An ``optimizer``
block or a callable builds a new optimizer over the same groups. Every rank builds the same
groups in the same order, even where it owns no tensor of a group (an empty group), so
schedulers see the same group count everywhere.

[Note: DeepSpeed's optimizer names]
``Adam`` in a ds_config runs AdamW (decoupled weight decay) unless ``adam_w_mode`` is false, and
its default weight decay is 0 (DeepSpeed's FusedAdam), not torch AdamW's 0.01; ``AdamW`` always
runs AdamW. ``Adagrad`` is torch's. ``Muon`` has DeepSpeed's meaning: Muon for the parameters
marked ``use_muon`` (DeepSpeed asks the user to mark every one; unmarked, the hidden matrices:
2-D and neither an embedding nor the head) and AdamW for the rest, with DeepSpeed's keys (lr,
momentum, weight_decay, muon_lr; betas, eps, adam_lr), run by torch's Muon and AdamW
(runtime/optim/muon_adamw.py) on whole tensors (runtime/optim/kinds.py). Any other name DeepSpeed
does not know is looked up in ``torch.optim`` (as DeepSpeed does: ``Adafactor``). DeepSpeed's
CUDA-only optimizers (Lamb, 1-bit Adam/Lamb, 0/1 Adam, Lion, MuAdam) are refused with a one-line
error.

[Note: LR schedulers]
A ``scheduler`` block is built with DeepSpeed's own classes (``deepspeed.runtime.lr_schedules``:
WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or, for other names,
``torch.optim.lr_scheduler``, over the AMSP optimizer (a ``torch.optim.Optimizer`` whose
``param_groups`` are the inner optimizer's). A client scheduler object is kept (it is bound to
the client optimizer, now the inner one); a callable is called with the AMSP optimizer (as
DeepSpeed calls it with its basic optimizer).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from amsp_ext.integrations.settings import ConfigError

__all__ = ["GroupSpec", "build_optimizer_factory", "build_scheduler"]

_DS_CUDA_ONLY = ("lamb", "onebitadam", "onebitlamb", "zerooneadam", "lion", "muadam",
                 "muadamw", "musgd")
# DeepSpeed's "Muon" block keys, by the half they configure (deepspeed/runtime/engine.py)
_MUON_KEYS = {"lr": "both", "weight_decay": "both", "momentum": "muon", "muon_lr": "muon", "betas": "adamw",
              "eps": "adamw", "adam_lr": "adamw"}


class GroupSpec:
    """One param group: hyper-parameters and the names of the parameters it holds."""

    def __init__(self, hyper: dict[str, Any], names: list[str]) -> None:
        self.hyper, self.names = hyper, set(names)


def _named(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _groups_from(params: Iterable[Any], model: nn.Module, where: str) -> list[GroupSpec]:
    """Param groups (``[{"params": [...], "lr": ...}, ...]`` or a flat list of parameters)."""
    names = _named(model)
    items = list(params)
    if items and not isinstance(items[0], Mapping):
        items = [{"params": items}]
    groups = []
    for i, g in enumerate(items):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ConfigError(f"{where}: param group {i} must be a dict with 'params'")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        missing = [p for p in ps if id(p) not in names]
        if missing:
            raise ConfigError(f"{where}: param group {i} holds {len(missing)} tensor(s) that are not "
                              f"parameters of the model")
        groups.append(GroupSpec({k: v for k, v in g.items() if k != "params"},
                                [names[id(p)] for p in ps]))
    return groups


def _factory(cls: type, defaults: Mapping[str, Any], groups: list[GroupSpec]
             ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def build(masters: list[nn.Parameter]) -> torch.optim.Optimizer:
        by_group: list[list[nn.Parameter]] = [[] for _ in groups]
        for m in masters:
            name = getattr(m, "amsp_name", None)
            if name is None:  # the placeholder of a rank that owns nothing
                by_group[0].append(m)
                continue
            for gi, g in enumerate(groups):
                if name in g.names:
                    by_group[gi].append(m)
                    break
            # a master in no group is not optimized (the caller left its parameter out)
        param_groups = [{"params": ps, **g.hyper} for ps, g in zip(by_group, groups)]
        try:
            return cls(param_groups, **defaults)
        except TypeError as e:
            raise ConfigError(
                f"cannot rebuild optimizer {cls.__name__} over the AMSP master weights ({e}); pass "
                f"optimizer=lambda params: {cls.__name__}(params, ...) instead") from None
    return build


def _from_block(block: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    if not isinstance(block, Mapping) or "type" not in block:
        raise ConfigError("optimizer must be an object with 'type' and 'params'")
    name = block["type"]
    if not isinstance(name, str):
        raise ConfigError(f"optimizer.type must be a string, got {name!r}")
    params = dict(block.get("params") or {})
    for k, v in params.items():
        if v == "auto":
            raise ConfigError(f"optimizer.params.{k} is 'auto': the launcher fills it; called "
                              f"directly, give a value")
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm is not supported (as in DeepSpeed); use "
                          "the top-level gradient_clipping")
    low = name.lower()
    if low in ("adam", "adamw"):
        params.pop("torch_adam", None)
        params.pop("set_grad_none", None)
        adam_w_mode = params.pop("adam_w_mode", True)
        if params.pop("bias_correction", True) is not True:
            raise ConfigError("optimizer.params.bias_correction=false is not supported by AMSP "
                              "(torch Adam/AdamW always correct the bias)")
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam default
        cls = torch.optim.AdamW if (low == "adamw" or adam_w_mode) else torch.optim.Adam
        return cls, _checked(cls, params)
    if low == "adagrad":
        return torch.optim.Adagrad, _checked(torch.optim.Adagrad, params)
    if low in _DS_CUDA_ONLY:
        raise ConfigError(f"optimizer.type {name!r} is a DeepSpeed CUDA optimizer AMSP does not run; "
                          f"use Adam, AdamW, Adagrad or a torch.optim class name")
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.type {name!r} is neither a DeepSpeed optimizer AMSP runs (Adam, "
                          f"AdamW, Adagrad) nor a torch.optim class")
    return cls, _checked(cls, params)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _checked(cls: type, params: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.params`` checked against ``cls``'s signature, one line naming the key, before
    any rank starts: a number where the default is a number, a list of numbers where it is a
    tuple of them (betas), true/false where it is a bool; then the optimizer's own checks."""
    sig = inspect.signature(cls.__init__)
    takes = [n for n in sig.parameters if n not in ("self", "params")]
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    for k, v in params.items():
        if k not in takes:
            if open_kwargs:
                continue
            raise ConfigError(f"optimizer.params.{k}: {cls.__name__} takes no such argument; it takes "
                              f"{', '.join(takes)}")
        d = sig.parameters[k].default
        if isinstance(d, bool):
            if not isinstance(v, bool):
                raise ConfigError(f"optimizer.params.{k} must be true or false, got {v!r}")
        elif isinstance(d, (int, float)):
            if not _is_number(v):
                raise ConfigError(f"optimizer.params.{k} must be a finite number, got {v!r}")
        elif isinstance(d, tuple) and d and all(isinstance(x, (int, float)) for x in d):
            if not (isinstance(v, (list, tuple)) and len(v) == len(d) and all(_is_number(x) for x in v)):
                raise ConfigError(f"optimizer.params.{k} must be a list of {len(d)} numbers, got {v!r}")
    try:  # the optimizer's own range checks (a negative lr, betas outside [0, 1), ...)
        cls([torch.zeros(1, requires_grad=True)], **params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer.params: {cls.__name__} refuses them: {str(e).splitlines()[0]}") from None
    return params


def build_optimizer_factory(model: nn.Module, *, client_optimizer: Any, model_parameters: Any,
                            ds_config: Mapping[str, Any]
                            ) -> tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, str]:
    """The ``optimizer_factory`` for ``amsp_ext.shard`` and a short description of its source.
    None where no optimizer is asked for at all (no client optimizer, no ``model_parameters``,
    no 'optimizer' block): a forward-only model, as DeepSpeed builds an engine without an
    optimizer for a reference model (runtime/sync/grad_sync.py [Note: a model without an
    optimizer])."""
    if client_optimizer is None and model_parameters is None and "optimizer" not in ds_config:
        return None, "none (forward-only)"
    trainable = [p for p in model.parameters() if p.requires_grad]
    source = model_parameters if model_parameters is not None else trainable
    if isinstance(client_optimizer, torch.optim.Optimizer):
        if "optimizer" in ds_config:
            warnings.warn("amsp: both a client optimizer and an 'optimizer' block were given; the "
                          "client optimizer is used (as in DeepSpeed)", stacklevel=3)
        groups = _groups_from(client_optimizer.param_groups, model, "optimizer")
        return _repoint(client_optimizer, groups), f"client {type(client_optimizer).__name__}"
    groups = _groups_from(source, model, "model_parameters")
    if client_optimizer is not None:
        if not callable(client_optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable, got "
                              f"{type(client_optimizer).__name__}")

        def from_callable(masters: list[nn.Parameter]) -> torch.optim.Optimizer:
            groups_over_masters = _factory(_Collect, {}, groups)(masters)
            return client_optimizer(groups_over_masters.groups)
        return from_callable, "client callable"
    if "optimizer" not in ds_config:
        raise ConfigError("no optimizer: pass optimizer= to initialize or add an 'optimizer' block "
                          "(e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}})")
    if str(ds_config["optimizer"].get("type", "")).lower() == "muon":
        return _muon_factory(model, groups, ds_config["optimizer"]), "ds_config Muon -> MuonWithAdamW"
    cls, params = _from_block(ds_config["optimizer"])
    return _factory(cls, params, groups), f"ds_config {ds_config['optimizer']['type']} -> {cls.__name__}"


def _muon_factory(model: nn.Module, groups: list[GroupSpec], block: Mapping[str, Any]
                  ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """DeepSpeed's Muon ([Note: DeepSpeed's optimizer names]): each param group split in a Muon
    half and an AdamW half, on every rank in the same order (a half may be empty here)."""
    from amsp_ext.runtime.optim.muon_adamw import MuonWithAdamW, is_hidden_matrix

    params = dict(block.get("params") or {})
    for k, v in params.items():
        if k not in _MUON_KEYS:
            raise ConfigError(f"optimizer.params.{k}: DeepSpeed's Muon takes {', '.join(_MUON_KEYS)}")
        if v == "auto":
            raise ConfigError(f"optimizer.params.{k} is 'auto': the launcher fills it; called directly, give a value")
    named = list(model.named_parameters())
    marked = [hasattr(p, "use_muon") for _, p in named]
    if any(marked) and not all(marked):
        unmarked = next(n for (n, _), m in zip(named, marked) if not m)
        raise ConfigError(f"optimizer.type Muon: some parameters carry use_muon and {unmarked!r} does not; "
                          f"mark every parameter (param.use_muon = True / False), as DeepSpeed asks")
    muon_names = {n for n, p in named if (bool(p.use_muon) if all(marked) else is_hidden_matrix(n, p))}
    muon = {k: v for k, v in params.items() if _MUON_KEYS[k] in ("both", "muon") and k != "muon_lr"}
    adamw = {k: v for k, v in params.items() if _MUON_KEYS[k] in ("both", "adamw") and k != "adam_lr"}
    if "muon_lr" in params:
        muon["lr"] = params["muon_lr"]
    if "adam_lr" in params:
        adamw["lr"] = params["adam_lr"]
    for half, kw, cls in (("Muon", muon, torch.optim.Muon), ("AdamW", adamw, torch.optim.AdamW)):
        try:
            cls([torch.zeros(2, 2, requires_grad=True)], **kw)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"optimizer.params: {half} refuses them: {str(e).splitlines()[0]}") from None

    def build(masters: list[nn.Parameter]) -> torch.optim.Optimizer:
        split = []
        for g in _factory(_Collect, {}, groups)(masters).groups:
            ps = g.pop("params")
            split.append({"params": [p for p in ps if getattr(p, "amsp_name", None) in muon_names],
                          "use_muon": True, **g})
            split.append({"params": [p for p in ps if getattr(p, "amsp_name", None) not in muon_names],
                          "use_muon": False, **g})
        return MuonWithAdamW(split, muon=muon, adamw=adamw)
    return build


def _repoint(client: torch.optim.Optimizer, groups: list[GroupSpec]
             ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The client optimizer object itself, its groups' ``params`` swapped for the masters.

    Its group dicts (and so the learning rates an LR scheduler bound to it writes, and what user
    code reads from ``optimizer.param_groups``) stay the same objects.
    """
    def build(masters: list[nn.Parameter]) -> torch.optim.Optimizer:
        collected = _factory(_Collect, {}, groups)(masters).groups
        if any(len(s) for s in client.state.values()):
            warnings.warn("amsp: the client optimizer already has state; it is dropped (the "
                          "AMSP optimizer starts from fresh states)", stacklevel=2)
        client.state.clear()
        for group, new in zip(client.param_groups, collected):
            group["params"] = new["params"]
        return client
    return build


class _Collect:
    """Stands in for an optimizer class to get the param groups the factory would build."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.groups = groups


def build_scheduler(optimizer: torch.optim.Optimizer | None, *, client_scheduler: Any,
                    ds_config: Mapping[str, Any]) -> Any:
    if optimizer is None:  # forward-only: nothing to schedule
        if client_scheduler is not None or ds_config.get("scheduler") is not None:
            raise ConfigError("lr_scheduler / 'scheduler' block: a model with no optimizer has no "
                              "learning rate to schedule; give an optimizer or drop the scheduler")
        return None
    if client_scheduler is not None:
        if hasattr(client_scheduler, "step") and hasattr(client_scheduler, "optimizer"):
            # bound to the client optimizer, which is now the inner optimizer (see the Note)
            return client_scheduler
        if callable(client_scheduler):
            return client_scheduler(optimizer)
        raise ConfigError(f"lr_scheduler must be a scheduler or a callable, got {type(client_scheduler).__name__}")
    block = ds_config.get("scheduler")
    if block is None:
        return None
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise ConfigError("scheduler must be an object with 'type' and 'params'")
    name, params = block["type"], dict(block.get("params") or {})
    for k, v in params.items():
        if v == "auto":
            raise ConfigError(f"scheduler.params.{k} is 'auto': the launcher fills it; called "
                              f"directly, give a value")
    from deepspeed.runtime import lr_schedules

    if name in lr_schedules.VALID_LR_SCHEDULES:
        cls = getattr(lr_schedules, name)
    else:
        cls = getattr(torch.optim.lr_scheduler, name, None)
        if not isinstance(cls, type):
            raise ConfigError(f"scheduler.type {name!r} is neither a DeepSpeed schedule "
                              f"({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) nor a "
                              f"torch.optim.lr_scheduler class")
    try:
        return cls(optimizer, **params)
    except TypeError as e:
        raise ConfigError(f"scheduler.params do not fit {name}: {e}") from None
