"""The planner's pre-filter (paper Sec. IV-E): which six-factor plans are worth costing.

[Note: the universe the pre-filter sees]
Every factor is drawn from the divisors of its axis: s0 from the divisors of R (GPUs per node),
s1 from the divisors of N (nodes). A factor that does not divide its axis can never tile it, so
those plans are not enumerated at all; everything else (|div R|^3 x |div N|^3 plans, 175,616 at
8192 nodes x 8 GPUs) is checked against the paper's rules, vectorised with NumPy:

* ``dependency`` (Eq. 3-4): s_p <= s_g <= s_os on each axis;
* ``divisibility`` (Eq. 5-6): each factor divides the next one up on its axis;
* ``cross_node`` (Eq. 7): a component spanning nodes (s1 > 1) uses whole nodes (s0 = R);
* ``sg_choice``: the gradient mesh equals the parameter mesh or the optimizer-state mesh.

The rules are ``amsp_ext.planner.plan.rule_masks``, evaluated here on broadcast arrays (one row
per s0 chain, one column per s1 chain) and there on one plan by ``check_plan``: the same
expressions, so the two cannot drift (tests/test_plan_rules.py checks them plan by plan). A
rejection lists every rule the plan breaks.

Pure Python + NumPy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from amsp_ext.planner.plan import COMPONENTS, RULES, Plan, rule_masks

__all__ = ["Prefiltered", "divisors", "legal_plans", "prefilter", "priced_meshes"]

_RULE_BITS = {rule: 1 << i for i, rule in enumerate(RULES)}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class Prefiltered:
    """Accepted plans (in factor-tuple order) and the rule bitmask of every rejected one."""

    gpus_per_node: int
    num_nodes: int
    accepted: tuple[Plan, ...]
    _axis0: np.ndarray  # (n0, 3) chains (s0_p, s0_g, s0_os)
    _axis1: np.ndarray  # (n1, 3)
    _mask: np.ndarray  # (n0, n1) rule bitmask, 0 = accepted

    @property
    def num_considered(self) -> int:
        return int(self._mask.size)

    def rejected_by_rule(self) -> dict[str, int]:
        """How many plans break each rule (a plan breaking two rules counts under both)."""
        return {rule: int(np.count_nonzero(self._mask & bit)) for rule, bit in _RULE_BITS.items()
                if rule != "positive"}

    def rejected(self) -> Iterator[tuple[Plan, tuple[str, ...]]]:
        """Every rejected plan with the rules it breaks."""
        for i, j in zip(*np.nonzero(self._mask)):
            a, b = self._axis0[i], self._axis1[j]
            bits = int(self._mask[i, j])
            plan = Plan(s0_p=int(a[0]), s1_p=int(b[0]), s0_g=int(a[1]), s1_g=int(b[1]),
                        s0_os=int(a[2]), s1_os=int(b[2]))
            yield plan, tuple(r for r, bit in _RULE_BITS.items() if bits & bit)


def prefilter(gpus_per_node: int, num_nodes: int) -> Prefiltered:
    R, N = gpus_per_node, num_nodes
    ax0 = np.array(list(itertools.product(divisors(R), repeat=3)), dtype=np.int64)
    ax1 = np.array(list(itertools.product(divisors(N), repeat=3)), dtype=np.int64)
    factors = {f"s0_{c}": ax0[:, None, k] for k, c in enumerate(COMPONENTS)}
    factors |= {f"s1_{c}": ax1[None, :, k] for k, c in enumerate(COMPONENTS)}
    mask = np.zeros((len(ax0), len(ax1)), dtype=np.int64)
    for rule, broken in rule_masks(factors, R, N).items():
        mask |= np.where(broken, _RULE_BITS[rule], 0)
    accepted = [
        Plan(s0_p=int(ax0[i, 0]), s1_p=int(ax1[j, 0]), s0_g=int(ax0[i, 1]), s1_g=int(ax1[j, 1]),
             s0_os=int(ax0[i, 2]), s1_os=int(ax1[j, 2]))
        for i, j in zip(*np.nonzero(mask == 0))
    ]
    accepted.sort()
    return Prefiltered(gpus_per_node=R, num_nodes=N, accepted=tuple(accepted), _axis0=ax0,
                       _axis1=ax1, _mask=mask)


def legal_plans(gpus_per_node: int, num_nodes: int) -> Iterator[Plan]:
    """The plans ``prefilter`` accepts, without building the rejected ones: the same rules
    (``rule_masks``) checked on the few plans that ``cross_node`` and ``sg_choice`` leave
    possible, i.e. every component on a mesh that is inside a node or spans whole nodes, and
    g equal to p or os. Cheap at any N (``search`` sizes larger clusters with it)."""
    R, N = gpus_per_node, num_nodes
    meshes = [(d, 1) for d in divisors(R)] + [(R, d) for d in divisors(N) if d > 1]
    for p in meshes:
        for os_ in meshes:
            for g in dict.fromkeys((p, os_)):
                f = {"s0_p": p[0], "s1_p": p[1], "s0_g": g[0], "s1_g": g[1],
                     "s0_os": os_[0], "s1_os": os_[1]}
                if not any(rule_masks(f, R, N).values()):
                    yield Plan(**f)


def priced_meshes(gpus_per_node: int, num_nodes: int) -> dict[str, set[tuple[int, int]]]:
    """Per collective, the meshes of more than one GPU the planner prices for some plan the
    pre-filter keeps (cost.py's four terms, a two-level all-reduce's three phases, the world
    broadcast and all-gather of adaptive.py and simulate.py): what a profile measured for
    ``auto`` needs (runtime/measure/cluster.py), and no more."""
    R, N = gpus_per_node, num_nodes
    shard = {(d, 1) for d in divisors(R)} | {(R, d) for d in divisors(N)}  # Eq. 7's meshes
    out: dict[str, set[tuple[int, int]]] = {"allgather": set(shard), "reducescatter": set(shard),
                                            "allreduce": set(), "broadcast": {(R, N)}}
    for plan in legal_plans(R, N):
        for p0, p1 in (plan.replica_mesh(R, N), plan.grad_mesh()):
            out["allreduce"].add((p0, p1))
            if p0 > 1 and p1 > 1:  # runs two-level under all_reduce "two_level"/"auto"
                out["reducescatter"].add((p0, 1))
                out["allgather"].add((p0, 1))
                out["allreduce"].add((1, p1))
        out["broadcast"].add(plan.bcast_mesh())
    return {op: {m for m in meshes if m[0] * m[1] > 1} for op, meshes in out.items()}
