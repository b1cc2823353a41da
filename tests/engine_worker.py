"""torchrun worker for the engine tests: runs many cases in ONE launch, prints ``RESULT {json}``.

Each case shards a fresh tiny-llama under a plan, trains ``steps`` steps of M micro-batches of
real text and compares per-step losses and final parameters with a single-process reference
trained on the same global batches (computed once per launch on rank 0 and broadcast).

Usage: python -m tests.engine_worker SUITE  (SUITE in parity, extras, guards)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.data import micro_batch
from amsp_ext.models import build_llama, causal_lm_loss
from amsp_ext.planner.plan import Plan, check_plan, named_plan
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import FP16Config, OverlapConfig, ShardConfig
from amsp_ext.runtime.engine import shard
from torch.distributed.tensor import DTensor
from tests.dist_utils import end_worker

STEPS, M, MBS, SEQ, LR = 5, 2, 1, 32, 1e-3


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


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


def batches(step, world):
    return [torch.cat([micro_batch(step, m, r, world_size=world, num_micro_batches=M,
                                   micro_batch_size=MBS, seq_len=SEQ) for r in range(world)])
            for m in range(M)]


def reference(world, *, precision="fp32", clip=None, skip=(), sched=False, tied=False):
    """Single process, whole global batch: fp32 AdamW; under bf16/fp16 the same mixed-precision
    recipe as the engine (compute-dtype params and grads, fp32 masters and states)."""
    model = build_llama("tiny-llama", seed=0, **({"tie_word_embeddings": True} if tied else {}))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    if dtype != torch.float32:
        bufs = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
        model.to(dtype)
        for m, n, b in bufs:
            m._buffers[n] = b
    opt = adamw(masters if dtype != torch.float32 else list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if sched else None
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for b in batches(step, world):
            loss = causal_lm_loss(model, b) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step in skip:  # the engine skips this step (fp16 overflow)
            opt.zero_grad()
            for p in model.parameters():
                p.grad = None
            continue
        if dtype != torch.float32:
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
        params = masters if dtype != torch.float32 else list(model.parameters())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
    final = {n: (m if dtype != torch.float32 else p).detach().float().clone()
             for (n, p), m in zip(model.named_parameters(), masters)}
    compute = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": final, "compute_params": compute}


def shared_reference(world, **kw):
    """Rank 0 computes, everyone receives (a plain broadcast of the test harness)."""
    obj = [reference(world, **kw) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def full_params(model):
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = t.detach().float()
    return out


def train(plan, config, *, world, clip=None, boundary_api="no_sync", inject=None, sched=False,
          tied=False):
    model = build_llama("tiny-llama", seed=0, **({"tie_word_embeddings": True} if tied else {}))
    model, opt = shard(model, plan, adamw, config=config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if sched else None
    rank = dist.get_rank()
    losses, norms = [], []
    for step in range(STEPS):
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
    model.amsp.wait_params()
    return model, opt, losses, norms


def master_diff(ref, model, opt):
    """(max |owned fp32 master - reference master|, relative L2 error of the update
    ||master - ref|| / ||ref - init||), over the owned tensors (the owner's shard if sp > 1)."""
    e = model.amsp
    init = dict(build_llama("tiny-llama", seed=0).named_parameters())
    d, num, den = 0.0, torch.zeros(1), torch.zeros(1)
    for idx, m in opt.masters.items():
        t = e.tensors[idx]
        full, start = ref["params"][t.name], init[t.name].detach()
        if e.plan.sp > 1:
            full = full.chunk(e.plan.sp, dim=0)[t.shard_index]
            start = start.chunk(e.plan.sp, dim=0)[t.shard_index]
        d = max(d, float((m.detach() - full).abs().max()))
        num += float(((m.detach() - full) ** 2).sum())
        den += float(((full - start) ** 2).sum())
    both = torch.cat([num, den])
    dist.all_reduce(both)  # replicas repeat numerator and denominator alike
    return d, float(both[0].sqrt() / both[1].sqrt())


def compare(name, ref, model, losses, norms=(), extra=None, opt=None):
    got = full_params(model)
    pdiff = torch.zeros(1)
    low_precision = next(model.parameters()).dtype != torch.float32
    rel_update = None
    if low_precision:
        d, rel_update = master_diff(ref, model, opt)
        pdiff = torch.tensor([d])
    else:
        for n, t in ref["params"].items():
            pdiff = torch.maximum(pdiff, (got[n] - t).abs().max().reshape(1))
    ldiff = torch.tensor([max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])
                              if math.isfinite(a))])
    ndiff = torch.tensor([max((abs(a - b) / b for a, b in zip(norms, ref["norms"])), default=0.0)])
    for t in (pdiff, ldiff, ndiff):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # worst rank
    res = {"case": name, "param_max_abs_diff": float(pdiff), "loss_max_rel_diff": float(ldiff),
           "master_update_rel_l2": rel_update,
           "norm_max_rel_diff": float(ndiff), "losses": losses, "ref_losses": ref["losses"],
           **(extra or {})}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    return res


