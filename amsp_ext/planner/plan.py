"""The AMSP plan: six sharding factors, their rules, their text form and the named baselines.

A plan gives each model-state component ``c`` in {p (parameters), g (gradients), os (optimizer
states)} a 2-D device mesh ``s0_c x s1_c``: ``s0_c`` GPUs inside a node times ``s1_c`` nodes.
In pure data parallelism ``s0_dp = R`` (GPUs per node) and ``s1_dp = N`` (nodes).

[Note: which rules are structural and which are search heuristics]
The paper's pre-filter applies five rules. Three are *structural*: without them the
per-component groups cannot be built (positive factors, the dependency rule Eq. 3-4, and
divisibility Eq. 5-6, which we read as "each factor divides the next one up", so that a
parameter-shard group nests inside a gradient group, which nests inside an optimizer-state
group, which tiles the node/cluster). Two are *search heuristics* that prune plans the paper
argues are never better: the cross-node rule (Eq. 7) and ``sg in {sp, sos}``. The engine can
execute any structurally valid plan; the planner only proposes plans that pass all five.

This module is pure Python: the planner never imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = [
    "AUTO",
    "COMPONENTS",
    "NAMED_PLANS",
    "check_plan_text",
    "Plan",
    "PlanError",
    "RULES",
    "Violation",
    "check_plan",
    "is_auto",
    "named_plan",
    "parse_plan",
    "resolve_plan",
    "rule_masks",
]

COMPONENTS = ("p", "g", "os")
RULES = ("positive", "dependency", "divisibility", "cross_node", "sg_choice")
STRUCTURAL_RULES = ("positive", "dependency", "divisibility")
NAMED_PLANS = ("ddp", "zero1", "zero2", "zero3", "mics:K")


class PlanError(ValueError):
    """A plan that cannot run on the given world. The message is one line naming the field."""


@dataclass(frozen=True, kw_only=True)
class Violation:
    rule: str  # one of RULES
    message: str  # one line, names the factor(s) at fault

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


@dataclass(frozen=True, kw_only=True, order=True)
class Plan:
    """Six sharding factors. ``order=True`` gives the deterministic tuple order used in ties."""

    s0_p: int = 1
    s1_p: int = 1
    s0_g: int = 1
    s1_g: int = 1
    s0_os: int = 1
    s1_os: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise PlanError(f"plan.{f.name} must be an integer >= 1, got {v!r}")
            if v < 1:
                raise PlanError(f"plan.{f.name} must be an integer >= 1, got {v}")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def sp(self) -> int:
        return self.s0_p * self.s1_p

    @property
    def sg(self) -> int:
        return self.s0_g * self.s1_g

    @property
    def sos(self) -> int:
        return self.s0_os * self.s1_os

    def mesh(self, component: str) -> tuple[int, int]:
        """``(s0, s1)`` of ``component`` in {"p", "g", "os"}."""
        if component not in COMPONENTS:
            raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
        return getattr(self, f"s0_{component}"), getattr(self, f"s1_{component}")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.s0_p, self.s1_p, self.s0_g, self.s1_g, self.s0_os, self.s1_os)

    # -- text form ---------------------------------------------------------------------------
    def __str__(self) -> str:
        return (
            f"p={self.s0_p}x{self.s1_p},g={self.s0_g}x{self.s1_g},"
            f"os={self.s0_os}x{self.s1_os}"
        )

    def fingerprint(self) -> str:
        """Short stable hash: ranks compare it at init to catch mismatched plans."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]

    # -- meshes the collectives run on (paper Sec. IV-C) --------------------------------------
    def replica_mesh(self, gpus_per_node: int, num_nodes: int) -> tuple[int, int]:
        """Mesh of the T0_os all-reduce: ranks holding the same parameter shard."""
        return gpus_per_node // self.s0_p, num_nodes // self.s1_p

    def grad_mesh(self) -> tuple[int, int]:
        """Mesh of the Tg all-reduce (non-last micro-batches, when sg > sp)."""
        return self.s0_g // self.s0_p, self.s1_g // self.s1_p

    def bcast_mesh(self) -> tuple[int, int]:
        """Mesh of the T1_os broadcasts of updated parameters."""
        return self.s0_os // self.s0_p, self.s1_os // self.s1_p


