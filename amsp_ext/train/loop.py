"""The main job: train a Llama with AMSP on real text, top to bottom. One process per rank.

``amsp train`` launches this under torchrun with ``--config config.json`` (a TrainConfig, see
amsp_ext/train/config.py); ``amsp cluster run -- python -m amsp_ext.train.loop --steps 5 ...`` takes
the same flags as ``amsp train``. Rank 0 prints progress, and writes the JSON summary to
``--result-file`` when given.

The job is resumable: it starts from ``--resume`` (or, after an elastic restart, from the newest
checkpoint in ``--save-dir``), counts its data position in samples (amsp_ext/train/state.py:
[Note: the data position is a number of samples]) and saves every ``--save-every`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import amsp_ext
from amsp_ext import schema
from amsp_ext.common import metrics
from amsp_ext.tools.rendezvous import init_process_group
from amsp_ext.train.supervise import JOB_DIR_ENV, die_with_parent, report_error
from amsp_ext.common.data import micro_batch_at
from amsp_ext.common.faults import faults, kill_now, nan_now
from amsp_ext.common.models import build_llama, causal_lm_loss, llama_config_dict
from amsp_ext.planner.memory import memory_breakdown
from amsp_ext.planner.tensor_parallel import tp_shard_spec
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.engine_config import training_spec
from amsp_ext.runtime import collectives
from amsp_ext.runtime.state.checkpoint import load_checkpoint, save_checkpoint, wait_for_save
from amsp_ext.runtime.config import compute_dtype
from amsp_ext.runtime.optim.nonfinite import NonFiniteError
from amsp_ext.runtime.measure.peak import device_peak
from amsp_ext.runtime.step import train_step
from amsp_ext.job import ResolvedJob
from amsp_ext.runtime.preflight import plan_world
from amsp_ext.runtime.measure.profiler import pick_device
from amsp_ext.runtime.tensor_parallel import check_llama_layout, parallelize_llama, tensor_parallel_mesh
from amsp_ext.train.config import OptimOptions, TrainConfig, train_job
from amsp_ext.train.state import checkpoint_name, prune, resolve_resume


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% over the run."""
    warmup, steps = config.optim.warmup_steps, config.batch.steps
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_factory(config: TrainConfig):
    return adamw_factory(config.optim)


def adamw_factory(o: OptimOptions):
    return lambda params: torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2),
                                            weight_decay=o.weight_decay)


