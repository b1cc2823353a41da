"""The measurement loop of ``amsp profile``: times each (op, mesh, size) with all groups at once.

Run by every rank (torchrun or ``amsp cluster run``). What is measured and why is in
:mod:`amsp_ext.runtime.measure.profile_cases`; every collective goes through
:mod:`amsp_ext.runtime.collectives`. The same code serves NCCL (one GPU per local rank) and gloo
(CPU tensors); only the device differs.

[Note: timing]
Each repetition: a world-wide barrier (a one-element all-reduce), then every rank runs the
collective on its own group and stops its clock when the collective is complete on its side
(``Work.wait`` plus a device synchronize on GPUs). The repetition's time is the largest over all
ranks (one all-reduce MAX of the per-rank times at the end, so the timed region holds no extra
traffic). Warm-up repetitions pay for connection set-up and allocator growth and are dropped.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.measure.profile_cases import (
    Case,
    Measurement,
    ProfileConfig,
    ProfileError,
    buffer_numel,
    cases,
    message_sizes,
)
from amsp_ext.topology.groups import World, group_of

__all__ = ["measure", "pick_device"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ProfileError("backend 'nccl' needs CUDA GPUs; use --backend gloo on CPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class _Groups:
    """Process groups for each distinct layout, created once, in the same order on every rank."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Optional[dist.ProcessGroup]] = {}

    def get(self, layout: tuple[tuple[int, ...], ...]) -> Optional[dist.ProcessGroup]:
        if layout not in self._cache:
            if len(layout) == 1 and len(layout[0]) == dist.get_world_size():
                self._cache[layout] = None  # the default group
            else:
                mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in layout])
                self._cache[layout] = mine
        return self._cache[layout]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(comm: C.CollectiveContext, case: Case, numel: int, group, name: str, src: int, dtype,
                device, timeout: float) -> Callable[[], None]:
    """A closure running ``case.op`` once on preallocated buffers of ``numel`` elements (v):
    blocking, on the current stream (the loop synchronizes the device after it)."""
    n = case.size
    kw = dict(name=name, stream=None, async_op=False, timeout=timeout)
    if case.op == "allreduce":
        buf = torch.zeros(numel, dtype=dtype, device=device)
        return lambda: C.all_reduce(comm, buf, group, **kw)
    if case.op == "broadcast":
        buf = torch.zeros(numel, dtype=dtype, device=device)
        return lambda: C.broadcast(comm, buf, src, group, **kw)
    if case.op == "allgather":
        out = torch.empty(numel, dtype=dtype, device=device)
        shard = torch.zeros(numel // n, dtype=dtype, device=device)
        return lambda: C.all_gather_into_tensor(comm, out, shard, group, **kw)
    if case.op == "reducescatter":
        inp = torch.zeros(numel, dtype=dtype, device=device)
        out = torch.empty(numel // n, dtype=dtype, device=device)
        return lambda: C.reduce_scatter_tensor(comm, out, inp, group, **kw)
    raise ProfileError(f"op must be one of allreduce, allgather, reducescatter, broadcast, got {case.op!r}")


def measure(config: ProfileConfig, world: World, device: torch.device, *,
            comm: C.CollectiveContext, progress: bool = False) -> list[Measurement]:
    """Every rank calls this with the same arguments; returns the same list on every rank.
    ``comm``: the collective context every measured collective goes through."""
    if dist.get_world_size() != world.size:
        raise ProfileError(
            f"world size {dist.get_world_size()} != nodes x gpus_per_node = "
            f"{world.num_nodes} x {world.gpus_per_node}"
        )
    todo = cases(world, config)
    if not todo:
        raise ProfileError(f"nothing to measure on a world of {world.size} rank(s); run at least 2 ranks")
    sizes = message_sizes(config)
    dtype = _DTYPES[config.dtype]
    rank = dist.get_rank()
    groups = _Groups()
    flag = torch.zeros(1, device=device)

    def barrier() -> None:
        C.all_reduce(comm, flag, None, name="profile_world", stream=None, async_op=False,
                     timeout=config.timeout_s)
        _sync(device)

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(todo) * len(sizes), desc="amsp profile", unit="point", file=sys.stderr,
                   mininterval=1.0 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)
    out: list[Measurement] = []
    try:
        for case in todo:
            group = groups.get(case.groups)
            mine = group_of(rank, case.groups)
            name = f"profile_{case.kind}[{','.join(map(str, mine))}]"
            m = Measurement(op=case.op, p0=case.p0, p1=case.p1)
            for nbytes in sizes:
                numel, moved = buffer_numel(case.op, nbytes, case.size, config.element_size)
                run_once = _collective(comm, case, numel, group, name, mine[0], dtype, device,
                                       config.timeout_s)
                times = []
                for rep in range(config.num_warmup + config.num_reps):
                    barrier()
                    t0 = time.perf_counter()
                    run_once()
                    _sync(device)
                    if rep >= config.num_warmup:
                        times.append(time.perf_counter() - t0)
                slowest = torch.tensor(times, dtype=torch.float64, device=device)
                C.all_reduce(comm, slowest, None, name="profile_world", stream=None, op=dist.ReduceOp.MAX,
                             async_op=False, timeout=config.timeout_s)
                m.points.append((moved, statistics.median(slowest.cpu().tolist())))
                del run_once
                if bar is not None:
                    bar.set_description(f"{case.label} {moved / 2**20:g}MiB", refresh=False)
                    bar.update(1)
            out.append(m)
    finally:
        if bar is not None:
            bar.close()
    return out
