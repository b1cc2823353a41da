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
from amsp_ext.planner.plan import Plan, check_plan, named_plan, parse_plan
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.config import FP16Config, OverlapConfig, ShardConfig
from amsp_ext.runtime.engine import shard
from torch.distributed.tensor import DTensor

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


def reference(world, *, precision="fp32", clip=None):
    """Single process, whole global batch: fp32 AdamW; under bf16/fp16 the same mixed-precision
    recipe as the engine (compute-dtype params and grads, fp32 masters and states)."""
    model = build_llama("tiny-llama", seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    if dtype != torch.float32:
        bufs = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
        model.to(dtype)
        for m, n, b in bufs:
            m._buffers[n] = b
    opt = adamw(masters if dtype != torch.float32 else list(model.parameters()))
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for b in batches(step, world):
            loss = causal_lm_loss(model, b) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        if dtype != torch.float32:
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
        params = masters if dtype != torch.float32 else list(model.parameters())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
    final = {n: (m if dtype != torch.float32 else p).detach().float().clone()
             for (n, p), m in zip(model.named_parameters(), masters)}
    return {"losses": losses, "norms": norms, "params": final}


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


def train(plan, config, *, world, clip=None, boundary_api="no_sync", inject=None):
    model = build_llama("tiny-llama", seed=0)
    model, opt = shard(model, plan, adamw, config=config)
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
    model.amsp.wait_params()
    return model, opt, losses, norms


def compare(name, ref, model, losses, norms=(), extra=None):
    got = full_params(model)
    pdiff = torch.zeros(1)
    for n, t in ref["params"].items():
        pdiff = torch.maximum(pdiff, (got[n] - t).abs().max().reshape(1))
    ldiff = torch.tensor([max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))])
    ndiff = torch.tensor([max((abs(a - b) / b for a, b in zip(norms, ref["norms"])), default=0.0)])
    for t in (pdiff, ldiff, ndiff):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # worst rank
    res = {"case": name, "param_max_abs_diff": float(pdiff), "loss_max_rel_diff": float(ldiff),
           "norm_max_rel_diff": float(ndiff), "losses": losses, "ref_losses": ref["losses"],
           **(extra or {})}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    return res


def release(model):
    """Destroy the plan's process groups so a launch can loop over many plans."""
    mesh = model.amsp.mesh
    seen = set()
    for pg in list(mesh.groups.values()):
        if id(pg) not in seen and pg is not dist.group.WORLD:
            seen.add(id(pg))
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


SUITES = {"parity": suite_parity}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    suite = sys.argv[1]
    world = dist.get_world_size()
    R = int(os.environ["LOCAL_WORLD_SIZE"]) if len(sys.argv) < 3 else int(sys.argv[2])
    t0 = time.perf_counter()
    SUITES[suite](world, R)
    if dist.get_rank() == 0:
        print(f"DONE {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
