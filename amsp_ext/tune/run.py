"""``amsp tune`` on every rank, top to bottom: peak, candidates, rounds, gather; then on rank 0
the analysis, the report, the calibration and the winner."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["run_tune"]


def _progress(total: int):
    """A tqdm bar on rank 0: plans measured / left, with an ETA."""
    from tqdm import tqdm

    return tqdm(total=total, desc="amsp tune", unit="plan", file=sys.stderr, ascii=True,
                mininterval=0, dynamic_ncols=False, ncols=100)


def _cluster_profile(config, comm, *, num_nodes: int, gpus_per_node: int):
    """This cluster's profile when --profile is "cluster" (runtime/measure/cluster.py), else None
    (make_problems loads the named one)."""
    from amsp_ext.planner.defaults import CLUSTER_PROFILE
    from amsp_ext.runtime.measure.cluster import cluster_profile
    from amsp_ext.topology.groups import World

    if config.planner.profile != CLUSTER_PROFILE:
        return None
    world = World.with_leaves(num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                              nodes_per_leaf=config.engine.nodes_per_leaf)
    return cluster_profile(comm, world, timeout=config.engine.timeout)[0]


def _rank_memory(ranks_per_node: int) -> int:
    from amsp_ext.runtime.preflight import device_memory  # the engine's own answer

    return device_memory(ranks_per_node)


def run_tune(config, *, command: str) -> int:
    """Every rank: measure; rank 0 also analyses and writes (see the module doc)."""
    import torch
    import torch.distributed as dist

    from amsp_ext.runtime.measure.peak import device_peak
    from amsp_ext.runtime import collectives as C
    from amsp_ext.runtime.config import PRECISIONS
    from amsp_ext.runtime.measure.profiler import pick_device
    from amsp_ext.tune.candidates import choose_plans, make_problems
    from amsp_ext.tune.worker import run_rounds

    t_begin = time.time()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = pick_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
    t = config.tune
    from amsp_ext.tools.rendezvous import init_process_group

    init_process_group(backend, timeout=datetime.timedelta(seconds=config.engine.timeout),
                            device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    R = config.engine.gpus_per_node or local_world
    if world % R:
        raise ValueError(f"--gpus-per-node={R} must divide the world size {world}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    num_nodes = world // R
    load_start = list(os.getloadavg())
    comm = C.CollectiveContext(timeout=config.engine.timeout)  # the run's, every plan's engine too

    dtype = PRECISIONS[config.engine.precision]
    peak = device_peak(device, dtype, comm=comm,
                       override_flops=t.peak_tflops * 1e12 if t.peak_tflops else None)
    gpu_memory = config.planner.gpu_memory_bytes or _rank_memory(R)
    problems = make_problems(config, num_nodes=num_nodes, gpus_per_node=R,
                             gpu_memory_bytes=gpu_memory, peak_flops=peak.flops,
                             profile=_cluster_profile(config, comm, num_nodes=num_nodes, gpus_per_node=R))
    candidates = choose_plans(config, problems)
    if rank == 0:
        print(f"amsp tune: {len(candidates)} plans x {t.repeats} rounds on {num_nodes} x {R} "
              f"({backend}); peak {peak.flops / 1e9:.1f} GFLOP/s per rank ({peak.source})",
              file=sys.stderr, flush=True)
    bar = _progress(t.repeats * len(candidates)) if rank == 0 else None

    def on_done(done: int, total: int, cand, rec) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{cand.key} {rec['steps'][len(rec['steps']) // 2]['step_s']:.3f}s",
                                refresh=False)
            bar.update(1)

    mine = run_rounds(config, candidates, gpus_per_node=R, device=device, comm=comm, on_done=on_done)
    records = C.gather_objects(comm, mine, dist.group.WORLD, name="world")  # the run's timeout
    C.barrier(comm, dist.group.WORLD, name="world")
    dist.destroy_process_group()
    if bar is not None:
        bar.close()
    if rank != 0:
        return 0

    from amsp_ext.tune.report import build_result, print_winner, write_report

    meta: dict[str, Any] = {
        "command": command, "date": datetime.date.today().isoformat(),
        "world": {"num_nodes": num_nodes, "gpus_per_node": R}, "backend": backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak": peak.as_dict(), "gpu_memory_bytes": gpu_memory,
        "load": {"start": load_start, "end": list(os.getloadavg())},
        "cluster_link": os.environ.get("AMSP_CLUSTER_LINK"),
        "torch": torch.__version__,
    }
    result = build_result(config, problems, candidates, records, meta)
    if t.calibrate_out:
        from amsp_ext.tune.calibrate import calibrate_from_result

        calibrate_from_result(result, config, problems, candidates, Path(t.calibrate_out))
    result["meta"]["wall_s"] = time.time() - t_begin
    path = write_report(result, Path(t.out))
    print_winner(result, sys.stdout)
    print(f"amsp tune: wrote {path} ({result['meta']['wall_s']:.0f} s)", file=sys.stderr)
    return 0