def train(config: TrainConfig, resolved: dict | None = None) -> dict | None:
    """One rank's run. ``resolved``: the job as the launcher resolved it (ResolvedJob.to_dict,
    amsp_ext/job.py), else the ranks resolve it in shard()."""
    b, e = config.batch, config.engine
    # -- 1. processes ----------------------------------------------------------------------
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    init_process_group(backend, timeout=datetime.timedelta(seconds=e.timeout))  # loopback store
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = pick_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
    log = print if (rank == 0 and not config.output.json) else (lambda *a, **k: None)
    # the run's collective context: the engine's, and this loop's own collectives go through it
    comm = collectives.CollectiveContext(timeout=e.timeout)

    # -- 2. model and plan -------------------------------------------------------------------
    # with --init-from, on meta: each rank reads only its share of the files (runtime/materialize.py)
    model = build_llama(config.model, seed=config.seed, on_meta=e.init_from is not None)
    num_params = sum(p.numel() for p in model.parameters())
    world = plan_world(e)  # T divides the node: checked before the TP mesh's groups
    job = train_job(config, num_nodes=world.num_nodes, gpus_per_node=world.gpus_per_node * world.tensor_parallel)
    if e.tensor_parallel > 1:  # checked before the mesh's groups: T divides the heads
        check_llama_layout(model, e.tensor_parallel)
        parallelize_llama(model, tensor_parallel_mesh(e.tensor_parallel, device.type)["tp"])
    if resolved is not None:  # the launcher's decisions for this same job (checked against it)
        model, optimizer = amsp_ext.shard(model, ResolvedJob.from_dict(resolved, job), optimizer_factory(config),
                                          comm=comm)
    else:
        model, optimizer = amsp_ext.shard(model, job.plan, optimizer_factory(config), config=job.engine,
                                          comm=comm)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, config))
    log(f"amsp train: {config.model} ({num_params / 1e6:.2f}M params) on {world_size} ranks "
        f"({model.amsp.world.num_nodes} node(s) x {model.amsp.world.gpus_per_node}"
        f"{f' data-parallel x TP {e.tensor_parallel}' if e.tensor_parallel > 1 else ''}), plan {model.amsp.plan}")

    # -- 3. where to start: fresh, or a checkpoint (after a restart: the newest one) --------
    global_batch = b.num_micro_batches * b.micro_batch_size * model.amsp.world.size  # sequences per step
    start = _start(config, model, optimizer, scheduler, global_batch=global_batch, log=log)
    samples, history = start.samples, start.history  # the data position, every step taken
    injected = faults()
    # [Note: adaptive in amsp train] with --adaptive, shard() gave the optimizer
    # runtime/replan/adaptive.py's monitor: at the end of every optimizer.step() it agrees on the
    # previous step's per-kind times (one all-reduce), feeds planner/adaptive.py's Monitor and on
    # drift re-fits, re-plans and decides; a switch it decides runs in the step's zero_grad()
    # (runtime/step.py), in memory (switch_plan: the same model and optimizer objects, so the
    # scheduler, the data position below and the RNG go on). Here it learns the run's length and
    # first step and logs through us. Off: none of it exists.
    adaptive = optimizer.adaptive
    if adaptive is not None:
        adaptive.follow_loop(total_steps=b.steps, first_step=len(history), log=log)

    # -- 4. the peak for MFU (common/metrics.py [Note: one MFU]) ---------------------------------
    peak = device_peak(device, compute_dtype(job.engine), comm=comm)

    # -- 5. the loop: global batch after global batch, until steps x global batch samples ---
    samples, step_times = _run_steps(config, model, optimizer, scheduler, samples=samples,
                                     history=history, global_batch=global_batch, device=device,
                                     injected=injected, log=log)
    if adaptive is not None:
        adaptive.close()
    ck = config.checkpoint
    if ck.save_dir:
        wait_for_save(model)
        if rank == 0:
            prune(Path(ck.save_dir), ck.keep)

    # -- 6. summary ------------------------------------------------------------------------
    result = _finish(config, model, start, comm, samples=samples, step_times=step_times, peak=peak,
                     num_params=num_params, device=device, log=log)
    dist.destroy_process_group()
    return result


def tokens_per_gpu_step(config: TrainConfig, model) -> float:
    """Tokens one GPU's step processes: its data-parallel rank's, shared by the T ranks of its TP
    group (each computes 1/T of every layer), so tokens/GPU/s and MFU count every GPU once."""
    b = config.batch
    return b.num_micro_batches * b.micro_batch_size * b.seq_len / model.amsp.world.tensor_parallel


def _run_steps(config: TrainConfig, model, optimizer, scheduler, *, samples: int, history: list[dict],
               global_batch: int, device: torch.device, injected, log) -> tuple[int, list[float]]:
    """Steps from sample ``samples`` on (each appended to ``history``, checkpointed as
    ``--save-every`` says); the data position at the end and each step's wall time."""
    b, ck, rank = config.batch, config.checkpoint, dist.get_rank()
    tokens_per_rank_step = tokens_per_gpu_step(config, model)
    step_times: list[float] = []
    while samples < b.steps * global_batch:
        step = len(history)
        kill_now(injected, rank=rank, step=step)
        t0 = time.perf_counter()
        loss, grad_norm, applied = global_batch_step(model, optimizer, scheduler, config, samples=samples,
                                                     step=step, device=device, injected=injected)
        history.append({"step": step, "first_sample": samples, "num_samples": global_batch,
                        "loss": loss, "applied": applied})
        samples += global_batch
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        log(f"step {step:3d}  loss {loss:.4f}  "
            f"grad-norm {float(grad_norm) if grad_norm is not None else float('nan'):.3f}  "
            f"{tokens_per_rank_step / step_times[-1]:8.0f} tok/rank/s{'' if applied else '  (skipped)'}")
        done = samples >= b.steps * global_batch
        if ck.save_dir and ((ck.save_every and (step + 1) % ck.save_every == 0) or done):
            _save(model, optimizer, scheduler, ck, step=step + 1, samples=samples,
                  global_batch=global_batch, history=history, rank=rank)
    return samples, step_times


