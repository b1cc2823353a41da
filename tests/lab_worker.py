"""Rank program for the lab and collectives tests (run under torchrun / `amsp cluster run`).

    python -m torch.distributed.run ... tests/lab_worker.py collectives
    amsp cluster run -- tests/lab_worker.py lab
    amsp cluster run -- tests/lab_worker.py fail 3
    amsp cluster run -- tests/lab_worker.py hang 3

Every check compares with values computed by hand from the rank numbers, not with the code's own
output. Prints ``CHECK ok ...`` per rank; any mismatch raises (non-zero exit).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from amsp_ext.runtime import collectives as C  # noqa: E402


def _init(timeout_s: float = 60.0) -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def check_collectives() -> None:
    """All four ops on 2-rank subgroups {0,1},{2,3} and the world, against hand-made values."""
    rank, world = _init()
    assert world == 4, world
    pairs = [[0, 1], [2, 3]]
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    pair = pairs[rank // 2]
    name = f"test_pair[{pair[0]},{pair[1]}]"
    ctx, other = C.CollectiveContext(timeout=30), C.CollectiveContext(timeout=30)
    seen = []
    ctx.observers.append(lambda event, op, label, info: seen.append((event, op, label)))

    t = torch.full((6,), float(rank + 1))
    C.all_reduce(ctx, t, None, name="world", stream=None, async_op=False)
    assert torch.equal(t, torch.full((6,), 10.0)), t  # 1+2+3+4

    t = torch.full((4,), float(rank + 1))
    C.all_reduce(ctx, t, mine, name=name, stream=None, async_op=False)
    assert torch.equal(t, torch.full((4,), float(sum(r + 1 for r in pair)))), t

    shard = torch.tensor([10.0 * rank, 10.0 * rank + 1], dtype=torch.bfloat16)
    out = torch.empty(4, dtype=torch.bfloat16)
    C.all_gather_into_tensor(ctx, out, shard, mine, name=name, stream=None, async_op=False)
    want = torch.tensor([10.0 * pair[0], 10.0 * pair[0] + 1, 10.0 * pair[1], 10.0 * pair[1] + 1])
    assert torch.equal(out.float(), want), out

    inp = torch.arange(4, dtype=torch.float32) + 100 * rank  # [100r, 100r+1, 100r+2, 100r+3]
    out = torch.empty(2)
    C.reduce_scatter_tensor(ctx, out, inp, mine, name=name, stream=None, async_op=False)
    idx = pair.index(rank)
    want = torch.tensor([sum(100.0 * r + 2 * idx + k for r in pair) for k in range(2)])
    assert torch.equal(out, want), (out, want)

    b = torch.full((3,), float(rank))
    pending = C.broadcast(ctx, b, pair[0], mine, name=name, stream=None, async_op=True)
    C.wait(pending)
    assert torch.equal(b, torch.full((3,), float(pair[0]))), b

    # objects: JSON data in rank order; gather_objects only on dst
    got = C.all_gather_objects(ctx, {"rank": rank, "t": (rank, "x")}, None, name="world")
    assert got == [{"rank": r, "t": (r, "x")} for r in range(4)], got
    assert C.gather_objects(ctx, rank * 10, mine, name=name, dst=pair[0]) == (
        [pair[0] * 10, pair[1] * 10] if rank == pair[0] else None)

    # the context counted what went through it (hand count of the calls above: two all_gathers
    # per object gather) and saw it; the other context saw nothing
    assert dict(ctx.counts) == {("all_reduce", "world"): 1, ("all_reduce", "test_pair"): 1,
                                ("all_gather", "test_pair"): 3, ("reduce_scatter", "test_pair"): 1,
                                ("broadcast", "test_pair"): 1, ("all_gather", "world"): 2}, ctx.counts
    assert [e for e, _, _ in seen].count("issue") == 9 and seen[-1][0] == "wait_end", seen
    assert not other.counts and not other.observers, other

    # A collective one rank joins late: the other's wait must time out naming the group.
    t = torch.ones(2)
    if rank == 0:
        try:
            C.all_reduce(other, t, mine, name=name, stream=None, async_op=False, timeout=1.5)
        except C.CollectiveTimeout as e:
            assert name in str(e) and "all_reduce" in str(e), str(e)
            print(f"CHECK timeout-named rank={rank}: {str(e)[:80]}", flush=True)
        else:
            raise AssertionError("rank 0's all_reduce should have timed out")
    else:
        if rank == 1:
            time.sleep(4)
        C.all_reduce(other, t, mine, name=name, stream=None, async_op=False)
    print(f"CHECK ok collectives rank={rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def check_lab() -> None:
    """On the lab: ranks sit in their node's namespace, and an all-reduce crosses the link."""
    rank, world = _init()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["AMSP_CLUSTER_NODE"])
    assert rank // local_world == node, (rank, local_world, node)  # static rendezvous order
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    assert Path(f"/sys/class/net/{ifname}").exists(), f"{ifname} missing: not inside a lab namespace"
    t = torch.full((1 << 20,), float(rank + 1))  # 4 MiB
    C.all_reduce(C.CollectiveContext(timeout=60), t, None, name="world", stream=None, async_op=False)
    want = world * (world + 1) / 2
    assert torch.all(t == want), (t[:4], want)
    print(f"CHECK ok lab rank={rank} node={node} sum={t[0].item():g}", flush=True)
    dist.destroy_process_group()


def fail(bad_rank: int) -> None:
    """Rank ``bad_rank`` exits 3; the others wait in a collective it never joins."""
    rank, _ = _init(timeout_s=600)
    if rank == bad_rank:
        print(f"CHECK failing on purpose rank={rank}", flush=True)
        sys.exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # hangs until the launcher stops it
    dist.destroy_process_group()


def hang(stuck_rank: int) -> None:
    """Rank ``stuck_rank`` never reaches the collective; only the launcher's timeout ends the job."""
    rank, _ = _init(timeout_s=600)
    if rank == stuck_rank:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "collectives":
        check_collectives()
    elif what == "lab":
        check_lab()
    elif what == "fail":
        fail(int(sys.argv[2]))
    elif what == "hang":
        hang(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown check {what!r}")
