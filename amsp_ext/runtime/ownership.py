"""Inter-tensor ownership of optimizer states (pure Python).

Each local tensor (a whole parameter when sp = 1, the whole local FSDP shard when sp > 1) is
owned by exactly one of the ``b = sos / sp`` ranks of its ``optim_bcast`` group: the owner keeps
its fp32 master and optimizer states, steps it and broadcasts the result.

[Note: ownership policies]
``greedy``: largest tensor first onto the least-loaded rank (ties: lower index), the paper's
"greedy balancing". Best balance, so the smallest peak of optimizer-state memory and of
per-rank step time; but the owners of consecutive tensors alternate, so few broadcasts coalesce
(param_sync.py) and the first forward pre-hooks wait on several ranks' broadcasts.
``blocks``: contiguous blocks in forward order, the partition that minimises the largest block
(InternEvo's layout). Each owner's tensors are one run, so its broadcasts pack into a few
bucket-sized items and a unit waits on one owner. The price is imbalance when tensors are
large relative to total / b (tiny models, large b): at most one tensor's size.
``auto`` (the default): ``blocks`` when its largest block is within BLOCKS_BALANCE (5%) of the
mean, else ``greedy``. Measured on 4 ranks (small-llama, bf16, os=4x1, ``engine_bench.py
ownership``, 3 runs): blocks with packed broadcasts took 0.18-0.19 s a step against 0.21-0.23 s
for greedy, and its broadcast waits 1-2 ms against 40-60 ms; 4 broadcasts a step against 32.
For LLaMA-7B the blocks imbalance is 1.5% at b = 8 and 6.8% at b = 16 (then greedy is used).

[Note: gradient keepers when sg > sp]
The Tg AllReduce of non-boundary micro-batches runs inside the gradient group
(``g = sg / sp`` ranks, a sub-group of the optim_bcast group). After it, one rank of each
gradient group keeps (accumulates) each tensor's reduced gradient, and the others drop it
("select & drop"): the keeper of tensor t in my gradient group is the rank whose position in the
gradient group equals the owner's position in the owner's gradient group. So the owner keeps
its own tensors, every gradient group keeps each tensor exactly once (its sum enters the final
replica AllReduce exactly once), and each rank keeps about 1/g of the gradients (2 Phi / sg).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["BLOCKS_BALANCE", "assign_blocks", "assign_greedy", "assign_owners", "load_per_owner"]

BLOCKS_BALANCE = 1.05  # "auto": the largest block may exceed the mean by this factor


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
    if policy == "auto":
        blocks = assign_blocks(numels, num_owners)
        load = load_per_owner(numels, blocks, num_owners)
        if max(load, default=0) <= BLOCKS_BALANCE * sum(numels) / num_owners:
            return blocks
        return assign_greedy(numels, num_owners)
    raise ValueError(f"ownership must be 'auto', 'greedy' or 'blocks', got {policy!r}")


def load_per_owner(numels: Sequence[int], owner: Sequence[int], num_owners: int) -> list[int]:
    load = [0] * num_owners
    for n, k in zip(numels, owner):
        load[k] += n
    return load