def release(model):
    """Detach the engine's hooks so a launch can loop over many plans (groups stay cached)."""
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()


def suite_parity(world, R):
    N = world // R
    plans = prefiltered_plans(R, N)
    named = {n: named_plan(n, gpus_per_node=R, num_nodes=N) for n in ("ddp", "zero1", "zero3", f"mics:{R}")}
    for n, p in named.items():
        assert p in plans, (n, p)  # the named baselines are among the pre-filtered plans
    ref = shared_reference(world)
    if dist.get_rank() == 0:
        print("PLANS " + json.dumps([str(p) for p in plans]) + " NAMED " +
              json.dumps({k: str(v) for k, v in named.items()}), flush=True)
    for p in plans:
        t0 = time.perf_counter()
        model, opt, losses, _ = train(p, ShardConfig(gpus_per_node=R, timeout=120), world=world)
        compare(str(p), ref, model, losses, extra={"seconds": time.perf_counter() - t0})
        release(model)


def _bytes(model):
    b = model.model_state_bytes()
    tot = torch.tensor([float(b["total"])])
    lo, hi = tot.clone(), tot.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return {"state_bytes": b, "state_total_min": float(lo), "state_total_max": float(hi)}


def suite_extras(world, R):
    """bf16/fp16, recompute, clipping, sg strictly between sp and sos, ablations, APIs."""
    cfg = lambda **kw: ShardConfig(gpus_per_node=R, timeout=120, **kw)  # noqa: E731
    ref32 = shared_reference(world)
    refs = {"bf16": shared_reference(world, precision="bf16"),
            "fp16": shared_reference(world, precision="fp16")}
    for prec in ("bf16",):
        for p in ("ddp", "p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2", "zero3"):
            model, opt, losses, _ = train(p, cfg(precision=prec), world=world)
            compare(f"{prec}:{p}", refs[prec], model, losses, opt=opt,
                    extra={"vs_fp32": compare_quiet(ref32, model, losses), **_bytes(model)})
    for p in ("p=1x1,g=1x1,os=2x2", "p=2x1,g=2x2,os=2x2"):
        model, opt, losses, _ = train(p, cfg(precision="fp16", fp16=FP16Config(initial_scale=1024.0)), world=world)
        compare(f"fp16:{p}", refs["fp16"], model, losses, opt=opt, extra={"skipped": opt.skipped_steps})
    # an injected overflow: step 2 is skipped on every rank, the scale backs off
    ref_skip = shared_reference(world, precision="fp16", skip=(2,))
    model, opt, losses, _ = train("p=2x1,g=2x2,os=2x2",
                                  cfg(precision="fp16", fp16=FP16Config(initial_scale=1024.0)),
                                  world=world, inject=lambda s, m: s == 2 and m == 1)
    compare("fp16-overflow:p=2x1,g=2x2,os=2x2", ref_skip, model, losses, opt=opt,
            extra={"skipped": opt.skipped_steps, "scale": opt.loss_scale})
    # recompute keeps the recompute-forward gather for backward: AG count unchanged
    for p in ("p=2x1,g=2x1,os=2x2", "p=2x2,g=2x2,os=2x2"):
        counts = {}
        for rc in (False, True):
            before = C.stats[("all_gather", "param_shard")]
            model, opt, losses, _ = train(p, cfg(recompute=rc), world=world)
            counts[rc] = C.stats[("all_gather", "param_shard")] - before
            units = sum(1 for u in model.amsp.units if u.params)
        compare(f"recompute:{p}", ref32, model, losses,
                extra={"ag_per_micro_batch": counts[True] / (STEPS * M),
                       "ag_per_micro_batch_no_recompute": counts[False] / (STEPS * M),
                       "num_units": units})
    ref_clip = shared_reference(world, clip=0.05)
    for p in ("ddp", "p=1x1,g=1x1,os=2x2", "p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2", "zero3"):
        model, opt, losses, norms = train(p, cfg(), world=world, clip=0.05)
        compare(f"clip:{p}", ref_clip, model, losses, norms, extra={"ref_norms": ref_clip["norms"]})
    cases = [
        ("sg-between:p=1x1,g=2x1,os=2x2", "p=1x1,g=2x1,os=2x2", {}, {}),
        ("overlap-off:p=2x1,g=2x2,os=2x2", "p=2x1,g=2x2,os=2x2",
         {"overlap": OverlapConfig(allgather=False, allreduce=False, broadcast=False)}, {}),
        ("small-buckets:p=2x1,g=2x2,os=2x2", "p=2x1,g=2x2,os=2x2", {"grad_bucket_bytes": 4096}, {}),
        ("blocks:p=1x1,g=2x2,os=2x2", "p=1x1,g=2x2,os=2x2", {"ownership": "blocks"}, {}),
        ("layer-granularity:p=2x1,g=2x1,os=2x2", "p=2x1,g=2x1,os=2x2", {"granularity": "layer"}, {}),
    ]
    for name, p, ckw, tkw in cases:
        model, opt, losses, _ = train(p, cfg(**ckw), world=world, **tkw)
        compare(name, ref32, model, losses)
    # packed broadcasts under a budget small enough that only the smallest tensors are packed
    # (tiny-llama's local tensors are 128 B .. 32 KiB at sp = 2, about 250 KiB in all)
    model, opt, losses, _ = train("p=2x1,g=2x1,os=2x2",
                                  cfg(ownership="blocks", grad_bucket_bytes=32768), world=world)
    ps = model.amsp.param_sync
    compare("coalesced-broadcasts:p=2x1,g=2x1,os=2x2", ref32, model, losses,
            extra={"num_items": len(ps.items), "num_packed": sum(it.packed for it in ps.items),
                   "num_packed_tensors": sum(len(it.tensors) for it in ps.items if it.packed),
                   "num_tensors": len(ps.tensors), "peak_staging": ps.peak_staging,
                   "staging_limit": ps.staging_limit})
    ref_tied = shared_reference(world, tied=True)
    for p in ("p=1x1,g=2x2,os=2x2", "p=2x1,g=2x1,os=2x2"):
        model, opt, losses, _ = train(p, cfg(), world=world, tied=True)
        compare(f"tied-embeddings:{p}", ref_tied, model, losses,
                extra={"root_unit_params": len(model.amsp.units[0].params)})
    ref_sched = shared_reference(world, sched=True)
    model, opt, losses, _ = train("p=1x1,g=2x2,os=2x2", cfg(), world=world,
                                  boundary_api="set_boundary", sched=True)
    sd = opt.state_dict()
    opt.load_state_dict(sd)  # same plan: round trip, re-broadcast
    meta_ok = all(set(m) == {"name", "global_shape", "local_shape", "shard_index", "owner"}
                  for m in sd["tensors"])
    compare("boundary-api+lr-schedule+state-dict:p=1x1,g=2x2,os=2x2", ref_sched, model, losses,
            extra={"metadata_ok": meta_ok, "num_owned": len(sd["tensors"])})


