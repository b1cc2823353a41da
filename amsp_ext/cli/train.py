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
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_PROFILE
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


def _plan_before_launch(config: TrainConfig, *, gpus_per_node: int, num_nodes: int) -> tuple[str, str]:
    """``(plan, all_reduce)`` the ranks will run, checked against this world before any rank
    starts: a plan that cannot run, and every ``--plan auto`` error (a bad profile, nothing
    fits), is one line from here. ``auto`` (the plan, or ``--all-reduce``) is decided here (the
    ranks get the factors and the mode) unless the device memory has to be read from a GPU."""
    from amsp_ext.engine_config import planner_settings
    from amsp_ext.planner.auto import auto_problem, resolve_auto
    from amsp_ext.planner.plan import resolve_plan, validate_plan
    from amsp_ext.train.config import auto_plan_config
    from amsp_ext.common.models import llama_config_dict

    memory = _rank_memory(config, gpus_per_node)
    # the same settings the ranks' engine plans with (engine_config.planner_settings): the
    # launcher once planned without reduce_dtype, i.e. for half the gradient bytes under bf16.
    # Under TP T the planner prices the node's R GPUs as TP groups and searches the factors over
    # the data-parallel world, R / T per node (planner/tensor_parallel.py); explicit plans are
    # plans of that world (topology/groups.py [Note: the data-parallel world of a 2-D mesh]).
    T = config.engine.tensor_parallel
    shape = dict(num_nodes=num_nodes, gpus_per_node=gpus_per_node, tensor_parallel=T,
                 **planner_settings(config.engine))
    gpus_per_node //= T
    model = llama_config_dict(config.model)
    all_reduce = config.engine.all_reduce
    if config.plan.strip().lower() == "auto":
        if memory is None or config.planner.profile == CLUSTER_PROFILE:
            return config.plan, all_reduce  # the ranks read their device's memory
        planned = resolve_auto(model, auto_plan_config(config), gpu_memory_bytes=memory, **shape)
        return str(planned.plan), planned.all_reduce.mode
    plan = validate_plan(resolve_plan(config.plan, gpus_per_node=gpus_per_node, num_nodes=num_nodes,
                                      field="--plan"),
                         gpus_per_node=gpus_per_node, num_nodes=num_nodes, structural_only=True)
    if memory is None:
        return config.plan, all_reduce
    # an explicit plan too: refuse what cannot fit before any rank starts, with no reserve:
    # only what the memory model says cannot fit at all
    auto = dataclasses.replace(auto_plan_config(config),
                               memory_reserve_bytes=config.planner.memory_reserve_bytes or 0)
    if auto.profile == CLUSTER_PROFILE:  # not measured yet: the ranks price an all_reduce "auto";
        # the memory check reads no bandwidth, any profile serves it
        mode = "flat" if all_reduce == "auto" else all_reduce
        _check_fits(auto_problem(model, dataclasses.replace(auto, profile=DEFAULT_PROFILE),
                                 gpu_memory_bytes=memory, **{**shape, "all_reduce": mode}), plan, memory)
        return config.plan, all_reduce
    planned = resolve_auto(model, auto, plan=plan, gpu_memory_bytes=memory, **shape)
    _check_fits(auto_problem(model, auto, gpu_memory_bytes=memory,
                             **{**shape, "all_reduce": planned.all_reduce.mode}), plan, memory)
    return config.plan, planned.all_reduce.mode


def _rank_memory(config: TrainConfig, gpus_per_node: int) -> int | None:
    """Memory per rank: --gpu-memory, else on CPU the RAM shared by a node's ranks, else None
    (a GPU rank reads its device's)."""
    if config.planner.gpu_memory_bytes is not None:
        return config.planner.gpu_memory_bytes
    import torch

    if torch.cuda.is_available():
        return None
    import psutil

    return psutil.virtual_memory().total // gpus_per_node  # what a CPU rank assumes


def _check_fits(problem, plan, memory: int) -> None:
    from amsp_ext.planner.search import evaluate
    from amsp_ext.planner.specs import format_size

    mem = evaluate(problem, plan).memory
    if mem.total > problem.memory_limit:
        raise ValueError(
            f"plan {plan} does not fit: the planner's memory model needs {format_size(mem.total)} per "
            f"rank (activations {format_size(mem.kept_activations)}) of {format_size(memory)}; lower "
            f"--micro-batch-size or --seq-len, use --recompute or a more sharded --plan, or give "
            f"--gpu-memory")


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
    # only a run the planner prices says which cluster its profile describes (an explicit plan
    # with a flat or two-level all-reduce reads none)
    priced = (config.plan.strip().lower() == "auto" or config.engine.all_reduce == "auto"
              or config.adaptive.adaptive)
    profile_source = None
    if priced:
        config, profile_source = _launcher_profile(config, gpus_per_node=gpus,
                                                   num_nodes=args.nproc_per_node // gpus)
    plan, all_reduce = _plan_before_launch(config, gpus_per_node=gpus, num_nodes=args.nproc_per_node // gpus)
    _check_save_dir(config)
    _check_resume(config)
    if profile_source is not None:  # checked: bad input stays one line (the error's)
        print(profile_source.line(), file=sys.stderr)
    config = dataclasses.replace(
        config, plan=plan, engine=dataclasses.replace(config.engine, gpus_per_node=gpus,
                                                      all_reduce=all_reduce))
    return launch(config, nproc_per_node=args.nproc_per_node, profile_source=profile_source)


def launch(config: TrainConfig, *, nproc_per_node: int, profile_source=None) -> int:
    """Run the ranks under torchrun (amsp_ext/train/supervise.py: no orphans, one line on
    failure), each reading ``config`` from one JSON file; under ``--json``, print rank 0's
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
        rc = job.run([*loopback_torchrun_args(), f"--nproc-per-node={nproc_per_node}",
                      f"--max-restarts={config.checkpoint.max_restarts}", "-m", "amsp_ext.train",
                      "--config", str(config_file), "--result-file", str(result_file)],
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
