"""``amsp profile``: measure collective bandwidths and write the planner's profile JSON.

Run it on every rank: ``torchrun --nproc-per-node R [--nnodes N ...] -m amsp_ext.cli profile`` or,
on the one-machine lab, ``amsp cluster run -- -m amsp_ext.cli profile --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from amsp_ext import schema
from amsp_ext.engine_config import DEFAULT_TIMEOUT_S
from amsp_ext.schema import option

HELP = "measure allreduce/allgather/reducescatter/broadcast bandwidth per mesh; write a profile JSON"


@dataclass(frozen=True, kw_only=True)
class ProfileFlags:
    """``amsp profile``'s flags. Unset (None) sizes and counts take ProfileConfig's defaults, or
    the --quick ones; ProfileConfig (runtime/measure/profile_cases.py) checks the values, in its words."""

    output: str = option("profile.json", short="-o", help="where rank 0 writes the profile")
    name: str | None = option(None, help="profile name (default measured-<N>x<R>-<backend>)")
    quick: bool = option(False, help="1, 4, 16 MiB, 1 warm-up + 3 repetitions (under 2 minutes on "
                                     "the 2x2 lab)")
    min_size: str | None = option(None, help="smallest message (default 1MiB)")
    max_size: str | None = option(None, help="largest message (default 64MiB; quick 16MiB)")
    size_factor: int | None = option(None, help="ratio of consecutive sizes (default 2; quick 4)")
    ops: str | None = option(None, help="comma list, default allreduce,allgather,reducescatter,broadcast")
    warmup: int | None = option(None, help="untimed repetitions (default 2; quick 1)")
    reps: int | None = option(None, help="timed repetitions, median kept (default 5; quick 3)")
    dtype: str = option("bfloat16", help="float32 | bfloat16 | float16")
    backend: str = option("auto", help="auto | nccl | gloo (auto: nccl when CUDA is available)")
    all_meshes: bool = option(False, help="also measure allgather/reducescatter on meshes the "
                                          "cross-node rule (Eq. 7) excludes")
    nodes_per_leaf: int | None = option(None, help="leaf-switch size for the group layout (default: "
                                                   "from the lab, else one leaf)")
    intra_link: str | None = option(None, help="describe the intra-node link in the metadata (e.g. "
                                               "'NVLink 4')")
    inter_link: str | None = option(None, help="describe the inter-node link in the metadata (e.g. "
                                               "'4x200G IB')")
    notes: str = option("", help="free text appended to metadata.notes")
    timeout: float = option(DEFAULT_TIMEOUT_S, help="seconds before a collective counts as hung")
    cache: bool = option(False, help="what plan 'auto' does: use this cluster's cached profile, or "
                                     "measure the meshes the planner prices (quick sizes) and cache "
                                     "it (runtime/measure/cluster.py); --output gets where it came from")
    ranks_per_node: int | None = option(None, minimum=1, help="ranks per node of the layout (default: "
                                                             "LOCAL_WORLD_SIZE)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schema.add_arguments(parser, ProfileFlags)


def _config(args: argparse.Namespace):
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.runtime.measure.profile_cases import ProfileConfig

    given = {}
    if args.min_size is not None:
        given["min_bytes"] = parse_size(args.min_size, field="--min-size")
    if args.max_size is not None:
        given["max_bytes"] = parse_size(args.max_size, field="--max-size")
    if args.size_factor is not None:
        given["size_factor"] = args.size_factor
    if args.warmup is not None:
        given["num_warmup"] = args.warmup
    if args.reps is not None:
        given["num_reps"] = args.reps
    if args.ops is not None:
        given["ops"] = tuple(o.strip().lower() for o in args.ops.split(",") if o.strip())
    given.update(dtype=args.dtype, all_meshes=args.all_meshes, timeout_s=args.timeout)
    if args.quick:
        return ProfileConfig.quick(**given)
    return ProfileConfig(**given)


def _launch_env():
    """(rank, world size, local world size, local rank) from torchrun's environment."""
    from amsp_ext.runtime.measure.profile_cases import ProfileError

    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    missing = [k for k in keys if k not in os.environ]
    if missing:
        raise ProfileError(
            f"amsp profile runs on every rank; start it with torchrun or the lab, e.g. "
            f"`torchrun --nproc-per-node 4 -m amsp_ext.cli profile --quick` or "
            f"`amsp cluster run -- -m amsp_ext.cli profile --quick` (missing {', '.join(missing)})"
        )
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def _lab_link() -> dict | None:
    text = os.environ.get("AMSP_CLUSTER_LINK")
    return json.loads(text) if text else None


