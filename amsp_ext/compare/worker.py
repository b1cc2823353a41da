"""One system, one run: the torchrun-able worker of ``amsp compare``.

    python -m torch.distributed.run --nproc-per-node 4 -m amsp_ext.compare.worker \
        --spec spec.json --system zero3 --out DIR
    amsp cluster run -- -m amsp_ext.compare.worker --spec spec.json --system zero3 --out DIR

Every rank: init gloo (CPU), measure the MFU peak (metrics.device_peak: every rank at once),
build the same model, hand it to the system's runner, train ``num_steps`` steps timing each,
profile one more step, measure memory, then all ranks' records are gathered and rank 0 writes
``DIR/result.json``. A rank that fails writes ``DIR/error-rank<r>.json`` (reason on one line,
traceback) and exits 1, so the launcher can put the reason in the row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

__all__ = ["main"]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "accelerate"):
        try:  # metadata, not import: importing DeepSpeed takes seconds
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # pragma: no cover - optional
            out[name] = "not installed"
    return out


def _warm_process(ctx) -> None:
    """One forward/backward of a throwaway model, before the memory baseline.

    Process-wide lazy state (autograd worker threads, oneDNN kernels and their caches, allocator
    arenas) is created on first use and never freed; without this it would land in the first
    system-specific figure and swamp a tiny model's footprint.
    """
    from amsp_ext.common.models import build_llama, causal_lm_loss

    model = build_llama(ctx.spec.model, seed=ctx.spec.seed + 1)
    with ctx.autocast():
        loss = causal_lm_loss(model, ctx.batches(0)[0])
    loss.backward()
    del model, loss


def _profiled_steps(sysrun, spec, rank: int, out: Path) -> tuple[dict, dict | None]:
    """1 + ``spec.trace_steps`` more steps under torch.profiler: of the steps after the first
    (each read with its predecessor's post-step broadcasts, breakdown.py [Note: one step's
    breakdown]), the breakdown and the old per-kind figures of the one whose exposed time is
    the median (breakdown.py [Note: the median profiled step]). Rank 0 also writes its Chrome
    trace."""
    from torch.profiler import ProfilerActivity, profile

    from amsp_ext.compare import breakdown, trace
    from amsp_ext.compare.systems.base import phase

    # [Note: no collective in flight across a profiler boundary]
    # On CPU/gloo, starting or stopping torch.profiler while a collective runs on a process
    # group's worker thread corrupts memory: with AMSP's two-level all-reduce, os = 2x1, the
    # ranks died of SIGSEGV, std::bad_alloc or "InvalidTag" in _disable_profiler in 6 of 6
    # 4-rank runs of 4 profiled steps; with the step's post-step broadcasts waited for before
    # the profiler stopped, in 0 of 3 (and in 0 of 2 runs of 10 steps without the profiler).
    # So the step's own broadcasts are drained inside the profile, after the last
    # ``phase::step`` (outside what breakdown.py reads), and the timed steps' before it starts.
    sysrun.drain()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for extra in range(1 + spec.trace_steps):
            with phase("step"):
                sysrun.train_step(spec.num_steps + extra)
        sysrun.drain()
    events = prof.events()
    steps_breakdown, step = breakdown.median_step(events)
    lo, hi = step.time_range.start, step.time_range.end
    comm = trace.comm_breakdown([e for e in events if e.time_range.end > lo and e.time_range.start < hi])
    if rank != 0:
        steps_breakdown.pop("timeline")  # rank 0's is plotted
    if rank == 0:
        prof.export_chrome_trace(str(out / "trace-rank0.json"))
    return comm, steps_breakdown


# Replays of the profiled step's collectives (compare/limit.py [Note: a row's limit]): the
# row's comm_only_s is their median, each replay's time the slowest rank's.
COMM_REPLAYS = 3


def _comm_alone(sysrun, step: int, coll) -> list[dict]:
    """One more step with its collectives recorded, then those collectives replayed alone
    ``COMM_REPLAYS`` times (runtime/collectives.py [Note: a step's collectives replayed
    alone]): this rank's time, count and bytes of each replay."""
    from amsp_ext.runtime import collectives as C

    sysrun.drain()
    with C.recording_collectives() as ops:
        sysrun.train_step(step)
        sysrun.drain()
    return [C.replay_alone(coll, ops, name="world") for _ in range(COMM_REPLAYS)]


