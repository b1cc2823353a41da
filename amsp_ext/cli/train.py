"""``amsp train``: the main job. Launches its own ranks (torchrun underneath) and runs
:mod:`amsp_ext.train.loop` on each; gloo on CPU, NCCL on GPU. Under an existing launcher (torchrun or
``amsp cluster run``, i.e. when ``LOCAL_RANK`` is set) it runs the worker in this process.

The flags are generated from TrainConfig (amsp_ext/train/config.py); every rank receives the
validated config as one JSON file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from amsp_ext import schema
from amsp_ext.planner.defaults import CLUSTER_PROFILE
from amsp_ext.train.config import TrainConfig

HELP = "train a Llama with AMSP on real text (default: tiny-llama, 4 ranks as 2 nodes x 2)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=4,
                   help="ranks to launch on this machine (default 4)")
    # not a TrainConfig field: the config travels to the ranks as a file, a secret must not
    p.add_argument("--checkpoint-key", default=None, metavar="KEY",
                   help="sign checkpoints (HMAC-SHA256 over amsp.json) and refuse unsigned or otherwise "
                        "signed ones; default: $AMSP_CHECKPOINT_KEY (preferred: a flag is visible in ps)")
    schema.add_arguments(p, TrainConfig)


def _launcher_profile(config: TrainConfig, *, gpus_per_node: int, num_nodes: int):
    """``(config, source)``: a named --profile checked and described; the profile "cluster"
    looked up in the cache with the fingerprint the ranks will compute (they run on this host:
    runtime/measure/cluster.py [Note: where the measurement runs]) and, when found, named by its
    path; when not, left to the ranks, which measure it (source None)."""
    from amsp_ext.planner.profile import load_profile
    from amsp_ext.topology.profile_cache import ProfileSource, host_facts, lookup, merge_facts, named_source

    name = config.planner.profile
    if name != CLUSTER_PROFILE:
        return config, named_source(name, load_profile(name).metadata)  # a bad --profile: refused here
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.cuda.get_device_name(0) if backend == "nccl" else "cpu"
    fingerprint = merge_facts([host_facts()] * (gpus_per_node * num_nodes), ranks_per_node=gpus_per_node,
                              backend=backend, device=device)
    found = lookup(fingerprint)
    if found.doc is None:
        return config, None  # the ranks measure (and say why the cached file, if any, was not used)
    planner = dataclasses.replace(config.planner, profile=str(found.path))
    return (dataclasses.replace(config, planner=planner),
            ProfileSource(source="cache", path=str(found.path), fingerprint=fingerprint, age_s=found.age_s))


def _resolve_before_launch(config: TrainConfig, *, gpus_per_node: int, num_nodes: int):
    """The job the ranks will run, resolved here when it can be (amsp_ext/job.py [Note: one job,
    resolved once]): a ResolvedJob the ranks receive, or None when resolving needs what only
    they have (the cluster's profile not in the cache, a GPU's memory). Checked against this
    world before any rank starts either way: a plan that cannot run, one the memory model says
    cannot fit, and every ``--plan auto`` error (a bad profile, nothing fits) are one line
    from here."""
    from amsp_ext.job import check_fits, needs, resolve
    from amsp_ext.train.config import train_job

    job = train_job(config, num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    plan = job.explicit_plan(field="--plan")
    memory = _rank_memory(config, gpus_per_node)
    # an explicit plan too: refuse what cannot fit, with no reserve unless one was given: only
    # what the memory model says cannot fit at all
    reserve = config.planner.memory_reserve_bytes or 0
    if needs(job) - ({"memory"} if memory is not None else set()):
        if plan is not None and memory is not None:
            check_fits(job, plan, memory, reserve_bytes=reserve)
        return None
    resolved = resolve(job, gpu_memory_bytes=memory)
    if plan is not None and memory is not None:
        check_fits(job, plan, memory, all_reduce=resolved.all_reduce.mode, profile=resolved.profile,
                   reserve_bytes=reserve)
    return resolved


def _rank_memory(config: TrainConfig, gpus_per_node: int) -> int | None:
    """Memory per rank: --gpu-memory, else on CPU the RAM shared by a node's ranks, else None
    (a GPU rank reads its device's)."""
    if config.planner.gpu_memory_bytes is not None:
        return config.planner.gpu_memory_bytes
    import torch

    if torch.cuda.is_available():
        return None
    from amsp_ext.topology.profile_cache import cpu_memory_per_rank

    return cpu_memory_per_rank(gpus_per_node)  # what a CPU rank assumes


def _check_save_dir(config: TrainConfig) -> None:
    """--save-dir is a directory this process can write, checked before any rank trains."""
    save_dir = config.checkpoint.save_dir
    if not save_dir:
        return
    path = Path(save_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".amsp-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--save-dir {save_dir}: cannot write there ({e.strerror or e})") from None


def _check_resume(config: TrainConfig) -> None:
    """A checkpoint to resume from is checked (every file against its checksum) here, once."""
    ck = config.checkpoint
    from amsp_ext.train.state import clean_staging, newest_intact, resolve_resume, verify

    for p in clean_staging(ck.save_dir):  # what interrupted saves left; no rank runs yet
        print(f"amsp train: removed {p} (the staging folder of an interrupted save)", file=sys.stderr)
    if not ck.resume:
        return
    path = resolve_resume(ck.resume, ck.save_dir)
    if path is None:
        return
    try:
        verify(path)
    except ValueError as err:
        if ck.resume != "auto":
            raise
        older = newest_intact(ck.save_dir, path)
        hint = (f"; the newest intact checkpoint is {older} (pass --resume {older})" if older
                else "; no older intact checkpoint in --save-dir")
        raise type(err)(f"{err}{hint}") from None


def run(args: argparse.Namespace) -> int:
    config = schema.from_namespace(TrainConfig, args)  # one-line ValueError on a bad flag
    key = getattr(args, "checkpoint_key", None)
    if key is not None:
        if not key:
            raise ValueError("--checkpoint-key must not be empty")
        from amsp_ext.runtime.state.checkpoint_files import KEY_ENV

        os.environ[KEY_ENV] = key  # this process's resume check, and every rank (inherited)
    if "LOCAL_RANK" in os.environ:  # already one rank of a launched job
        from amsp_ext.train.loop import run_worker

        return run_worker(config)
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    T = config.engine.tensor_parallel
    # a virtual node holds 2 data-parallel ranks by default (T ranks each under --tensor-parallel)
    gpus = config.engine.gpus_per_node or min(args.nproc_per_node, 2 * T)
    if args.nproc_per_node % gpus:
        raise ValueError(
            f"--gpus-per-node={gpus} must divide --nproc-per-node={args.nproc_per_node}"
        )
    if gpus % T:
        raise ValueError(f"--tensor-parallel {T} must divide the GPUs per node ({gpus}); allowed: "
                         f"{', '.join(str(t) for t in range(1, gpus + 1) if gpus % t == 0)}")
    from amsp_ext.cli.precision import warn_if_slow_bf16

    warn_if_slow_bf16(config.engine.precision)  # decided (the default is fp32): bf16 only warns
    from amsp_ext.train.config import train_job

    nodes = args.nproc_per_node // gpus
    # only a run the planner prices says which cluster its profile describes (an explicit plan
    # with a flat or two-level all-reduce reads none)
    profile_source = None
    if train_job(config, num_nodes=nodes, gpus_per_node=gpus).priced():
        config, profile_source = _launcher_profile(config, gpus_per_node=gpus, num_nodes=nodes)
    resolved = _resolve_before_launch(config, gpus_per_node=gpus, num_nodes=nodes)
    _check_save_dir(config)
    _check_resume(config)
    if profile_source is not None:  # checked: bad input stays one line (the error's)
        print(profile_source.line(), file=sys.stderr)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, gpus_per_node=gpus))
    return launch(config, nproc_per_node=args.nproc_per_node, resolved=resolved, profile_source=profile_source)


