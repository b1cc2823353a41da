"""torchrun worker for the engine tests: runs many cases in ONE launch.

Each case shards a fresh tiny-llama under a plan and trains ``STEPS`` steps of M micro-batches
of real text. The parity suites decide nothing: they write, per case and rank, a file into
OUTDIR (see tests/parity_check.py: per-step losses, per-step owned fp32 masters of rank 0's
``optim`` group, final local parameters) and pytest compares them with a single-process
reference at every step. The other suites print ``RESULT {json}`` lines.

Usage: python -m tests.engine_worker SUITE[,SUITE...] [R] [OUTDIR] [STEPS]  (SUITE in parity,
extras, guards, trace, memory; several run in one launch, each writing into OUTDIR/SUITE;
STEPS, for parity alone, overrides its number of steps)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.planner.plan import Plan, check_plan, named_plan, parse_plan
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import FP16Config, OverlapConfig, ShardConfig
from amsp_ext.runtime.shard import shard
from tests.dist_utils import end_worker, free_plan_groups
from tests.parity_check import M, MBS, SEQ, STEPS, adamw

OUTDIR: str | None = None


def prefiltered_plans(R, N):
    import itertools
    d0 = [d for d in range(1, R + 1) if R % d == 0]
    d1 = [d for d in range(1, N + 1) if N % d == 0]
    out = []
    for f in itertools.product(d0, d1, d0, d1, d0, d1):
        p = Plan(s0_p=f[0], s1_p=f[1], s0_g=f[2], s1_g=f[3], s0_os=f[4], s1_os=f[5])
        if not check_plan(p, gpus_per_node=R, num_nodes=N):
            out.append(p)
    return out


def owned_masters(model, opt):
    """{name: (shard index, fp32 master)} of this rank's owned tensors, if this rank is in rank 0's
    ``optim`` group (whose ranks own every local tensor exactly once), else {}."""
    e = model.amsp
    if 0 not in e.mesh.ranks["optim"]:
        return {}
    return {e.tensors[i].name: (e.tensors[i].shard_index, m.detach().float().clone())
            for i, m in opt.masters.items()}


def train(plan, config, *, world, clip=None, boundary_api="no_sync", inject=None, sched=False,
          tied=False, after_step=None, num_steps=STEPS):
    model = build_llama("tiny-llama", seed=0, **({"tie_word_embeddings": True} if tied else {}))
    model, opt = shard(model, plan, adamw, config=config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if sched else None
    rank = dist.get_rank()
    losses, norms, steps = [], [], []
    for step in range(num_steps):
        total = torch.zeros(1)
        for m in range(M):
            b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                            micro_batch_size=MBS, seq_len=SEQ)
            last = m == M - 1
            if boundary_api == "no_sync":
                ctx = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_gradient_accumulation_boundary(last)
                ctx = contextlib.nullcontext()
            with ctx:
                loss = causal_lm_loss(model, b) / M
                if inject is not None and inject(step, m):
                    loss = loss * float("inf")
                opt.backward(loss)
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        steps.append(owned_masters(model, opt))
        if after_step is not None:
            after_step(model)
    model.amsp.wait_params()
    return model, opt, {"losses": losses, "norms": norms, "masters": steps}


@contextlib.contextmanager
def unit_bucket_floor(nbytes):
    """Buckets close at unit boundaries from ``nbytes`` on (planner/buckets.py
    UNIT_BUCKET_MIN_BYTES) inside the block: tiny-llama's units are all under the 1 MiB default."""
    from amsp_ext.planner import buckets

    floor = buckets.UNIT_BUCKET_MIN_BYTES
    buckets.UNIT_BUCKET_MIN_BYTES = nbytes
    try:
        yield
    finally:
        buckets.UNIT_BUCKET_MIN_BYTES = floor


