"""Inter-tensor ownership of optimizer states (pure Python).

Each local tensor (a whole parameter when sp = 1, the whole local FSDP shard when sp > 1) is
owned by exactly one of the ``b = sos / sp`` ranks of its ``optim_bcast`` group: the owner keeps
its fp32 master and optimizer states, steps it and broadcasts the result.

[Note: ownership policies]
``greedy`` (the default): largest tensor first onto the least-loaded rank (ties: lower index),
the paper's "greedy balancing". Best balance, so the smallest peak of optimizer-state memory and
of per-rank step time.
``blocks``: contiguous blocks in forward order, the partition that minimises the largest block
(InternEvo's layout), so a unit's tensors have one owner and its pre-hook waits on one rank. The
price is imbalance when tensors are large relative to total / b: at most one tensor's size
(LLaMA-7B: 1.5% at b = 8, 6.8% at b = 16; tiny models far more).
Measured on 4 ranks (small-llama, bf16, os=4x1, ``engine_bench.py ownership``, 3 runs of 3x8
steps): with packed broadcasts (param_sync.py) both send 4 broadcasts a step and greedy's median
step was 0.139-0.160 s against 0.152-0.161 s for blocks, so greedy stays the default. Every
broadcast is issued right after the step, so which rank owns a unit does not delay its wait.

[Note: gradient keepers when sg > sp]
The Tg AllReduce of non-boundary micro-batches runs inside the gradient group
(``g = sg / sp`` ranks, a sub-group of the optim_bcast group). After it, one rank of each
gradient group keeps (accumulates) each tensor's reduced gradient, and the others drop it
("select & drop"): the keeper of tensor t in my gradient group is the rank whose position in the
gradient group equals the owner's position in the owner's gradient group. So the owner keeps
its own tensors, every gradient group keeps each tensor exactly once (its sum enters the final
replica AllReduce exactly once), and each rank keeps about 1/g of the gradients (2 Phi / sg).

[Note: owners balanced by the optimizer's work]
An elementwise optimizer's step costs about the same per element, so balancing bytes balances
the step too. A whole-tensor optimizer's does not: Muon's Newton-Schulz on an m x n matrix costs
about m*n*min(m, n) flops (``step_cost``): min(m, n) per element, so a 4096 x 4096 matrix
costs 4x a 1024 x 4096 one (a grouped-query key projection) per element, and a byte balance can
put the square matrices on one owner, whose step then sets everyone's (the broadcast waits for
it). So whole-tensor owners are
balanced by ``step_cost`` (``assign_by_cost``: greedy, the costliest tensor first onto the
owner with the least work), under a byte cap that keeps the memory bound the planner charges
(planner/memory.py [Note: whole-tensor optimizers]): no owner takes a tensor that would bring
its bytes above total/b + the largest tensor. The cap never leaves a tensor without an owner:
before a tensor of n elements is placed the others hold at most total - n, so the least-loaded
owner holds at most (total - n)/b <= total/b, and adding n <= largest stays under the cap.
The cost is the optimizer's per tensor (optim/kinds.py ``tensor_costs``): Muon's groups and
unknown whole-tensor optimizers pay the matrix cost, Adafactor and AdamW's groups the element
count (their work is linear), for which the cost balance is the byte balance again. The
``blocks`` policy stays a byte balance: its point is one owner per unit, not the step's work.
"""

from __future__ import annotations

import math
from typing import Sequence

from amsp_ext.choices import OWNERSHIPS, check_one_of

__all__ = ["assign_blocks", "assign_by_cost", "assign_greedy", "assign_owners", "load_per_owner", "step_cost"]


def step_cost(shape: Sequence[int], matrix: bool = True) -> int:
    """The optimizer's work on one tensor ([Note: owners balanced by the optimizer's work]):
    m*n*min(m, n) for a matrix (flattened past dim 0) when ``matrix``, else the element count
    (at least 1, so an empty tensor still counts as one)."""
    n = math.prod(shape)
    if not matrix or len(shape) < 2 or n == 0:
        return max(n, 1)
    m = shape[0]
    k = n // m
    return m * k * min(m, k)


def assign_by_cost(costs: Sequence[int], numels: Sequence[int], num_owners: int) -> list[int]:
    """Greedy on ``costs`` (costliest first onto the owner with the least cost; ties: the
    lower index) among the owners whose bytes stay within sum(numels)/b + max(numels)
    ([Note: owners balanced by the optimizer's work])."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    if len(costs) != len(numels):
        raise ValueError(f"costs has {len(costs)} entries, numels {len(numels)}")
    b = num_owners
    cap_b = sum(numels) + b * max(numels, default=0)  # the cap times b, to stay in integers
    work, held = [0] * b, [0] * b
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -numels[i], i)):
        fits = [k for k in range(b) if b * (held[k] + numels[i]) <= cap_b]
        k = min(fits, key=lambda k: (work[k], k))  # never empty: see the Note
        owner[i] = k
        work[k] += costs[i]
        held[k] += numels[i]
    return owner


def assign_greedy(numels: Sequence[int], num_owners: int) -> list[int]:
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    load = [0] * num_owners
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        k = min(range(num_owners), key=lambda k: (load[k], k))
        owner[i] = k
        load[k] += numels[i]
    return owner


def _num_blocks(numels: Sequence[int], cap: int) -> int:
    """Blocks a left-to-right fill needs when no block may hold more than ``cap``."""
    count, cur = 1, 0
    for n in numels:
        if cur + n > cap and cur > 0:
            count, cur = count + 1, 0
        cur += n
    return count


def assign_blocks(numels: Sequence[int], num_owners: int) -> list[int]:
    """Contiguous blocks in the given (forward) order that minimise the largest block."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    if not numels:
        return []
    # The smallest feasible cap, by bisection: a left-to-right fill is optimal for a given cap
    # (the linear partition problem), so the answer is exact, in O(n log sum).
    lo, hi = max(numels), max(sum(numels), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if _num_blocks(numels, mid) <= num_owners:
            hi = mid
        else:
            lo = mid + 1
    owner: list[int] = []
    k, cur = 0, 0
    for i, n in enumerate(numels):
        # Move on when the cap would be passed, or when every remaining owner needs one of the
        # remaining tensors (splitting a block never raises the largest one).
        must_move = len(numels) - i <= num_owners - 1 - k
        if k < num_owners - 1 and cur > 0 and (cur + n > lo or must_move):
            k, cur = k + 1, 0
        owner.append(k)
        cur += n
    return owner


def assign_owners(numels: Sequence[int], num_owners: int, policy: str) -> list[int]:
    if policy == "greedy":
        return assign_greedy(numels, num_owners)
    if policy == "blocks":
        return assign_blocks(numels, num_owners)
    check_one_of(policy, OWNERSHIPS, "ownership")
    raise AssertionError(f"policy {policy!r} is in OWNERSHIPS but has no assignment here")


def load_per_owner(numels: Sequence[int], owner: Sequence[int], num_owners: int) -> list[int]:
    load = [0] * num_owners
    for n, k in zip(numels, owner):
        load[k] += n
    return load