def compare_quiet(ref, model, losses):
    got = full_params(model)
    pdiff = max(float((got[n] - t).abs().max()) for n, t in ref["params"].items())
    ldiff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    return {"param_max_abs_diff": pdiff, "loss_max_rel_diff": ldiff}


def _emit(obj):
    """Every rank prints its own line (guards run after collectives may have broken)."""
    # one write() per line: lines of several ranks sharing the pipe stay whole
    sys.stdout.write("RESULT " + json.dumps({"rank": dist.get_rank(), **obj}) + "\n")
    sys.stdout.flush()


def suite_guards(world, R):
    from torch.distributed import distributed_c10d as c10d

    from amsp_ext.planner.plan import PlanError
    from amsp_ext.runtime.engine import MismatchError

    rank = dist.get_rank()
    # 1. a plan that does not fit the world: refused before any collective or process group
    for plan, kw in (("p=4x1,g=4x1,os=4x1", {}), ("p=1x1,g=1x1,os=2x1", {"gpus_per_node": 3}),
                     ("mics:3", {}), ("p=2x1,g=1x1,os=2x1", {})):
        issued, groups = sum(C.stats.values()), len(c10d._world.pg_map)
        try:
            shard(build_llama("tiny-llama"), plan, adamw,
                  config=ShardConfig(**{"gpus_per_node": R, "timeout": 30, **kw}))
            err = None
        except PlanError as e:
            err = str(e)
        _emit({"case": f"unfit:{plan}:{kw}", "error": err,
               "collectives_issued": sum(C.stats.values()) - issued,
               "groups_created": len(c10d._world.pg_map) - groups})
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
    from amsp_ext.runtime.export import consolidated_state_dict

    model, _ = shard(build_llama("tiny-llama", seed=rank), "p=2x1,g=2x1,os=2x2", adamw,
                     config=ShardConfig(gpus_per_node=R, timeout=30))
    got = consolidated_state_dict(model, rank0_only=False)
    ref = build_llama("tiny-llama", seed=0).state_dict()
    other = build_llama("tiny-llama", seed=1).state_dict()
    release(model)
    errors = {}
    for same, seed in ((False, rank), (True, 0)):
        try:
            m, _ = shard(build_llama("tiny-llama", seed=seed), "p=1x1,g=1x1,os=2x2", adamw,
                         config=ShardConfig(gpus_per_node=R, timeout=30, init_weights="check"))
            release(m)
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
                          gpu_memory_bytes=4 * 2**30)
    try:
        shard(build_llama("tiny-llama"), "auto", adamw, config=ShardConfig(gpus_per_node=R))
        missing_err = None
    except PlanError as e:
        missing_err = str(e)
    model, opt, losses, _ = train("auto", ShardConfig(gpus_per_node=R, timeout=60, auto=auto),
                                  world=world)
    direct = plan_for(build_llama("tiny-llama").config.to_dict(),
                      ClusterSpec(num_nodes=world // R, gpus_per_node=R, gpu_memory_bytes=4 * 2**30),
                      TrainingSpec(seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M,
                                   precision="fp32"), "paper-a800")
    _emit({"case": "auto", "plan": str(model.amsp.plan), "planner_direct": str(direct),
           "losses": losses, "missing_config_error": missing_err})
    release(model)
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
    if rank == 0:
        print("RESULT " + json.dumps({"case": "trace", **out}), flush=True)


def suite_memory(world, R):
    """Measured model-state bytes per rank vs the planner's memory model (amsp_ext.planner.memory)
    for every pre-filtered plan, in bf16 (the paper's 2/2/12 bytes) and fp32 (4/4/8)."""
    from amsp_ext.planner.memory import memory_breakdown
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.planner.specs import TrainingSpec

    spec = ModelSpec.from_hf_config(build_llama("tiny-llama").config.to_dict())
    for precision in ("bf16", "fp32"):
        training = TrainingSpec(seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M,
                                precision=precision)
        for p in prefiltered_plans(R, world // R):
            model, opt, losses, _ = train(p, ShardConfig(gpus_per_node=R, precision=precision),
                                          world=world)
            b = model.model_state_bytes()
            pred = memory_breakdown(spec, p, training, gpus_per_node=R, num_nodes=world // R)
            rel = torch.tensor([abs(b["total"] / pred.model_states - 1)])
            dist.all_reduce(rel, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({
                    "case": f"{precision}:{p}", "predicted": {"params": pred.params, "grads": pred.grads,
                                                              "optim": pred.optim},
                    "measured_rank0": b, "worst_rank_rel_err": float(rel)}), flush=True)
            release(model)


SUITES = {"memory": suite_memory, "parity": suite_parity, "extras": suite_extras, "guards": suite_guards,
          "trace": suite_trace}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    suite = sys.argv[1]
    world = dist.get_world_size()
    R = int(os.environ["LOCAL_WORLD_SIZE"]) if len(sys.argv) < 3 else int(sys.argv[2])
    t0 = time.perf_counter()
    SUITES[suite](world, R)
    end_worker(t0)


if __name__ == "__main__":
    main()