def record(name, model, run, extra=None):
    """Write this rank's view of case ``name`` for pytest (tests/parity_check.load_cases)."""
    e = model.amsp
    final = {t.name: (t.shard_index, t.local().detach().clone()) for t in e.tensors}
    out = {"case": name, "rank": dist.get_rank(), "sp": e.plan.sp, "extra": extra or {},
           "losses": run["losses"], "norms": run["norms"], "masters": run["masters"], "final": final}
    slug = re.sub(r"[^A-Za-z0-9_.=+-]", "_", name)
    torch.save(out, os.path.join(OUTDIR, f"{slug}.rank{dist.get_rank()}.pt"))


def release(model, *, free_groups=True):
    """End of a case: detach the engine's hooks and free its plan's process groups.

    [Note: one case's process groups]
    Every ``shard()`` builds its plan's groups (at most 7 on 2 x 2, each with gloo threads; ~13
    when these figures were taken, before topology/mesh.py built only the used ones). Kept, they
    pile up over a launch's cases: on 4 ranks a second pass over the 18 parity cases took 331 s
    instead of 45 s (1,400 threads per rank); freed, 62 s. The trace and guard suites keep
    theirs: after a freed mesh, DTensor's full_tensor on the next mesh with the same layout
    failed with "Could not resolve the process group registered under the name 30"."""
    model.amsp.wait_params()
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    if free_groups:
        free_plan_groups(model.amsp.mesh)


def suite_parity(world, R, num_steps=STEPS):
    """fp32 on every pre-filtered plan; on 2 x 2 also bf16 with fp32 reduction on every one."""
    N = world // R
    plans = prefiltered_plans(R, N)
    named = {n: named_plan(n, gpus_per_node=R, num_nodes=N) for n in ("ddp", "zero1", "zero3", f"mics:{R}")}
    for n, p in named.items():
        assert p in plans, (n, p)  # the named baselines are among the pre-filtered plans
    if dist.get_rank() == 0:
        print("PLANS " + json.dumps([str(p) for p in plans]) + " NAMED " +
              json.dumps({k: str(v) for k, v in named.items()}), flush=True)
    precisions = ("fp32", "bf16") if world == 4 else ("fp32",)
    for prec in precisions:
        for p in plans:
            t0 = time.perf_counter()
            model, opt, run = train(p, ShardConfig(gpus_per_node=R, timeout=120, precision=prec,
                                                   reduce_dtype="fp32"), world=world, num_steps=num_steps)
            record(f"{prec}:{p}", model, run, extra={"seconds": time.perf_counter() - t0})
            if dist.get_rank() == 0:
                print(f"CASE {prec}:{p} {time.perf_counter() - t0:.2f}s threads={_threads()}", flush=True)
            release(model)


def _threads():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Threads:"))


def _bytes(model):
    b = model.model_state_bytes()
    tot = torch.tensor([float(b["total"])])
    lo, hi = tot.clone(), tot.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return {"state_bytes": b, "state_total_min": float(lo), "state_total_max": float(hi)}


