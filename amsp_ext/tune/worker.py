"""The measuring side of ``amsp tune``: every rank runs this, inside torchrun or the lab.

    1. the MFU peak (metrics.device_peak), once, every rank at once;
    2. per round: the compute probe, then every candidate plan in the round's order
       (compare/rounds.py: alternated, so load drifts hit every plan alike);
    3. all ranks' records gathered on rank 0.

[Note: one plan, one rank]
Build the model (same seed on every rank), shard it with the plan (``amsp_ext.shard``), run
``warmup_steps`` untimed and ``steps`` timed steps of the ordinary loop (M micro-batches,
clip, step, the loss all-reduce of ``amsp train``), with a ``CommTrace`` recording every
collective. Per step: wall time, forward / backward / optimizer phase times, and per collective
kind the measured busy and exposed time (runtime/measure/comm_trace.py). Then the rank's model-state
bytes (the engine's own count) and peak RSS delta (VmHWM reset just before the model is built).
The hooks are removed and the model dropped before the next plan.

[Note: the compute probe]
The step model's compute constants must be this model's forward and backward speed on this
device *while every rank computes* (on a shared CPU a rank gets a share of the cores). The
probe runs the unsharded model's forward, backward and AdamW step on this rank's micro-batches,
each phase started on every rank at once (a barrier before it, none inside): the compute a plan
would do with nothing else going on. Without the barriers the ranks drift apart, and a rank
computing while another runs its optimizer step or waits got up to 1.7x the speed it gets in
training (small-llama on the 2 x 2 lab: a forward at 56 GFLOP/s per rank, above the shared
matmul peak of 36). Its median forward/backward/optimizer times feed the calibration
(planner/fit.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import PRECISIONS
from amsp_ext.runtime.measure.comm_trace import CommTrace
from amsp_ext.train.config import engine_shard_config
from amsp_ext.train.loop import adamw_factory
from amsp_ext.train.config import OptimOptions
from amsp_ext.tune.candidates import Candidate
from amsp_ext.tune.spec import TuneConfig

__all__ = ["build_model", "compute_probe", "measure_plan", "run_rounds"]


def build_model(config: TuneConfig):
    from amsp_ext.common.models import build_llama

    if config.model_config is None:
        return build_llama(config.model, seed=config.seed)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in config.hf_config().items() if k not in ("architectures",)}
    hf = LlamaConfig(**cfg)
    hf._attn_implementation = "eager"
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(hf)


def _batch(config: TuneConfig, step: int, micro: int, rank: int, world: int, device) -> torch.Tensor:
    from amsp_ext.common.data import micro_batch

    b = config.batch
    return micro_batch(step, micro, rank, world_size=world, num_micro_batches=b.num_micro_batches,
                       micro_batch_size=b.micro_batch_size, seq_len=b.seq_len).to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_probe(config: TuneConfig, device, comm: C.CollectiveContext) -> dict[str, float]:
    """Median forward, backward and optimizer-step seconds of the unsharded model (see the Note);
    call on every rank at once."""
    from amsp_ext.common.models import causal_lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    e, M, timeout = config.engine, config.batch.num_micro_batches, config.engine.timeout
    model = build_model(config).to(device)
    if e.recompute:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.to(PRECISIONS[e.precision]) if e.precision != "fp32" else model
    opt = adamw_factory(OptimOptions())(list(model.parameters()))
    fwd, bwd, step_t = [], [], []
    world_group = dist.group.WORLD

    def together() -> None:  # every rank starts the next phase at once, as in training
        C.barrier(comm, world_group, name="world", timeout=timeout)

    for step in range(config.tune.probe_steps):
        f = b = 0.0
        for micro in range(M):
            batch = _batch(config, step, micro, rank, world, device)
            together()
            t0 = time.perf_counter()
            loss = causal_lm_loss(model, batch) / M
            _sync(device)
            f += time.perf_counter() - t0
            together()
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            b += time.perf_counter() - t1
        together()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        fwd.append(f)
        bwd.append(b)
        step_t.append(time.perf_counter() - t2)
    C.barrier(comm, dist.group.WORLD, name="world", timeout=timeout)
    del model, opt
    gc.collect()
    return {"forward_s": statistics.median(fwd[1:]) / M, "backward_s": statistics.median(bwd[1:]) / M,
            "optimizer_s": statistics.median(step_t[1:])}


def measure_plan(config: TuneConfig, cand: Candidate, *, gpus_per_node: int, device,
                 comm: C.CollectiveContext) -> dict[str, Any]:
    """One plan on this rank (see [Note: one plan, one rank]): its record. ``comm``: the run's
    collective context; the plan's engine issues through it and the trace observes it."""
    import amsp_ext
    from amsp_ext.compare import memory
    from amsp_ext.common.metrics import peak_memory_bytes

    rank, timeout = dist.get_rank(), config.engine.timeout
    engine = dataclasses.replace(config.engine, gpus_per_node=gpus_per_node)
    engine_config = engine_shard_config(engine, config.planner, config.batch)
    gc.collect()
    _trim_heap()  # the previous plan's freed memory back to the OS, so its reuse shows in RSS
    C.barrier(comm, dist.group.WORLD, name="world", timeout=timeout)
    rss0 = memory.rss_bytes()
    hwm_reset = memory.reset_peak_rss() and device.type == "cpu"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cpu0 = cpu_counters()
    groups_before = set(compat.live_process_groups())
    t_setup = time.perf_counter()
    model, opt = amsp_ext.shard(build_model(config), cand.plan, adamw_factory(OptimOptions()),
                                config=engine_config, comm=comm)
    setup_s = time.perf_counter() - t_setup
    steps: list[dict[str, Any]] = []
    with CommTrace(comm) as trace:
        for step in range(config.tune.warmup_steps + config.batch.steps):
            st = _timed_step(config, model, opt, step=step, device=device, comm=comm)
            if step >= config.tune.warmup_steps:
                steps.append(st)
        model.amsp.wait_params()  # the last broadcasts complete before the trace is read
        C.barrier(comm, dist.group.WORLD, name="world", timeout=timeout)
    for st in steps:  # a step's collectives: issued in its window (completed whenever)
        t_start, t_end = st.pop("window")
        st["comm"] = trace.summary(t_start, t_end)
        st["phases"] = _phase_times(trace, st["phases"])
    record = {
        "rank": rank, "setup_s": setup_s, "steps": steps, "cpu": cpu_delta(cpu0),
        "model_state_bytes": model.model_state_bytes(),
        "peak_memory_bytes": (peak_memory_bytes(device) if device.type == "cuda" else
                              (memory.peak_rss_bytes() - rss0) if hwm_reset and rss0 else None),
    }
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    del model, opt
    gc.collect()
    _destroy_new_groups(groups_before)
    return record