def _finish(config: TrainConfig, model, start, comm: collectives.CollectiveContext, *, samples: int,
            step_times: list[float], peak, num_params: int, device: torch.device, log) -> dict | None:
    """Every rank's memory to rank 0, which builds the JSON summary (None elsewhere); a final
    barrier."""
    e, rank = config.engine, dist.get_rank()
    tokens_per_rank_step = tokens_per_gpu_step(config, model)
    model.amsp.wait_params()  # the last step's broadcasts, before measuring memory
    tokens_per_gpu_per_s = (tokens_per_rank_step / metrics.median_after_warmup(step_times)
                            if step_times else 0.0)
    mine = {"peak_memory_bytes": metrics.peak_memory_bytes(device),
            "model_state_bytes": model.model_state_bytes()}
    per_rank = [json.loads(r) for r in collectives.all_gather_bytes(
        comm, json.dumps(mine).encode(), dist.group.WORLD, name="world", width=1024, timeout=e.timeout)]
    result = None
    if rank == 0:
        result = _summary(config, model, start, history=start.history, samples=samples,
                          step_times=step_times, tokens_per_gpu_per_s=tokens_per_gpu_per_s, peak=peak,
                          per_rank=per_rank, num_params=num_params, device=device)
        log(f"done: {tokens_per_gpu_per_s:.0f} tokens/GPU/s, MFU {result['mfu']:.1%} "
            f"(peak {peak.flops / 1e9:.1f} GFLOP/s per rank, {peak.source})"
            + (f"; {result['mfu_check']}" if result["mfu_check"] else ""))
    collectives.barrier(comm, dist.group.WORLD, name="world", timeout=e.timeout)
    return result


def global_batch_step(model, optimizer, scheduler, config: TrainConfig, *, samples: int, step: int,
                      device: torch.device, injected) -> tuple[float, torch.Tensor | None, bool]:
    """One optimizer step over the global batch that starts at sample ``samples``
    (runtime/step.py ``train_step``, the LR scheduler stepped before ``zero_grad``). Returns the
    global-batch mean loss, the gradient norm (None without clipping) and whether the step was
    applied (a non-finite loss or norm skips it on every rank)."""
    b = config.batch
    rank, world_size, M = dist.get_rank(), dist.get_world_size(), b.num_micro_batches
    # the data-parallel rank reads: the T ranks of a TP group read the same micro-batches
    # (topology/groups.py [Note: the data-parallel world of a 2-D mesh])
    T = model.amsp.world.tensor_parallel
    batches = [micro_batch_at(samples, micro, rank // T, world_size=world_size // T, num_micro_batches=M,
                              micro_batch_size=b.micro_batch_size, seq_len=b.seq_len).to(device)
               for micro in range(M)]

    def loss_of(model, batch):
        loss = causal_lm_loss(model, batch)
        return loss * float("nan") if nan_now(injected, rank=rank, step=step) else loss

    done = train_step(model, optimizer, batches, loss_of, clip=config.optim.clip, between=scheduler.step)
    step_loss = torch.zeros((), device=device)
    for loss in done.losses:
        step_loss += (loss / M).float()
    # the logged loss is the global-batch mean: average over the world (a TP group's ranks
    # hold the same loss, so the mean over every rank is the data-parallel mean)
    collectives.all_reduce(model.amsp.comm, step_loss, dist.group.WORLD, name="world", stream=None,
                           async_op=False, timeout=config.engine.timeout)  # blocking, read next
    return step_loss.item() / world_size, done.grad_norm, done.applied


@dataclasses.dataclass(frozen=True)
class _Start:
    samples: int  # the data position
    history: list  # every step the model has taken
    resume: Path | None  # the checkpoint it came from
    restart: int  # torchrun's restart count