def suite_extras(world, R):
    """16-bit reduction, fp16, recompute, clipping, sg strictly between sp and sos, ablations, APIs."""
    cfg = lambda **kw: ShardConfig(gpus_per_node=R, timeout=120, **kw)  # noqa: E731
    for p in ("ddp", "p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2", "zero3"):
        model, opt, run = train(p, cfg(precision="bf16", reduce_dtype="bf16"), world=world)
        record(f"bf16-reduce-bf16:{p}", model, run, extra=_bytes(model))
        release(model)
    fp16 = FP16Config(initial_scale=1024.0)
    for p, red in (("p=1x1,g=1x1,os=2x2", "fp16"), ("p=2x1,g=2x2,os=2x2", "fp32")):
        model, opt, run = train(p, cfg(precision="fp16", reduce_dtype=red, fp16=fp16), world=world)
        record(f"fp16-reduce-{red}:{p}", model, run, extra={"skipped": opt.skipped_steps})
        release(model)
    # an injected overflow: step 2 is skipped on every rank, the scale backs off
    model, opt, run = train("p=2x1,g=2x2,os=2x2", cfg(precision="fp16", reduce_dtype="fp16", fp16=fp16),
                            world=world, inject=lambda s, m: s == 2 and m == 1)
    record("fp16-overflow:p=2x1,g=2x2,os=2x2", model, run,
           extra={"skipped": opt.skipped_steps, "scale": opt.loss_scale})
    release(model)
    # recompute keeps the recompute-forward gather for backward: AG count unchanged
    for p in ("p=2x1,g=2x1,os=2x2", "p=2x2,g=2x2,os=2x2"):
        counts = {}
        for rc in (False, True):
            model, opt, run = train(p, cfg(recompute=rc), world=world)
            counts[rc] = model.amsp.comm.counts[("all_gather", "param_shard")]  # this engine's
            units = sum(1 for u in model.amsp.units if u.params)
            if not rc:
                release(model)
        record(f"recompute:{p}", model, run,
               extra={"ag_per_micro_batch": counts[True] / (STEPS * M),
                      "ag_per_micro_batch_no_recompute": counts[False] / (STEPS * M),
                      "num_units": units})
        release(model)
    for p in ("ddp", "p=1x1,g=1x1,os=2x2", "p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2", "zero3"):
        model, opt, run = train(p, cfg(), world=world, clip=0.05)
        record(f"clip:{p}", model, run)
        release(model)
    cases = [
        ("sg-between:p=1x1,g=2x1,os=2x2", "p=1x1,g=2x1,os=2x2", {}, {}),
        ("overlap-off:p=2x1,g=2x2,os=2x2", "p=2x1,g=2x2,os=2x2",
         {"overlap": OverlapConfig(allgather=False, allreduce=False, broadcast=False)}, {}),
        ("small-buckets:p=2x1,g=2x2,os=2x2", "p=2x1,g=2x2,os=2x2", {"grad_bucket_bytes": 4096}, {}),
        ("blocks:p=1x1,g=2x2,os=2x2", "p=1x1,g=2x2,os=2x2", {"ownership": "blocks"}, {}),
        ("layer-granularity:p=2x1,g=2x1,os=2x2", "p=2x1,g=2x1,os=2x2", {"granularity": "layer"}, {}),
    ]
    for name, p, ckw, tkw in cases:
        model, opt, run = train(p, cfg(**ckw), world=world, **tkw)
        record(name, model, run, extra={
            "num_buckets": len(model.amsp.grad_sync.buckets),
            "num_units": len([u for u in model.amsp.units if u.params]),
            "counts": {f"{op}:{kind}": n for (op, kind), n in model.amsp.comm.counts.items()}})
        release(model)
    # two-level all-reduce (collectives.py [Note: two-level all-reduce]): the replica group of
    # DDP (2 x 2) and, with sg = 2 x 2 > sp, the Tg group too; 4 KiB buckets keep several chains
    # in flight (advanced from the hooks) and give buckets of odd sizes (padded to split in two);
    # "two-level:ddp" closes a bucket per unit (as a larger model's are, grad_sync.py [Note:
    # buckets close at unit boundaries]), all of them in flight at the flush
    for name, p, ckw in (("two-level:ddp", "ddp", {}),
                         ("two-level-small-buckets:ddp", "ddp", {"grad_bucket_bytes": 4096}),
                         ("two-level-small-buckets:p=1x1,g=2x2,os=2x2", "p=1x1,g=2x2,os=2x2",
                          {"grad_bucket_bytes": 4096})):
        gathers = {"in_flight": 0, "max": 0}

        def in_node_gathers(event, op, group, info, gathers=gathers):
            """How many in-node all-gathers are in flight at once (issued, not yet waited)."""
            if op == "all_gather" and group.split("[")[0].endswith("_local"):
                gathers["in_flight"] += {"issue": 1, "wait_end": -1}.get(event, 0)
                gathers["max"] = max(gathers["max"], gathers["in_flight"])

        def watch(model, fn=in_node_gathers):  # from the second step on
            if fn not in model.amsp.comm.observers:
                model.amsp.comm.observers.append(fn)

        floor = unit_bucket_floor(1024) if name == "two-level:ddp" else contextlib.nullcontext()
        with floor:
            model, opt, run = train(p, cfg(all_reduce="two_level", **ckw), world=world, after_step=watch)
        counts = model.amsp.comm.counts
        record(name, model, run, extra={
            "counts": {f"{op}:{kind}": n for (op, kind), n in counts.items()},
            "num_buckets": len(model.amsp.grad_sync.buckets),
            "max_local_gathers_in_flight": gathers["max"]})
        release(model)
    # buckets closed at unit boundaries (planner/buckets.py [Note: buckets close at unit boundaries])
    # with a floor small enough for tiny-llama's units (its whole gradient is under the 1 MiB
    # default): one bucket per unit, for sp = 1 and for sp > 1 (after FSDP2's reduce-scatter)
    with unit_bucket_floor(1024):
        for p in ("p=1x1,g=2x2,os=2x2", "p=2x1,g=2x2,os=2x2"):
            model, opt, run = train(p, cfg(), world=world)
            record(f"unit-buckets:{p}", model, run,
                   extra={"num_buckets": len(model.amsp.grad_sync.buckets),
                          "num_units": len([u for u in model.amsp.units if u.params])})
            release(model)
    # packed broadcasts under a budget small enough that only the smallest tensors are packed
    # (tiny-llama's local tensors are 128 B .. 32 KiB at sp = 2, about 250 KiB in all)
    model, opt, run = train("p=2x1,g=2x1,os=2x2", cfg(ownership="blocks", grad_bucket_bytes=32768),
                            world=world)
    ps = model.amsp.param_sync
    record("coalesced-broadcasts:p=2x1,g=2x1,os=2x2", model, run,
           extra={"num_items": len(ps.items), "num_packed": sum(it.packed for it in ps.items),
                  "num_packed_tensors": sum(len(it.tensors) for it in ps.items if it.packed),
                  "num_tensors": len(ps.tensors), "peak_staging": ps.peak_staging,
                  "staging_limit": ps.staging_limit})
    release(model)
    for p in ("p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2"):
        model, opt, run = train(p, cfg(), world=world, tied=True)
        record(f"tied-embeddings:{p}", model, run,
               extra={"root_unit_params": len(model.amsp.units[0].params)})
        release(model)
    # torch.optim.swa_utils over a sharded model: an unsharded AveragedModel fed after each step
    import copy

    from torch.optim import swa_utils

    swa = swa_utils.AveragedModel(build_llama("tiny-llama", seed=0))

    def average(model):
        model.amsp.wait_params()
        swa.update_parameters(model)

    model, opt, run = train("p=1x1,g=1x1,os=2x2", cfg(), world=world, after_step=average)
    try:
        copy.deepcopy(model)
        deepcopy_error = None
    except ValueError as e:
        deepcopy_error = str(e)
    record("swa:p=1x1,g=1x1,os=2x2", model, run,
           extra={"swa": {n: p.detach().clone() for n, p in swa.module.named_parameters()},
                  "n_averaged": int(swa.n_averaged), "deepcopy_error": deepcopy_error})
    release(model)
    model, opt, run = train("p=1x1,g=2x2,os=2x2", cfg(), world=world, boundary_api="set_boundary",
                            sched=True)
    sd = opt.state_dict()
    opt.load_state_dict(sd)  # same plan: round trip, re-broadcast
    meta_ok = all(set(m) == {"name", "global_shape", "local_shape", "shard_index", "owner"}
                  for m in sd["amsp"]["tensors"])
    run["masters"][-1] = owned_masters(model, opt)  # what the round trip left
    record("boundary-api+lr-schedule+state-dict:p=1x1,g=2x2,os=2x2", model, run,
           extra={"metadata_ok": meta_ok, "num_owned": len(sd["amsp"]["tensors"]),
                  "num_steps": opt.num_steps})
    release(model)


