"""Inter-tensor ownership of optimizer states (pure Python).

Each local tensor (a whole parameter when sp = 1, the whole local FSDP shard when sp > 1) is
owned by exactly one of the ``b = sos / sp`` ranks of its ``optim_bcast`` group: the owner keeps
its fp32 master and optimizer states, steps it and broadcasts the result.

[Note: two ownership policies]
``greedy``: largest tensor first onto the least-loaded rank (ties: lower index), the paper's
"greedy balancing". Best balance, so the smallest peak of optimizer-state memory and of
per-rank step time; broadcasts are issued in forward order anyway, but the owners of the first
units are scattered, so the first forward pre-hooks wait on several ranks' broadcasts.
``blocks``: contiguous blocks in forward order, cut where the running sum crosses k * total / b.
The first module's tensors all come from one owner, whose broadcasts are issued first; the
price is imbalance when tensors are large relative to total / b (tiny models, large b).
The default is chosen by measurement (see comparisons/ownership.py and the engine report).

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

__all__ = ["assign_blocks", "assign_greedy", "assign_owners", "load_per_owner"]


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


def assign_blocks(numels: Sequence[int], num_owners: int) -> list[int]:
    """Contiguous blocks in the given (forward) order, balanced by cumulative size."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    total = sum(numels)
    owner: list[int] = []
    k, acc, cur = 0, 0, 0  # current owner, cumulative numel, current owner's load
    for i, n in enumerate(numels):
        # Next owner when this tensor's midpoint lies past the k-th cut, or when every remaining
        # owner needs one of the remaining tensors; never leave the current owner empty.
        must_move = len(numels) - i <= num_owners - 1 - k
        if k < num_owners - 1 and cur > 0 and (acc + n / 2 > (k + 1) * total / num_owners or must_move):
            k, cur = k + 1, 0
        owner.append(k)
        acc += n
        cur += n
    return owner


def assign_owners(numels: Sequence[int], num_owners: int, policy: str) -> list[int]:
    if policy == "greedy":
        return assign_greedy(numels, num_owners)
    if policy == "blocks":
        return assign_blocks(numels, num_owners)
    raise ValueError(f"ownership must be 'greedy' or 'blocks', got {policy!r}")


def load_per_owner(numels: Sequence[int], owner: Sequence[int], num_owners: int) -> list[int]:
    load = [0] * num_owners
    for n, k in zip(numels, owner):
        load[k] += n
    return load