_PLAN_RE = re.compile(r"^\s*(p|g|os)\s*=\s*(\d+)\s*[x×*]\s*(\d+)\s*$")


def parse_plan(text: str) -> Plan:
    """Parse ``"p=2x1,g=2x1,os=2x2"`` (any order; a missing ``g`` defaults to ``p``)."""
    if not isinstance(text, str) or not text.strip():
        raise PlanError("plan must look like 'p=S0xS1,g=S0xS1,os=S0xS1', got an empty value")
    seen: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        m = _PLAN_RE.match(part)
        if not m:
            raise PlanError(
                f"plan: cannot read {part.strip()!r}; expected 'p=S0xS1,g=S0xS1,os=S0xS1' "
                f"or one of {', '.join(NAMED_PLANS)}"
            )
        comp, s0, s1 = m.group(1), int(m.group(2)), int(m.group(3))
        if comp in seen:
            raise PlanError(f"plan: component {comp!r} given twice in {text!r}")
        if s0 < 1 or s1 < 1:  # named as written, before Plan would name its field (s0_p)
            raise PlanError(f"plan: {part.strip()!r} in {text!r}: both factors of {comp}= must be "
                            f"integers >= 1 (S0 GPUs in a node x S1 nodes)")
        seen[comp] = (s0, s1)
    if "p" not in seen or "os" not in seen:
        raise PlanError(f"plan: both 'p=' and 'os=' are required, got {text!r}")
    g = seen.get("g", seen["p"])
    return Plan(
        s0_p=seen["p"][0], s1_p=seen["p"][1],
        s0_g=g[0], s1_g=g[1],
        s0_os=seen["os"][0], s1_os=seen["os"][1],
    )


def group_sizes(gpus_per_node: int, num_nodes: int) -> tuple[int, ...]:
    """Every group size :func:`mesh_of_size` lays out, ascending: the divisors of a node, then
    whole nodes in counts that divide the node count."""
    R, N = gpus_per_node, num_nodes
    return (*(d for d in range(1, R + 1) if R % d == 0), *(R * k for k in range(2, N + 1) if N % k == 0))