def _emit(obj):
    """Every rank prints its own line (guards run after collectives may have broken)."""
    # one write() per line: lines of several ranks sharing the pipe stay whole
    sys.stdout.write("RESULT " + json.dumps({"rank": dist.get_rank(), **obj}) + "\n")
    sys.stdout.flush()


def suite_guards(world, R):
    from torch.distributed import distributed_c10d as c10d

    from amsp_ext.planner.plan import PlanError
    from amsp_ext.runtime.preflight import MismatchError

    rank = dist.get_rank()
    # 1. a plan that does not fit the world: refused before any collective or process group
    for plan, kw in (("p=4x1,g=4x1,os=4x1", {}), ("p=1x1,g=1x1,os=2x1", {"gpus_per_node": 3}),
                     ("mics:3", {}), ("p=2x1,g=1x1,os=2x1", {})):
        comm, groups = C.CollectiveContext(timeout=30), len(c10d._world.pg_map)
        try:
            shard(build_llama("tiny-llama"), plan, adamw,
                  config=ShardConfig(**{"gpus_per_node": R, "timeout": 30, **kw}), comm=comm)
            err = None
        except PlanError as e:
            err = str(e)
        _emit({"case": f"unfit:{plan}:{kw}", "error": err,
               "collectives_issued": sum(comm.counts.values()),
               "groups_created": len(c10d._world.pg_map) - groups})
    # 1b. a legal plan: the engine builds only the groups it issues collectives on
    #     (topology/mesh.py [Note: only the groups the plan issues collectives on])
    for plan, kw in (("p=1x1,g=1x1,os=1x1", {}), ("p=1x1,g=1x1,os=1x1", {"all_reduce": "two_level"}),
                     ("p=2x1,g=2x1,os=2x2", {})):
        groups = len(c10d._world.pg_map)
        model, _ = shard(build_llama("tiny-llama"), plan, adamw,
                         config=ShardConfig(**{"gpus_per_node": R, "timeout": 30, **kw}))
        _emit({"case": f"groups:{plan}:{kw}", "groups_created": len(c10d._world.pg_map) - groups})
        release(model)
    # 2. ranks with different plans (and configs) are detected at init on every rank
    for what, plan, cfg in (
        ("plan", "p=1x1,g=1x1,os=2x1" if rank == world - 1 else "p=1x1,g=1x1,os=2x2", {}),
        ("config", "p=1x1,g=1x1,os=2x2", {"precision": "bf16"} if rank == 1 else {}),
    ):
        try:
            shard(build_llama("tiny-llama"), plan, adamw,
                  config=ShardConfig(gpus_per_node=R, timeout=30, **cfg))
            err = None
        except MismatchError as e:
            err = str(e)
        _emit({"case": f"mismatch:{what}", "error": err})
    # 2b. a rank-dependent seed: rank 0's weights everywhere (broadcast), or refused (check)
    from amsp_ext.runtime.state.export import consolidated_state_dict

    model, _ = shard(build_llama("tiny-llama", seed=rank), "p=2x1,g=2x1,os=2x2", adamw,
                     config=ShardConfig(gpus_per_node=R, timeout=30))
    got = consolidated_state_dict(model, rank0_only=False)
    ref = build_llama("tiny-llama", seed=0).state_dict()
    other = build_llama("tiny-llama", seed=1).state_dict()
    release(model, free_groups=False)
    errors = {}
    for same, seed in ((False, rank), (True, 0)):
        try:
            m, _ = shard(build_llama("tiny-llama", seed=seed), "p=1x1,g=1x1,os=2x2", adamw,
                         config=ShardConfig(gpus_per_node=R, timeout=30, init_weights="check"))
            release(m, free_groups=False)
            errors[same] = None
        except MismatchError as e:
            errors[same] = str(e)
    _emit({"case": "init-weights", "keys": len(got),
           "max_abs_diff_to_rank0_seed": max(float((got[k] - ref[k]).abs().max()) for k in got),
           "max_abs_diff_between_seeds": max(float((other[k] - ref[k]).abs().max()) for k in got),
           "check_error_rank_seed": errors[False], "check_error_same_seed": errors[True]})
    # 3. plan "auto": the planner's choice, the same on every rank, and it trains
    from amsp_ext.planner.search import plan_for
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
    from amsp_ext.runtime.config import AutoPlanConfig

    auto = AutoPlanConfig(seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M,
                          gpu_memory_bytes=4 * 2**30, profile="paper-a800")
    try:
        shard(build_llama("tiny-llama"), "auto", adamw, config=ShardConfig(gpus_per_node=R))
        missing_err = None
    except PlanError as e:
        missing_err = str(e)
    model, opt, run = train("auto", ShardConfig(gpus_per_node=R, timeout=60, auto=auto), world=world)
    losses = run["losses"]
    direct = plan_for(build_llama("tiny-llama").config.to_dict(),
                      ClusterSpec(num_nodes=world // R, gpus_per_node=R, gpu_memory_bytes=4 * 2**30),
                      TrainingSpec(seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M,
                                   precision="fp32"), "paper-a800")
    _emit({"case": "auto", "plan": str(model.amsp.plan), "planner_direct": str(direct),
           "losses": losses, "missing_config_error": missing_err})
    release(model, free_groups=False)
    dist.barrier()
    # 4. a rank that skips its broadcasts: the others time out with the group's name
    model, opt = shard(build_llama("tiny-llama"), "p=1x1,g=1x1,os=2x1", adamw,
                       config=ShardConfig(gpus_per_node=R, timeout=3))
    b = micro_batch(0, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=MBS, seq_len=SEQ)
    opt.backward(causal_lm_loss(model, b))
    real = C.broadcast
    if rank == 1:
        C.broadcast = lambda *a, **k: None  # this rank "dies" before its broadcasts
    err = None
    t0 = time.perf_counter()
    try:
        opt.step()
        model(input_ids=b[:, :-1])  # the forward pre-hooks wait for the broadcasts
        model.amsp.wait_params()
    except C.CollectiveTimeout as e:
        err = str(e)
    C.broadcast = real
    _emit({"case": "timeout", "error": err, "seconds": time.perf_counter() - t0,
           "group": model.amsp.name("optim_bcast")})
    sys.stdout.flush()
    if rank == 1:
        time.sleep(6)  # stay alive: the others must hit the timeout, not a closed connection
    os._exit(0)  # the broken group cannot be torn down cleanly


def suite_trace(world, R):
    """Profiler trace: amsp:: labels, and where the broadcast waits of step k happen."""
    from torch.profiler import ProfilerActivity, profile, record_function

    rank = dist.get_rank()
    out = {}
    for overlap in (True, False):
        model, opt = shard(build_llama("tiny-llama"), "p=2x1,g=2x2,os=2x2", adamw,
                           config=ShardConfig(gpus_per_node=R, timeout=60,
                                              overlap=OverlapConfig(broadcast=overlap)))
        model.amsp.param_sync.log = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(3):
                for m in range(M):
                    b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                                    micro_batch_size=MBS, seq_len=SEQ)
                    with (model.no_sync() if m < M - 1 else contextlib.nullcontext()):
                        with record_function(f"test::forward::{step}::{m}"):
                            loss = causal_lm_loss(model, b) / M
                        with record_function(f"test::backward::{step}::{m}"):
                            opt.backward(loss)
                with record_function(f"test::step::{step}"):
                    with opt.broadcast_under_next_forward():  # the overlap under test
                        opt.step()
                    opt.zero_grad()
            # gloo ends an async op's profiler range on its own thread: finish them all
            # before the profiler stops (else the profiler's collection asserts)
            with record_function("test::drain"):
                # a state_dict taken while step 2's broadcasts are in flight waits for them
                busy = [model.amsp.param_sync.busy]
                model.state_dict()
                busy.append(model.amsp.param_sync.busy)
                model.amsp.wait_params()
        events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
        labels = sorted({n for n, _, _ in events if n.startswith("amsp::")})
        fwd = {n: (s, e) for n, s, e in events if n.startswith("test::forward::")}
        stp = {n: (s, e) for n, s, e in events if n.startswith("test::step::")}
        waits = [(s, e) for n, s, e in events if n == "amsp::wait::broadcast::optim_bcast"]
        where = {"forward": 0, "step": 0, "drain": 0, "other": 0}
        for s, e in waits:
            if any(a <= s and e <= b for a, b in fwd.values()):
                where["forward"] += 1
            elif any(a <= s and e <= b for a, b in stp.values()):
                where["step"] += 1
            elif any(a <= s and e <= b for n, a, b in events if n == "test::drain"):
                where["drain"] += 1  # the last step's broadcasts (no next forward)
            else:
                where["other"] += 1
        # event order from the engine's own log: a step's broadcasts are all issued before
        # the first wait, and the waits come after the next forward started
        log = model.amsp.param_sync.log
        first_wait = next((i for i, (k, _) in enumerate(log) if k == "wait"), None)
        out[str(overlap)] = {"labels": labels, "bcast_waits": where,
                             "num_items": len(model.amsp.param_sync.items),
                             "busy_before_after_state_dict": busy,
                             "num_tensors": len(model.amsp.param_sync.tensors),
                             "issued_before_first_wait": sum(1 for k, _ in log[:first_wait] if k == "issue")
                             if first_wait is not None else None}
        release(model, free_groups=False)
    if rank == 0:
        print("RESULT " + json.dumps({"case": "trace", **out}), flush=True)