def launch(config: TrainConfig, *, nproc_per_node: int, resolved=None, profile_source=None) -> int:
    """Run the ranks under torchrun (amsp_ext/train/supervise.py: no orphans, one line on
    failure), each reading ``config`` from one JSON file and, when the launcher resolved the job
    (``resolved``, a ResolvedJob), its decisions from another; under ``--json``, print rank 0's
    summary."""
    from amsp_ext.train.supervise import Job

    from amsp_ext.tools.rendezvous import loopback_env, loopback_torchrun_args

    env = loopback_env({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                        "PYTHONUNBUFFERED": "1"})
    # the store lives in the agent, on 127.0.0.1 only (tools/rendezvous.py); every restart's
    # ranks are its clients
    with Job("amsp-train-") as job:
        config_file, result_file = job.dir / "config.json", job.dir / "result.json"
        config_file.write_text(schema.to_json(config))
        extra = []
        if resolved is not None:
            (job.dir / "resolved.json").write_text(json.dumps(resolved.to_dict()))
            extra = ["--resolved", str(job.dir / "resolved.json")]
        rc = job.run([*loopback_torchrun_args(), f"--nproc-per-node={nproc_per_node}",
                      f"--max-restarts={config.checkpoint.max_restarts}", "-m", "amsp_ext.train",
                      "--config", str(config_file), "--result-file", str(result_file), *extra],
                     env=env, stdout=subprocess.DEVNULL if config.output.json else None)
        if rc != 0:
            print(f"amsp train: error: {job.error_line(rc)}", file=sys.stderr)
            return rc
        if config.output.json:
            result = json.loads(result_file.read_text())
            # the launcher's word where it planned, or found the cache entry the ranks read as a file
            if profile_source is not None and (result.get("profile") is None or profile_source.source == "cache"):
                result["profile"] = profile_source.as_dict()
            print(json.dumps(result))
    return 0
