"""Engine benchmarks (not tests): hook overhead vs torch DDP, overlap ablation (the paper's
Table V) and hidden-communication fraction, and the ownership policies.

    python comparisons/engine_bench.py overhead  [--nproc 2] [--model small-llama]
    python comparisons/engine_bench.py overlap   [--nproc 8 --gpus-per-node 4]
    python comparisons/engine_bench.py ownership [--nproc 4]
    python comparisons/engine_bench.py reduce    [--nproc 4 --gpus-per-node 2]

Each subcommand launches its ranks with torchrun (gloo on CPU) and prints one JSON object.
Timings on a shared 2-core machine are noisy and CPU-bound (gloo's threads compete with the
compute for the same cores): read them as relative figures, and re-run before believing a gap
smaller than the spread printed next to it.

[Note: hidden-communication fraction]
For a plan, T_on is the step time with every overlap on, T_off with every overlap off (each
collective waited for where it is issued), and C_off the time spent inside those waits with
overlap off (every amsp collective passes through collectives.wait, timed by its observer).
The hidden fraction is (T_off - T_on) / C_off: 1 when overlapping hides all communication,
0 when it hides none. It is printed from the median and from the minimum step times (the
minimum is the least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _launch(args: argparse.Namespace, extra: list[str]) -> int:
    return launch_workers(Path(__file__), args, extra)


def launch_workers(script: Path, args: argparse.Namespace, extra: list[str]) -> int:
    """``torchrun`` ``args.nproc`` ranks of ``script --worker extra``; print their ``BENCH`` lines
    (comparisons/resilience_bench.py launches its workers with it too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", str(script.resolve()), "--worker", *extra]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if "BENCH " in line:
            print(line[line.index("BENCH ") + len("BENCH "):])
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


# -- worker side ----------------------------------------------------------------------------------
def _setup():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    return dist


def _batch(step, m, rank, world, M, mbs, seq):
    from amsp_ext.common.data import micro_batch

    return micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                       micro_batch_size=mbs, seq_len=seq)