def suite_memory(world, R):
    """Measured model-state bytes per rank vs the planner's memory model (amsp_ext.planner.memory)
    for every pre-filtered plan, in bf16 with bf16 reduction (the paper's 2/2/12 bytes) and fp32
    (4/4/8), and on four plans (one per gradient mode) bf16 with fp32 reduction (2/4/12)."""
    from amsp_ext.planner.memory import memory_breakdown
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.planner.specs import TrainingSpec

    spec = ModelSpec.from_hf_config(build_llama("tiny-llama").config.to_dict())
    every = prefiltered_plans(R, world // R)
    some = [parse_plan(t) for t in ("p=1x1,g=1x1,os=1x1", "p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2",
                                    "p=2x2,g=2x2,os=2x2")]
    for precision, reduce_dtype, plans in (("bf16", "bf16", every), ("fp32", "fp32", every),
                                           ("bf16", "fp32", some)):
        training = TrainingSpec(seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M,
                                precision=precision, reduce_dtype=reduce_dtype)
        for p in plans:
            # one step (M micro-batches) allocates everything a step holds: the peak gradient
            # storage of a backward, the masters and the optimizer states
            model, opt, _ = train(p, ShardConfig(gpus_per_node=R, precision=precision,
                                                 reduce_dtype=reduce_dtype), world=world, num_steps=1)
            b = model.model_state_bytes()
            pred = memory_breakdown(spec, p, training, gpus_per_node=R, num_nodes=world // R)
            rel = torch.tensor([abs(b["total"] / pred.model_states - 1)])
            dist.all_reduce(rel, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({
                    "case": f"{precision}-reduce-{reduce_dtype}:{p}",
                    "predicted": {"params": pred.params, "grads": pred.grads, "optim": pred.optim},
                    "measured_rank0": b, "worst_rank_rel_err": float(rel)}), flush=True)
            release(model)


SUITES = {"memory": suite_memory, "parity": suite_parity, "extras": suite_extras, "guards": suite_guards,
          "trace": suite_trace}


def main():
    """SUITE may name several suites (``parity,extras,memory``): one launch runs them in order,
    each writing into OUTDIR/<suite>. ``guards`` breaks a group on purpose and ends the
    process, so it can only come last."""
    global OUTDIR
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    suites = sys.argv[1].split(",")
    assert "guards" not in suites[:-1], "guards ends the launch: put it last"
    world = dist.get_world_size()
    R = int(os.environ["LOCAL_WORLD_SIZE"]) if len(sys.argv) < 3 else int(sys.argv[2])
    root = sys.argv[3] if len(sys.argv) > 3 else None
    steps = {"num_steps": int(sys.argv[4])} if len(sys.argv) > 4 else {}  # parity only
    t0 = time.perf_counter()
    for suite in suites:
        torch.manual_seed(0)
        OUTDIR = os.path.join(root, suite) if root else None
        if OUTDIR and dist.get_rank() == 0:
            os.makedirs(OUTDIR, exist_ok=True)
        dist.barrier()
        t = time.perf_counter()
        SUITES[suite](world, R, **(steps if suite == "parity" else {}))
        if dist.get_rank() == 0:
            print(f"SUITE {suite} {time.perf_counter() - t:.1f}s", flush=True)
    end_worker(t0)


if __name__ == "__main__":
    main()