def _timed_step(config: TuneConfig, model, opt, *, step: int, device,
                comm: C.CollectiveContext) -> dict[str, Any]:
    """One step as ``amsp train`` runs it (runtime/step.py), every phase timed: step time, loss,
    window, phases."""
    from amsp_ext.common.models import causal_lm_loss
    from amsp_ext.runtime.step import train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    M, optim = config.batch.num_micro_batches, OptimOptions()
    phases: dict[str, list[tuple[float, float]]] = {"forward": [], "backward": [], "optimizer": []}

    @contextlib.contextmanager
    def timed(name: str):
        t0 = time.perf_counter()
        yield
        _sync(device)
        phases[name].append((t0, time.perf_counter()))

    t_start = time.perf_counter()
    batches = [_batch(config, step, micro, rank, world, device) for micro in range(M)]
    done = train_step(model, opt, batches, causal_lm_loss, clip=optim.clip, phase=timed)
    step_loss = torch.zeros((), device=device)
    for loss in done.losses:
        step_loss += (loss / M).float()
    t_opt_end = phases["optimizer"][-1][1]
    C.all_reduce(comm, step_loss, dist.group.WORLD, name="world", stream=None,
                 async_op=False, timeout=config.engine.timeout)  # blocking, after _sync
    t_end = time.perf_counter()
    phases["loss_sync"] = [(t_opt_end, t_end)]
    return {"step_s": t_end - t_start, "loss": float(step_loss.item()),
            "window": (t_start, t_end), "phases": phases}