def _start(config: TrainConfig, model, optimizer, scheduler, *, global_batch: int, log) -> _Start:
    """Fresh, or from a checkpoint: ``--resume``, or after an elastic restart the newest one."""
    ck = config.checkpoint
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resume = _agreed_resume(model.amsp.comm, "auto" if restart else ck.resume, ck.save_dir,
                            config.engine.timeout)
    if resume is None:
        if restart or ck.resume == "auto":
            log(f"no checkpoint in {ck.save_dir} yet: a fresh start")
        return _Start(samples=0, history=[], resume=None, restart=restart)
    state = load_checkpoint(model, optimizer, resume, lr_scheduler=scheduler)
    log(f"resumed from {resume}{f' (restart {restart})' if restart else ''}: {state['samples']} samples "
        f"consumed in {len(state['history'])} steps; global batch {state['global_batch']} then, "
        f"{global_batch} now")
    return _Start(samples=state["samples"], history=state["history"], resume=resume, restart=restart)


def _summary(config: TrainConfig, model, start: _Start, *, history: list, samples: int,
             step_times: list[float], tokens_per_gpu_per_s: float, peak, per_rank: list[dict],
             num_params: int, device: torch.device) -> dict:
    """Rank 0's JSON summary of the run, with the planner's memory prediction for its plan."""
    b, e = config.batch, config.engine
    plan, world = model.amsp.plan, model.amsp.world  # the last plan, after any adaptive switch
    adaptive = model.amsp.optimizer.adaptive
    # under TP the planner's model is one TP rank's shard on the data-parallel world
    # (planner/tensor_parallel.py [Note: a TP job is an AMSP job of TP shards])
    predicted = memory_breakdown(
        tp_shard_spec(ModelSpec.from_hf_config(llama_config_dict(config.model)), world.tensor_parallel), plan,
        training_spec(e, b, all_reduce=model.amsp.config.all_reduce),
        gpus_per_node=world.gpus_per_node, num_nodes=world.num_nodes)
    flops_per_token = metrics.flops_per_token(llama_config_dict(config.model), b.seq_len)
    result = {
        "model": config.model, "num_params": num_params, "plan": plan.as_dict(),
        "plan_str": str(plan), "world": {"num_nodes": world.num_nodes, "gpus_per_node": world.gpus_per_node},
        "tensor_parallel": world.tensor_parallel,  # world: the data-parallel ranks it shards over
        "steps": b.steps, "micro_batches": b.num_micro_batches, "micro_batch_size": b.micro_batch_size,
        "seq_len": b.seq_len, "precision": e.precision, "reduce_dtype": e.reduce_dtype,
        "all_reduce": model.amsp.config.all_reduce,  # as run ("auto" is decided by then)
        "loss": [h["loss"] for h in history],
        "switches": list(model.amsp.switches),
        # which cluster planned the job (None here: the launcher planned it and fills this in)
        "profile": model.amsp.profile_source,
        # collectives the cluster profile's look-up and measurement issued (collectives.py counters)
        "profile_collectives": sum(n for (_, kind), n in model.amsp.comm.counts.items()
                                   if kind.startswith(("profile_", "cluster_"))),
        "adaptive_decisions": ([{**dataclasses.asdict(d), "line": d.line()} for d in adaptive.decisions]
                               if adaptive is not None else None),
        "adaptive_ratios": list(adaptive.ratios) if adaptive is not None else None,
        "history": history, "samples": samples,
        "resumed_from": str(start.resume) if start.resume else None,
        "restart": start.restart, "skipped_steps": sum(not h["applied"] for h in history),
        "step_time_s": step_times, "tokens_per_gpu_per_s": tokens_per_gpu_per_s,
        "mfu": metrics.mfu(flops_per_token=flops_per_token,
                           tokens_per_gpu_per_s=tokens_per_gpu_per_s, peak_flops=peak.flops),
        **peak.as_dict(),
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in per_rank],
        "peak_memory_source": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                               else "peak RSS of each rank (ru_maxrss)"),
        "model_state_bytes": {"measured": [r["model_state_bytes"] for r in per_rank],
                              "predicted": {"params": predicted.params, "grads": predicted.grads,
                                            "optim": predicted.optim, "total": predicted.model_states}},
    }
    result["mfu_check"] = metrics.mfu_check(result["mfu"])
    return result


def _agreed_resume(comm: collectives.CollectiveContext, resume: str | None, save_dir: str | None,
                   timeout: float) -> Path | None:
    """The checkpoint to start from, as rank 0 resolves it (every rank takes the same)."""
    mine = resolve_resume(resume, save_dir) if dist.get_rank() == 0 else None
    got = collectives.all_gather_bytes(comm, str(mine or "").encode(), dist.group.WORLD, name="world",
                                       width=4096, timeout=timeout)[0].decode()
    return Path(got) if got else None