def _timed_steps(sysrun, ctx, system: str) -> dict[str, list]:
    """The ``spec.num_steps`` timed steps: per step this rank's loss, wall time, CPU times and
    its last micro-batch's backward (``ctx.spans``; compare/limit.py)."""
    from amsp_ext.common.faults import faults, hang_now
    from amsp_ext.compare import cpu

    fs = faults()  # test-only fault injection (AMSP_FAULTS; never set in normal runs)
    out: dict[str, list] = {"loss": [], "step_s": [], "cpu_s": [], "last_backward_s": []}
    for step in range(ctx.spec.num_steps):
        hang_now(fs, rank=ctx.rank, step=step, system=system)
        cpu0 = cpu.thread_cpu_s()  # compare/cpu.py [Note: CPU time beside wall time]
        ctx.spans.clear()
        t = time.perf_counter()
        out["loss"].append(sysrun.train_step(step))
        out["step_s"].append(time.perf_counter() - t)
        out["cpu_s"].append(cpu.step_cpu(cpu0, cpu.thread_cpu_s()))
        backward = [b - a for name, a, b in ctx.spans if name == "backward"]
        out["last_backward_s"].append(backward[-1] if backward else None)
    return out


def _finite_fake_broadcasts() -> None:
    """The fake group's broadcast leaves a receiver's tensor as it was: a buffer allocated for
    it (AMSP's packed post-step broadcasts) holds whatever memory it got, and the parameters
    unpacked from it went non-finite (the engine stopped the run after 3 such steps). A
    compute-only run (compare/limit.py) zeroes what a receiver gets instead: finite, and the
    same work for every op that reads it."""
    import torch.distributed as dist

    original = dist.broadcast

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        work = original(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
        me = dist.get_rank() if group_src is None else dist.get_rank(group)
        if me != (src if group_src is None else group_src):
            tensor.zero_()
        return work

    dist.broadcast = broadcast


def run(system: str, spec, out: Path, coll, *, compute_only: bool = False) -> dict:
    """One system on this rank; ``coll``: this worker's collective context (the peak's and the
    records' collectives; an AMSP engine makes its own). ``compute_only``: the process group
    is the fake backend (compare/limit.py [Note: a row's limit]): only the timed steps run, and
    this rank's record is returned, not gathered."""
    import torch
    import torch.distributed as dist

    from amsp_ext.compare import memory
    from amsp_ext.runtime.measure.peak import device_peak
    from amsp_ext.runtime import collectives as C
    from amsp_ext.compare.config import resolve_topology
    from amsp_ext.compare.systems import SYSTEMS, runner
    from amsp_ext.compare.systems.base import Context
    from amsp_ext.common.models import build_llama

    info = SYSTEMS[system]
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    num_nodes, gpus_per_node = resolve_topology(spec, world_size=world, local_world_size=local_world)
    ctx = Context(spec=spec, rank=rank, world_size=world, num_nodes=num_nodes,
                  gpus_per_node=gpus_per_node, compute_only=compute_only, spans=[])
    patches_applied: dict[str, str] = {}
    if info.uses_deepspeed:
        from amsp_ext.integrations import patches

        patches_applied = patches.apply_needed()

    # the MFU denominator: common/metrics.py [Note: one MFU] (every rank at once, best of trials)
    peak_flops = None if compute_only else device_peak(torch.device("cpu"), ctx.param_dtype, comm=coll).flops

    _warm_process(ctx)
    live0 = memory.live_tensor_bytes()
    rss0 = memory.rss_bytes()
    hwm_reset = memory.reset_peak_rss()
    model = build_llama(spec.model, seed=spec.seed)
    t_setup = time.perf_counter()
    sysrun = runner(system).setup(system, model, ctx)
    setup_s = time.perf_counter() - t_setup

    timed = _timed_steps(sysrun, ctx, system)
    if compute_only:
        return {"rank": rank, "backend": dist.get_backend(), **timed}
    comm, steps_breakdown = _profiled_steps(sysrun, spec, rank, out) if spec.trace else (None, None)
    # memory before the replay: its fresh buffers, all in flight at once, are not the row's
    peak_rss_delta = (memory.peak_rss_bytes() - rss0) if hwm_reset and rss0 else None
    live_delta = memory.live_tensor_bytes() - live0
    comm_alone = _comm_alone(sysrun, spec.num_steps + 1 + spec.trace_steps, coll) if spec.trace else None

    record = {
        "rank": rank,
        "loss": timed["loss"],
        "step_s": timed["step_s"],
        "cpu_s": timed["cpu_s"],
        "setup_s": setup_s,
        "peak_flops": peak_flops,
        "peak_rss_delta_bytes": peak_rss_delta,
        "live_tensor_delta_bytes": live_delta,
        "comm": comm,
        "breakdown": steps_breakdown,
        "comm_alone": comm_alone,
    }
    records = C.gather_objects(coll, record, dist.group.WORLD, name="world")  # rank 0 writes the row
    return {
        "system": system,
        "label": info.label,
        "status": "ok",
        "world_size": world,
        "num_nodes": num_nodes,
        "gpus_per_node": gpus_per_node,
        "settings": sysrun.settings,
        "mixed_precision": sysrun.mixed_precision,
        "patches": patches_applied,
        "ranks": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amsp_ext.compare.worker")
    p.add_argument("--spec", required=True, help="RunSpec JSON file")
    p.add_argument("--system", required=True)
    p.add_argument("--out", required=True, help="directory for result.json / error-rank*.json")
    p.add_argument("--compute-only", action="store_true",
                   help="the fake process group: the steps with the communication taken out; each "
                        "rank writes compute-rank<r>.json (compare/limit.py [Note: a row's limit])")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        import torch
        import torch.distributed as dist

        from amsp_ext.compare.config import RunSpec
        from amsp_ext.runtime import collectives as C

        spec = RunSpec.from_json(Path(args.spec).read_text())
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # [Note: CPU only] The runners place models on CPU (FSDP meshes, autocast, DeepSpeed's
        # CPU accelerator); a GPU path needs per-rank devices and NCCL and is not built yet.
        backend = "fake" if args.compute_only else "gloo"
        if args.compute_only:
            from amsp_ext.runtime._torch_compat import fake_store

            dist.init_process_group(backend, store=fake_store(), rank=rank,
                                    world_size=int(os.environ["WORLD_SIZE"]))
            _finite_fake_broadcasts()
        else:
            from amsp_ext.tools.rendezvous import init_process_group

            init_process_group(backend, timeout=datetime.timedelta(seconds=spec.dist_timeout_s))
        coll = C.CollectiveContext(timeout=spec.dist_timeout_s)
        result = run(args.system, spec, out, coll, compute_only=args.compute_only)
        if args.compute_only:  # no real collective: each rank's record, merged by the launcher
            _write_json(out / f"compute-rank{rank}.json", result)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if dist.get_rank() == 0:
            result["backend"] = backend
            result["versions"] = _versions()
            result["cluster_link"] = json.loads(os.environ.get("AMSP_CLUSTER_LINK", "null"))
            _write_json(out / "result.json", result)
        C.barrier(coll, dist.group.WORLD, name="world")
        dist.destroy_process_group()
        # [Note: exit without interpreter teardown] About one run in three, a rank that had
        # finished cleanly aborted in interpreter teardown ("terminate called without an active
        # exception", SIGABRT; runtime/collectives.py [Note: process groups torn down at exit]
        # has the cause); torchrun then failed the whole job after result.json was written.
        # Everything this process owes is on disk and every rank has passed the barrier, so
        # skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the row
        from amsp_ext.compare.systems.base import SystemUnavailable

        status = e.status if isinstance(e, SystemUnavailable) else "failed"
        reason = e.reason if isinstance(e, SystemUnavailable) else _first_line(e)
        _write_json(out / f"error-rank{rank}.json", {
            "rank": rank, "status": status, "reason": reason, "time": time.time(),
            "traceback": traceback.format_exc(),
        })
        print(f"[rank {rank}] {status}: {reason}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # peers may sit in a collective; torchrun stops them


if __name__ == "__main__":
    sys.exit(main())
