"""Which optimizers may step a row shard: the elementwise ones, by name (no collective).

[Note: elementwise or whole-tensor]
Under a plan that shards a parameter's rows (sp > 1: zero3, mics, p=2x1...) a rank's local
tensor is a row shard (layout.py). An *elementwise* optimizer (SGD, Adam, AdamW, ...) computes
each element's update from that element's gradient and state alone (and scalars such as the
step count), so stepping shards is stepping the whole tensor. A *whole-tensor* optimizer reads
the tensor as a matrix: Muon orthogonalises it, Adafactor factors its second moment into row
and column statistics, Shampoo keeps Kronecker factors. Stepped on a slice it computes a
different update, with no error. So a class is elementwise only when it is listed here by its
exact class (a user subclass may change the update: it is not) or declared so by the user
(the class attribute ``amsp_elementwise = True`` on the class itself, or
``ShardConfig(optimizer_kind="elementwise")``); everything else is whole-tensor, and whole-tensor
optimizers get whole tensors (whole_tensor.py). Blockwise-quantised optimizers (bitsandbytes'
8-bit Adam family) are listed as whole-tensor: their quantisation blocks run over the flattened
tensor, so shard boundaries would move them.

[Note: deciding before the engine exists]
The class is known only once ``optimizer_factory`` runs, and the factory is given the masters
of a layout that depends on the answer. So ``shard()`` calls the factory once on meta
placeholders shaped as the trainable parameters (each with ``amsp_name``, in forward order)
before any collective, reads the class, and drops that optimizer. A factory that fails on
placeholders is answered in one line asking for the declaration. The same placeholder
optimizer says what each tensor's step costs (``tensor_costs``), which whole-tensor ownership
balances (ownership.py [Note: owners balanced by the optimizer's work]); a declared kind builds
nothing, and its tensors are costed as matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from amsp_ext.choices import OPTIMIZER_KINDS, check_one_of
from amsp_ext.runtime.optim.ownership import step_cost

__all__ = ["ELEMENTWISE", "Detected", "detect_kind", "kind_of_class", "planner_optimizer", "tensor_costs",
           "unwrap_optimizer"]


@dataclass(frozen=True)
class Detected:
    kind: str  # elementwise | whole_tensor
    name: str  # the optimizer's class name, or "declared"
    # parameter name -> the optimizer's work on it (whole-tensor optimizers built on placeholders;
    # empty otherwise: a tensor not named here is costed by its shape as a matrix)
    costs: Mapping[str, int] = field(default_factory=dict)

# exact classes, by module and name (no import of DeepSpeed, apex or bitsandbytes here)
ELEMENTWISE = frozenset({
    *(f"torch.optim.{m}.{c}" for m, c in (
        ("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("adamax", "Adamax"), ("nadam", "NAdam"),
        ("radam", "RAdam"), ("rmsprop", "RMSprop"), ("adagrad", "Adagrad"))),
    "deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", "apex.optimizers.fused_adam.FusedAdam",
})


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def unwrap_optimizer(opt: object) -> object:
    """The optimizer under Accelerate's ``AcceleratedOptimizer`` (and similar thin wrappers that
    keep it as ``.optimizer``)."""
    seen = 0
    while not type(opt).__module__.startswith("torch.optim") and isinstance(
            getattr(opt, "optimizer", None), torch.optim.Optimizer) and seen < 4:
        opt, seen = opt.optimizer, seen + 1
    return opt


def kind_of_class(cls: type) -> str:
    """``elementwise`` or ``whole_tensor`` for an optimizer class ([Note: elementwise or
    whole-tensor])."""
    declared = cls.__dict__.get("amsp_elementwise")
    if declared is not None:
        if not isinstance(declared, bool):
            raise ValueError(f"{cls.__name__}.amsp_elementwise must be True or False, got {declared!r}")
        return "elementwise" if declared else "whole_tensor"
    return "elementwise" if _qualified(cls) in ELEMENTWISE else "whole_tensor"


def planner_optimizer(class_name: str) -> str:
    """The planner's name (choices.OPTIMIZERS) for a whole-tensor optimizer class, so plan
    'auto' prices its exchange and memory (planner/cost.py [Note: the whole-tensor exchange]):
    Adafactor by its name, every other one as Muon (one fp32 moment per parameter)."""
    return "adafactor" if "adafactor" in class_name.lower() else "muon"


def _linear_work(cls: type) -> bool:
    """An optimizer whose work per tensor is linear in its elements (elementwise ones, and
    Adafactor: its row and column means are one pass)."""
    return kind_of_class(cls) == "elementwise" or "adafactor" in cls.__name__.lower()


def tensor_costs(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter name (``amsp_name``) -> the optimizer's work on it (ownership.py [Note: owners
    balanced by the optimizer's work]): a group that says ``use_muon`` is Muon's (matrix cost)
    or AdamW's (element count); otherwise the class decides, and a class not known to be
    linear is costed as matrices (Muon, Shampoo and unknown ones: never guess cheap)."""
    linear = _linear_work(type(opt))
    costs = {}
    for g in opt.param_groups:
        use_muon = g.get("use_muon")
        matrix = use_muon if isinstance(use_muon, bool) else not linear
        for p in g["params"]:
            name = getattr(p, "amsp_name", None)
            if name is not None:
                costs[name] = step_cost(tuple(p.shape), matrix)
    return costs


def detect_kind(optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                params: Iterable[tuple[str, nn.Parameter]], declared: str = "detect") -> Detected:
    """The kind, class name and per-tensor costs of what ``optimizer_factory`` builds ([Note:
    deciding before the engine exists]); ``declared`` (ShardConfig.optimizer_kind) other than
    ``detect`` wins."""
    check_one_of(declared, OPTIMIZER_KINDS, "optimizer_kind")
    placeholders = []
    for name, p in params:
        if p.requires_grad:
            m = nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta"))
            m.amsp_name = name
            placeholders.append(m)
    if declared != "detect":
        return Detected(declared, "declared")
    try:
        built = optimizer_factory(placeholders or [nn.Parameter(torch.empty(0, device="meta"))])
    except Exception as e:  # noqa: BLE001 - any failure: ask for the declaration
        raise ValueError(
            f"optimizer_factory failed on meta placeholders of the parameters ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}), so its kind cannot be read; declare it: "
            f"ShardConfig(optimizer_kind='elementwise' or 'whole_tensor') or an 'amsp' key "
            f"optimizer_kind") from None
    opt = unwrap_optimizer(built)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer_factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
    kind = kind_of_class(type(opt))
    return Detected(kind, type(opt).__name__, tensor_costs(opt) if kind == "whole_tensor" else {})