def _save(model, optimizer, scheduler, ck, *, step: int, samples: int, global_batch: int,
          history: list[dict], rank: int) -> None:
    """Checkpoint ``save-dir/step-N`` (atomic, checksummed; async with --async-save) and keep
    the ``--keep`` newest published ones."""
    wait_for_save(model)  # the previous async save is published before the next starts
    if rank == 0:
        prune(Path(ck.save_dir), ck.keep)
    save_checkpoint(model, optimizer, Path(ck.save_dir) / checkpoint_name(step), lr_scheduler=scheduler,
                    extra={"samples": samples, "history": list(history), "global_batch": global_batch},
                    info={"samples": samples, "step": step, "global_batch": global_batch},
                    async_save=ck.async_save)
    if rank == 0 and not ck.async_save:
        prune(Path(ck.save_dir), ck.keep)


def run_worker(config: TrainConfig, result_file: str | None = None, resolved: dict | None = None) -> int:
    """One rank of the job: train, then rank 0 writes the summary to ``result_file`` (or
    prints it under ``--json``). ``resolved``: the launcher's resolved job (``--resolved``)."""
    die_with_parent()  # never outlive the launcher's agent (amsp_ext/train/supervise.py)
    if os.environ.get(JOB_DIR_ENV):  # Ctrl-C: the launcher says it once, no traceback per rank
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    try:
        result = train(config, resolved)
    except KeyboardInterrupt:  # Ctrl-C: the launcher says it once (and exits 130), not every rank
        if os.environ.get(JOB_DIR_ENV):
            os._exit(130)
        raise
    except (ValueError, NonFiniteError, collectives.CollectiveTimeout) as err:  # one line
        if report_error(err):
            # [Note: a failed rank exits at once] its one line is in the job folder; a normal
            # interpreter exit would run the destructors of the process groups and of torch's
            # writer threads that the failure left joinable, and C++ then aborts with a line of its
            # own ("terminate called without an active exception")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise
    except Exception as err:
        report_error(err)
        raise
    if result is not None:
        if result_file:
            with open(result_file, "w") as f:
                json.dump(result, f)
        elif config.output.json:
            print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amsp_ext.train.loop", description=__doc__)
    parser.add_argument("--config", default=None,
                        help="a TrainConfig as JSON (what `amsp train` writes); no other flags then")
    schema.add_arguments(parser, TrainConfig)
    parser.add_argument("--result-file", default=None, help="rank 0 writes the JSON summary here")
    parser.add_argument("--resolved", default=None,
                        help="the job as `amsp train`'s launcher resolved it (JSON, amsp_ext/job.py)")
    args = parser.parse_args(argv)
    if args.config:
        if any(getattr(args, f.name) != f.default for _, f in schema.options(TrainConfig)):
            parser.error("--config takes no other training flags (the file holds them all)")
        with open(args.config) as f:
            config = schema.from_json(TrainConfig, f.read())
    else:
        config = schema.from_namespace(TrainConfig, args)
    resolved = None
    if args.resolved:
        with open(args.resolved) as f:
            resolved = json.load(f)
    return run_worker(config, args.result_file, resolved)


def exit_rank(code: int) -> None:
    """Leave this rank's process with ``code`` at once, after flushing what it printed.

    [Note: a rank that finished exits at once]
    A torchrun rank that trained, wrote its summary and destroyed its process group has
    nothing left to do, but a normal interpreter exit still finalizes, and a 2-rank `amsp train`
    rank has died there with SIGABRT
    ("terminate called without an active exception"; the cause, a gloo worker releasing a
    finished collective during finalization, is runtime/collectives.py [Note: process groups
    torn down at exit]), and the launcher reported a failed job for a run that had finished.
    As on the failure path ([Note: a failed rank exits at once]) the rank flushes what it
    printed and leaves with its exit code. Only the per-rank entry points (``python -m
    amsp_ext.train``, what `amsp train` launches, and this module) call it; `amsp train` under an existing launcher
    (cli/train.py) returns normally.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_rank(main())
