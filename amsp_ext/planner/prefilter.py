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

The rule names and semantics are exactly ``amsp_ext.planner.plan.check_plan``'s (a property test
holds the two together); a rejection lists every rule the plan breaks.

Pure Python + NumPy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from amsp_ext.planner.plan import RULES, Plan

__all__ = ["Prefiltered", "divisors", "legal_plans", "prefilter"]

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


def _chain_masks(chains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dependency and divisibility bits of each (p, g, os) chain on one axis."""
    dep = np.zeros(len(chains), bool)
    div = np.zeros(len(chains), bool)
    for a, b in ((0, 1), (1, 2)):
        lo, hi = chains[:, a], chains[:, b]
        dep |= lo > hi
        div |= (lo <= hi) & (hi % lo != 0)
    return dep, div


def prefilter(gpus_per_node: int, num_nodes: int) -> Prefiltered:
    R, N = gpus_per_node, num_nodes
    ax0 = np.array(list(itertools.product(divisors(R), repeat=3)), dtype=np.int64)
    ax1 = np.array(list(itertools.product(divisors(N), repeat=3)), dtype=np.int64)
    dep0, div0 = _chain_masks(ax0)
    dep1, div1 = _chain_masks(ax1)
    mask = np.zeros((len(ax0), len(ax1)), dtype=np.int64)
    mask |= np.where(dep0[:, None] | dep1[None, :], _RULE_BITS["dependency"], 0)
    mask |= np.where(div0[:, None] | div1[None, :], _RULE_BITS["divisibility"], 0)
    cross = np.zeros(mask.shape, bool)
    for c in range(3):  # p, g, os
        cross |= (ax1[None, :, c] > 1) & (ax0[:, None, c] != R)
    mask |= np.where(cross, _RULE_BITS["cross_node"], 0)
    g_is_p = (ax0[:, None, 1] == ax0[:, None, 0]) & (ax1[None, :, 1] == ax1[None, :, 0])
    g_is_os = (ax0[:, None, 1] == ax0[:, None, 2]) & (ax1[None, :, 1] == ax1[None, :, 2])
    mask |= np.where(~(g_is_p | g_is_os), _RULE_BITS["sg_choice"], 0)
    accepted = [
        Plan(s0_p=int(ax0[i, 0]), s1_p=int(ax1[j, 0]), s0_g=int(ax0[i, 1]), s1_g=int(ax1[j, 1]),
             s0_os=int(ax0[i, 2]), s1_os=int(ax1[j, 2]))
        for i, j in zip(*np.nonzero(mask == 0))
    ]
    accepted.sort()
    return Prefiltered(gpus_per_node=R, num_nodes=N, accepted=tuple(accepted), _axis0=ax0,
                       _axis1=ax1, _mask=mask)


def legal_plans(gpus_per_node: int, num_nodes: int) -> Iterator[Plan]:
    """The plans ``prefilter`` accepts, generated directly (no rejections kept): every mesh that
    satisfies Eq. 7, paired so that p divides os on both axes, with g in {p, os}."""
    R, N = gpus_per_node, num_nodes
    meshes = [(d, 1) for d in divisors(R)] + [(R, d) for d in divisors(N) if d > 1]
    for p in meshes:
        for os_ in meshes:
            if os_[0] % p[0] or os_[1] % p[1]:  # (also rejects os < p: a % b = a > 0 then)
                continue
            for g in ((p,) if p == os_ else (p, os_)):
                yield Plan(s0_p=p[0], s1_p=p[1], s0_g=g[0], s1_g=g[1], s0_os=os_[0], s1_os=os_[1])