def _print_fits(measurements, out) -> None:
    from amsp_ext.runtime.measure.profile_cases import alpha_beta_fit

    print(f"{'op':<14}{'mesh':>6}  {'alpha (us)':>11}  {'1/beta (GB/s)':>13}  {'GB/s at max':>11}", file=out)
    for m in measurements:
        alpha, bw = alpha_beta_fit(m.points)
        v, t = max(m.points)
        bw_text = "inf" if bw == float("inf") else f"{bw / 1e9:.3f}"
        print(f"{m.op:<14}{f'{m.p0}x{m.p1}':>6}  {alpha * 1e6:>11.1f}  {bw_text:>13}  {v / t / 1e9:>11.3f}", file=out)


def _cached(comm, world, args: argparse.Namespace, rank: int) -> int:
    """--cache: the profile plan 'auto' would use here; rank 0 writes where it came from."""
    from amsp_ext.runtime.measure.cluster import cluster_profile

    _, source = cluster_profile(comm, world, timeout=args.timeout)
    if rank == 0:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(source.as_dict(), indent=1) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from amsp_ext.runtime.measure.profile_cases import ProfileError

    config = _config(args)  # bad flags fail here, before any rank talks to another
    rank, world_size, local_world, local_rank = _launch_env()
    local_world = args.ranks_per_node or local_world
    if world_size % local_world:
        raise ProfileError(f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world}; "
                           f"every node must run the same number of ranks")
    if args.backend not in ("auto", "nccl", "gloo"):
        raise ProfileError(f"--backend must be auto, nccl or gloo, got {args.backend!r}")
    link = _lab_link()
    nodes_per_leaf = args.nodes_per_leaf if args.nodes_per_leaf is not None else (link or {}).get("nodes_per_leaf")

    import datetime

    import torch
    import torch.distributed as dist

    from amsp_ext.runtime.measure.profile_cases import profile_document
    from amsp_ext.runtime.measure.profiler import measure, pick_device
    from amsp_ext.topology.groups import World

    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    world = World.with_leaves(num_nodes=world_size // local_world, gpus_per_node=local_world,
                              nodes_per_leaf=nodes_per_leaf)
    device = pick_device(backend, local_rank)
    from amsp_ext.tools.rendezvous import init_process_group

    init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        from amsp_ext.runtime.collectives import CollectiveContext

        comm = CollectiveContext(timeout=config.timeout_s)
        if args.cache:
            return _cached(comm, world, args, rank)
        measurements = measure(config, world, device, progress=True, comm=comm)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    link_meta = dict(link) if link else {"intra": "unspecified", "inter": "unspecified"}
    if args.intra_link:
        link_meta["intra"] = args.intra_link
    if args.inter_link:
        link_meta["inter"] = args.inter_link
    name = args.name or f"measured-{world.num_nodes}x{world.gpus_per_node}-{backend}"
    doc = profile_document(
        measurements, name=name, backend=backend, torch_version=torch.__version__.split("+")[0],
        world=world, link=link_meta, config=config, notes=args.notes,
    )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    _print_fits(measurements, sys.stdout)
    print(f"wrote {out} ({len(doc['entries'])} entries, {world.num_nodes} node(s) x "
          f"{world.gpus_per_node} rank(s), {backend})", file=sys.stdout)
    return 0