def _time_steps(run_step, steps, warmup):
    import torch.distributed as dist

    times = []
    for s in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        run_step(s)
        dist.barrier()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _summary(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _engine_loop(model, opt, rank, world, M, mbs, seq):
    from amsp_ext.common.models import causal_lm_loss

    def run_step(s):
        for m in range(M):
            with (model.no_sync() if m < M - 1 else contextlib.nullcontext()):
                opt.backward(causal_lm_loss(model, _batch(s, m, rank, world, M, mbs, seq)) / M)
        # the engine's own loops leave the broadcasts to the next forward (optimizer.py [Note:
        # parameters current after step()]); overlap.broadcast off still waits inside step()
        with opt.broadcast_under_next_forward():
            opt.step()
        opt.zero_grad()
    return run_step


def worker_overhead(a):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from amsp_ext.common.models import build_llama, causal_lm_loss
    from amsp_ext.runtime import ShardConfig, shard

    dist = _setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_f = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    results = {}
    for rep in range(a.repeats):
        for system in ("torch_ddp", "amsp_ddp_plan"):
            model = build_llama(a.model, seed=0)
            if system == "torch_ddp":
                ddp = DDP(model, bucket_cap_mb=25)
                opt = opt_f(ddp.parameters())

                def run_step(s, ddp=ddp, opt=opt):
                    for m in range(a.micro_batches):
                        ctx = ddp.no_sync() if m < a.micro_batches - 1 else contextlib.nullcontext()
                        with ctx:
                            (causal_lm_loss(ddp, _batch(s, m, rank, world, a.micro_batches, a.mbs, a.seq))
                             / a.micro_batches).backward()
                    opt.step()
                    opt.zero_grad()
            else:
                model, opt = shard(model, "ddp", opt_f, config=ShardConfig(gpus_per_node=world))
                run_step = _engine_loop(model, opt, rank, world, a.micro_batches, a.mbs, a.seq)
            times = _time_steps(run_step, a.steps, a.warmup)
            if system != "torch_ddp":
                model.amsp.wait_params()
            results.setdefault(system, []).extend(times)
    if rank == 0:
        ddp_t = statistics.median(results["torch_ddp"])
        amsp_t = statistics.median(results["amsp_ddp_plan"])
        print("BENCH " + json.dumps({
            "bench": "hook_overhead", "model": a.model, "world": world,
            "micro_batches": a.micro_batches, "micro_batch_size": a.mbs, "seq_len": a.seq,
            "torch_ddp": _summary(results["torch_ddp"]),
            "amsp_plan_1_1_1": _summary(results["amsp_ddp_plan"]),
            "overhead_pct": 100 * (amsp_t / ddp_t - 1)}), flush=True)


SHAPES = {
    # the paper's Table IV shapes scaled to a 2-node x R lab (R = gpus per node)
    "7B-like (sp=sg=1, sos=R)": lambda R, N: f"p=1x1,g=1x1,os={R}x1",
    "13B-like (sp=sg=R/2, sos=R)": lambda R, N: f"p={max(1, R // 2)}x1,g={max(1, R // 2)}x1,os={R}x1",
    "30B-like (sp=sg=R, sos=R x N)": lambda R, N: f"p={R}x1,g={R}x1,os={R}x{N}",
}
TABLE_V = {
    "full": dict(allgather=True, allreduce=True, broadcast=True),
    "no_bcast": dict(allgather=True, allreduce=True, broadcast=False),
    "no_bcast_no_ar": dict(allgather=True, allreduce=False, broadcast=False),
    "none": dict(allgather=False, allreduce=False, broadcast=False),
}


def worker_overlap(a):
    import torch

    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime import OverlapConfig, ShardConfig, shard
    from amsp_ext.runtime import collectives as C

    dist = _setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    R = a.gpus_per_node
    N = world // R
    waited = {"s": 0.0}
    starts = {}

    def observer(event, op, name, info):
        if event == "wait_begin":
            starts[name, op] = time.perf_counter()
        elif event == "wait_end":
            waited["s"] += time.perf_counter() - starts.pop((name, op), time.perf_counter())

    # every configuration's engine issues through it, with the engine's default timeout
    comm = C.CollectiveContext(timeout=ShardConfig().timeout, observers=[observer])
    times: dict = {}
    waits: dict = {}
    # repeats outermost, configurations interleaved: contention spikes from other processes on
    # a shared machine then hit every configuration alike
    for rep in range(a.repeats):
        for shape, mk in SHAPES.items():
            plan = mk(R, N)
            for label, ov in TABLE_V.items():
                model, opt = shard(build_llama(a.model, seed=0), plan,
                                   lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                   config=ShardConfig(gpus_per_node=R, precision=a.precision,
                                                      overlap=OverlapConfig(**ov)), comm=comm)
                run = _engine_loop(model, opt, rank, world, a.micro_batches, a.mbs, a.seq)
                waited["s"] = 0.0
                t = _time_steps(run, a.steps, a.warmup)
                model.amsp.wait_params()
                model.amsp.grad_sync.remove()
                model.amsp.param_sync.remove()
                wt = torch.tensor([waited["s"] / (a.steps + a.warmup)])
                dist.all_reduce(wt)
                times.setdefault((shape, label), []).extend(t)
                waits.setdefault((shape, label), []).append(float(wt) / world)
    out = {}
    for shape, mk in SHAPES.items():
        row = {"plan": mk(R, N)}
        for label in TABLE_V:
            row[label] = {**_summary(times[shape, label]),
                          "wait_s_per_step": statistics.median(waits[shape, label])}
        c_off = row["none"]["wait_s_per_step"]
        for stat in ("median_s", "min_s"):
            t_on, t_off = row["full"][stat], row["none"][stat]
            row[f"hidden_fraction_{stat[:-2]}"] = (t_off - t_on) / c_off if c_off > 0 else None
        out[shape] = row
    if rank == 0:
        print("BENCH " + json.dumps({"bench": "overlap", "model": a.model, "world": f"{N}x{R}",
                                     "precision": a.precision, "micro_batches": a.micro_batches,
                                     "repeats": a.repeats, "results": out}), flush=True)


def worker_ownership(a):
    import torch

    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime import ShardConfig, shard
    from amsp_ext.runtime.optim.ownership import load_per_owner

    dist = _setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = f"p=1x1,g=1x1,os={world}x1"
    out = {}
    # broadcast_bucket_bytes 0 = one broadcast per tensor (no packing), None = packed runs
    variants = {"greedy": ("greedy", None), "blocks": ("blocks", None),
                "greedy/per-tensor": ("greedy", 0), "blocks/per-tensor": ("blocks", 0)}
    for rep in range(a.repeats):
        for key, (policy, bcast_bucket) in variants.items():
            model, opt = shard(build_llama(a.model, seed=0), plan,
                               lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                               config=ShardConfig(gpus_per_node=world, ownership=policy,
                                                  precision=a.precision,
                                                  broadcast_bucket_bytes=bcast_bucket))
            e = model.amsp
            run = _engine_loop(model, opt, rank, world, a.micro_batches, a.mbs, a.seq)
            e.param_sync.wait_seconds = 0.0
            times = _time_steps(run, a.steps, a.warmup)
            e.wait_params()
            numels = [t.numel for t in e.tensors]
            owners = [e.mesh.ranks["optim_bcast"].index(t.owner_rank) for t in e.tensors]
            load = load_per_owner(numels, owners, world)
            w = torch.tensor([e.param_sync.wait_seconds / (a.steps + a.warmup)])
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            o = out.setdefault(key, {"times": [], "bcast_wait_s_per_step_max_rank": []})
            o["times"] += times
            o["bcast_wait_s_per_step_max_rank"].append(float(w))
            o["max_over_mean_owned"] = max(load) / (sum(load) / world)
            o["num_broadcasts_per_step"] = len(e.param_sync.items)
    if rank == 0:
        res = {k: {**_summary(v["times"]), "bcast_wait_s_per_step_max_rank":
                   statistics.median(v["bcast_wait_s_per_step_max_rank"]),
                   "max_over_mean_owned": v["max_over_mean_owned"],
                   "num_broadcasts_per_step": v["num_broadcasts_per_step"]} for k, v in out.items()}
        print("BENCH " + json.dumps({"bench": "ownership", "model": a.model, "plan": plan,
                                     "precision": a.precision, "results": res}), flush=True)


REDUCE_PLANS = "p=1x1,g=1x1,os=1x1;p=1x1,g=2x2,os=2x2;p=2x1,g=2x1,os=2x2"


def worker_reduce(a):
    """Step time of ``a.precision`` training with gradients reduced in fp32 vs in the compute
    dtype (ShardConfig.reduce_dtype), per plan; rounds alternate the order of the two."""
    import torch

    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime import ShardConfig, shard

    dist = _setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    R = a.gpus_per_node
    plans = a.plans.split(";")
    times: dict = {}
    ratios: dict = {}
    for rep in range(a.repeats):
        order = ("fp32", a.precision) if rep % 2 == 0 else (a.precision, "fp32")
        for plan in plans:
            med = {}
            for red in order:
                model, opt = shard(build_llama(a.model, seed=0), plan,
                                   lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                   config=ShardConfig(gpus_per_node=R, precision=a.precision,
                                                      reduce_dtype=red))
                run = _engine_loop(model, opt, rank, world, a.micro_batches, a.mbs, a.seq)
                t = _time_steps(run, a.steps, a.warmup)
                model.amsp.wait_params()
                model.amsp.grad_sync.remove()
                model.amsp.param_sync.remove()
                times.setdefault((plan, red), []).extend(t)
                med[red] = statistics.median(t)
            ratios.setdefault(plan, []).append(med["fp32"] / med[a.precision])
    if rank == 0:
        out = {plan: {f"reduce_{red}": _summary(times[plan, red]) for red in ("fp32", a.precision)}
               | {"fp32_over_16bit_per_round": ratios[plan],
                  "fp32_over_16bit_median": statistics.median(ratios[plan])} for plan in plans}
        print("BENCH " + json.dumps({"bench": "reduce_dtype", "model": a.model,
                                     "world": f"{world // R}x{R}", "precision": a.precision,
                                     "micro_batches": a.micro_batches, "micro_batch_size": a.mbs,
                                     "seq_len": a.seq, "steps": a.steps, "repeats": a.repeats,
                                     "results": out}), flush=True)


WORKERS = {"overhead": worker_overhead, "overlap": worker_overlap, "ownership": worker_ownership,
           "reduce": worker_reduce}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=sorted(WORKERS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--plans", default=REDUCE_PLANS, help="reduce: plans separated by ';'")
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        argv = [x for x in argv if x != "--worker"]
        a = p.parse_args(argv)
        WORKERS[a.bench](a)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        return 0
    a = p.parse_args(argv)
    defaults = {"overhead": (2, None, "small-llama"), "overlap": (8, 4, "tiny-llama"),
                "ownership": (4, None, "small-llama"), "reduce": (4, 2, "small-llama")}[a.bench]
    a.nproc = a.nproc or defaults[0]
    a.gpus_per_node = a.gpus_per_node or defaults[1] or a.nproc
    a.model = a.model or defaults[2]
    extra = [a.bench, "--gpus-per-node", str(a.gpus_per_node), "--model", a.model,
             "--precision", a.precision, "--steps", str(a.steps), "--warmup", str(a.warmup),
             "--repeats", str(a.repeats), "--micro-batches", str(a.micro_batches),
             "--mbs", str(a.mbs), "--seq", str(a.seq), "--plans", a.plans]
    return _launch(a, extra)


if __name__ == "__main__":
    sys.exit(main())