def mesh_of_size(size: int, gpus_per_node: int, num_nodes: int, field: str) -> tuple[int, int]:
    """Lay ``size`` GPUs out as a node-filling mesh (Eq. 7): inside one node when it fits."""
    world = gpus_per_node * num_nodes
    allowed = f"; allowed: {', '.join(map(str, group_sizes(gpus_per_node, num_nodes)))}"
    if size < 1 or size > world:
        raise PlanError(f"{field}: group size must be in 1..{world} (world size), got {size}{allowed}")
    if size <= gpus_per_node:
        if gpus_per_node % size:
            raise PlanError(
                f"{field}: group size {size} must divide gpus_per_node={gpus_per_node} "
                f"or be a multiple of it{allowed}"
            )
        return size, 1
    if size % gpus_per_node or num_nodes % (size // gpus_per_node):
        raise PlanError(
            f"{field}: group size {size} must be a multiple of gpus_per_node={gpus_per_node} "
            f"whose node count divides num_nodes={num_nodes}{allowed}"
        )
    return gpus_per_node, size // gpus_per_node


def named_plan(name: str, *, gpus_per_node: int, num_nodes: int, field: str = "plan") -> Plan:
    """The classic systems as AMSP plans: ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``mics:K``.

    ZeRO++ is not an AMSP plan (it keeps a second, smaller parameter mesh for the backward
    all-gather); the planner costs it as a baseline of its own.
    """
    R, N = gpus_per_node, num_nodes
    key = name.strip().lower()
    if key == "ddp":
        return Plan()
    if key == "zero1":
        return Plan(s0_os=R, s1_os=N)
    if key == "zero2":
        return Plan(s0_g=R, s1_g=N, s0_os=R, s1_os=N)
    if key == "zero3":
        return Plan(s0_p=R, s1_p=N, s0_g=R, s1_g=N, s0_os=R, s1_os=N)
    if key.startswith("mics"):
        _, _, k = key.partition(":")
        if not k.isdigit():
            raise PlanError(f"plan: 'mics' needs a shard group size, e.g. 'mics:{R}', got {name!r}")
        s0, s1 = mesh_of_size(int(k), R, N, f"{field} mics:{k}")  # named as the user wrote it
        return Plan(s0_p=s0, s1_p=s1, s0_g=s0, s1_g=s1, s0_os=s0, s1_os=s1)
    raise PlanError(
        f"plan: unknown name {name!r}; use one of {', '.join(NAMED_PLANS)}, 'auto', "
        f"or factors like 'p=2x1,g=2x1,os=2x2'"
    )


AUTO = "auto"  # the request the planner decides (amsp_ext/job.py [Note: one job, resolved once])


def is_auto(request: Any) -> bool:
    """Whether a plan, all-reduce or tensor-parallel request asks the planner to decide: the
    text "auto", in any case, surrounding spaces allowed. Every reader of a request asks this."""
    return isinstance(request, str) and request.strip().lower() == AUTO


def check_plan_text(text: str, field: str) -> None:
    """Refuse a misspelt plan in one line naming ``field`` before the world is known (so before
    any rank starts): 'auto', a baseline name or factors; ``resolve_plan`` fits it to the world."""
    low = text.strip().lower()
    if is_auto(low) or low in (n for n in NAMED_PLANS if n != "mics:K"):
        return
    if low.startswith("mics"):
        _, _, k = low.partition(":")
        if not k.isdigit() or int(k) < 1:
            raise PlanError(f"{field}: 'mics' needs a shard group size, e.g. 'mics:8', got {text!r}")
        return
    if "=" not in text:
        raise PlanError(f"{field} must be 'auto', a baseline name ({', '.join(NAMED_PLANS)}) or "
                        f"factors 'p=S0xS1,g=S0xS1,os=S0xS1', got {text!r}")
    try:
        parse_plan(text)
    except PlanError as e:
        raise PlanError(f"{field}: {str(e).removeprefix('plan: ')}") from None


def resolve_plan(spec: "Plan | str", *, gpus_per_node: int, num_nodes: int, field: str = "plan") -> Plan:
    """A Plan, a factor string or a baseline name -> Plan. ``auto`` is the planner's job.
    ``field``: what an error calls the plan (the flag or key it came from)."""
    if isinstance(spec, Plan):
        return spec
    if not isinstance(spec, str):
        raise PlanError(f"plan must be a Plan or a string, got {type(spec).__name__}")
    if is_auto(spec):
        raise PlanError("plan 'auto' must be resolved by the planner (amsp_ext.job.resolve)")
    if "=" in spec:
        return parse_plan(spec)
    return named_plan(spec, gpus_per_node=gpus_per_node, num_nodes=num_nodes, field=field)


# [Note: the plan rules, stated once]
# Each rule below is an expression over factor values built only from comparisons, ``%``, ``&``,
# ``|`` and ``^``, so it evaluates on Python ints (one plan: ``check_plan``, with a message per
# broken pair) and elementwise on broadcast NumPy arrays (every plan of a world at once:
# planner/prefilter.py) alike. ``rule_masks`` is the whole rule set; neither caller restates it.

def _axis_chains(f, R, N):
    """Per mesh axis: the chain s_p, s_g, s_os, s_dp with names, and its equation numbers."""
    return (
        ([("s0_p", f["s0_p"]), ("s0_g", f["s0_g"]), ("s0_os", f["s0_os"]), ("R", R)], "Eq. 3", "Eq. 5"),
        ([("s1_p", f["s1_p"]), ("s1_g", f["s1_g"]), ("s1_os", f["s1_os"]), ("N", N)], "Eq. 4", "Eq. 6"),
    )


def _breaks_dependency(lower, upper):
    return lower > upper


def _breaks_divisibility(lower, upper):
    return (lower <= upper) & (upper % lower != 0)


def _breaks_cross_node(s0, s1, R):
    return (s1 > 1) & (s0 != R)


def _breaks_sg_choice(f):
    g_is_p = (f["s0_g"] == f["s0_p"]) & (f["s1_g"] == f["s1_p"])
    g_is_os = (f["s0_g"] == f["s0_os"]) & (f["s1_g"] == f["s1_os"])
    return (g_is_p | g_is_os) ^ True


def rule_masks(f, R, N) -> dict:
    """Which of RULES (but ``positive``, Plan's own check) factors ``f`` break on R GPUs per node x
    N nodes. ``f`` maps ``s0_p`` ... ``s1_os`` to ints (-> bools) or broadcastable NumPy arrays
    (-> boolean arrays)."""
    dep = div = False
    for chain, _, _ in _axis_chains(f, R, N):
        for (_, a), (_, b) in zip(chain, chain[1:]):
            dep = dep | _breaks_dependency(a, b)
            div = div | _breaks_divisibility(a, b)
    cross = False
    for comp in COMPONENTS:
        cross = cross | _breaks_cross_node(f[f"s0_{comp}"], f[f"s1_{comp}"], R)
    return {"dependency": dep, "divisibility": div, "cross_node": cross,
            "sg_choice": _breaks_sg_choice(f)}


def _violations(plan: Plan, R: int, N: int) -> Iterator[Violation]:
    """``rule_masks`` for one plan, with a message naming the factors of every broken pair."""
    f = plan.as_dict()
    for chain, eq, _ in _axis_chains(f, R, N):
        for (na, a), (nb, b) in zip(chain, chain[1:]):
            if _breaks_dependency(a, b):
                yield Violation(
                    rule="dependency",
                    message=f"{na}={a} > {nb}={b}; needs s_p <= s_g <= s_os <= s_dp ({eq})",
                )
    for chain, _, eq in _axis_chains(f, R, N):
        for (na, a), (nb, b) in zip(chain, chain[1:]):
            if _breaks_divisibility(a, b):
                yield Violation(
                    rule="divisibility",
                    message=f"{na}={a} does not divide {nb}={b} ({eq}: groups must tile)",
                )
    for comp in COMPONENTS:
        s0, s1 = plan.mesh(comp)
        if _breaks_cross_node(s0, s1, R):
            yield Violation(
                rule="cross_node",
                message=f"s1_{comp}={s1} > 1 needs s0_{comp}=R={R}, got {s0} (Eq. 7)",
            )
    if _breaks_sg_choice(f):
        yield Violation(
            rule="sg_choice",
            message=(
                f"g={plan.s0_g}x{plan.s1_g} must equal p={plan.s0_p}x{plan.s1_p} "
                f"or os={plan.s0_os}x{plan.s1_os}"
            ),
        )


def check_plan(
    plan: Plan, *, gpus_per_node: int, num_nodes: int, structural_only: bool = False
) -> list[Violation]:
    """Every rule ``plan`` breaks on a world of ``num_nodes`` x ``gpus_per_node``.

    ``structural_only`` keeps the rules the engine needs and drops the search heuristics.
    """
    if gpus_per_node < 1:
        raise PlanError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if num_nodes < 1:
        raise PlanError(f"num_nodes must be >= 1, got {num_nodes}")
    found = list(_violations(plan, gpus_per_node, num_nodes))
    if structural_only:
        found = [v for v in found if v.rule in STRUCTURAL_RULES]
    return found


def validate_plan(
    plan: Plan, *, gpus_per_node: int, num_nodes: int, structural_only: bool = False
) -> Plan:
    """Raise PlanError (one line, first broken rule) or return ``plan``."""
    bad = check_plan(
        plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes, structural_only=structural_only
    )
    if bad:
        raise PlanError(
            f"plan {plan} does not fit {num_nodes} node(s) x {gpus_per_node} GPU(s): {bad[0]}"
        )
    return plan


__all__.append("validate_plan")