def _destroy_new_groups(groups_before: set) -> None:
    """The process groups made since ``groups_before`` (the plan's), destroyed."""
    # [Note: one plan's process groups] Every shard() builds its plan's groups (13 on 2 x 2, each
    # with gloo threads). Kept, they pile up over the rounds (hundreds of groups, thousands of
    # threads) and the system time they cost slowed the later plans of a 54-plan run 4x; so
    # each plan's groups go with it. Every rank destroys the same groups in the same order.
    for group in [g for g in compat.live_process_groups() if g not in groups_before]:
        dist.destroy_process_group(group)


def _trim_heap() -> None:
    """glibc's malloc_trim(0): return freed heap pages to the OS (CPU peak-memory figures)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure is an upper bound of reuse
        pass


def cpu_counters() -> dict[str, Any]:
    """This host's busy CPU seconds (/proc/stat) and this process's CPU seconds, now."""
    import resource
    import socket

    busy = None
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / hz  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"t": time.perf_counter(), "host_busy_s": busy, "own_s": ru.ru_utime + ru.ru_stime,
            "host": socket.gethostname(), "cores": os.cpu_count()}


def cpu_delta(before: dict[str, Any]) -> dict[str, Any]:
    """CPU use since ``before``: the host's busy seconds and this process's, over the wall time.
    Rank 0 subtracts every local rank's own seconds to get what other jobs used."""
    now = cpu_counters()
    busy = (None if before["host_busy_s"] is None or now["host_busy_s"] is None
            else now["host_busy_s"] - before["host_busy_s"])
    return {"wall_s": now["t"] - before["t"], "host_busy_s": busy,
            "own_s": now["own_s"] - before["own_s"], "host": now["host"], "cores": now["cores"]}


def _phase_times(trace: CommTrace, phases: dict[str, list[tuple[float, float]]]
                 ) -> dict[str, dict[str, float]]:
    """Per phase: wall seconds, and seconds blocked in waits for collectives (any kind)."""
    out = {}
    for name, spans in phases.items():
        blocked = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in spans
                      for _, a, b in trace.waits)
        out[name] = {"wall_s": sum(t1 - t0 for t0, t1 in spans), "blocked_s": blocked}
    return out


def run_rounds(config: TuneConfig, candidates: list[Candidate], *, gpus_per_node: int, device,
               comm: C.CollectiveContext,
               on_done: Callable[[int, int, Candidate, dict], None] | None = None
               ) -> dict[str, Any]:
    """Every round (probe, then every plan in the round's order); this rank's records, every
    collective through the run's ``comm``."""
    from amsp_ext.compare.rounds import round_order

    probes, runs = [], []
    total = config.tune.repeats * len(candidates)
    done = 0
    for r in range(config.tune.repeats):
        load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        probes.append({"round": r + 1, **compute_probe(config, device, comm), "load": load})
        for position, cand in enumerate(round_order(candidates, r)):
            t0 = time.time()
            rec = measure_plan(config, cand, gpus_per_node=gpus_per_node, device=device, comm=comm)
            rec.update(plan=cand.key, round=r + 1, position=position + 1, started_at=t0,
                       load=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)
            runs.append(rec)
            done += 1
            if on_done is not None:
                on_done(done, total, cand, rec)
    return {"rank": dist.get_rank(), "probes": probes, "runs": runs}
