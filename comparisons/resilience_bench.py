"""Resilience benchmarks (not tests): what durable checkpoints and the non-finite guard cost.

    python comparisons/resilience_bench.py checkpoint [--nproc 4] [--model small-llama]
    python comparisons/resilience_bench.py guard      [--nproc 4] [--model small-llama]

``checkpoint``: trains with a save every few steps, synchronous and asynchronous
(``save_checkpoint(..., async_save=True)``), and reports per save: the training stall (the
time ``save_checkpoint`` blocks the loop; for async, DCP's staging copy), the time until the
checkpoint is published (files written, hashed, renamed), and the step time while an async
save is being written (the background thread competes with training for the cores), next to
steps without any save. Every save is atomic and checksummed in both modes.

``guard``: step time with clipping off, the non-finite guard on (``max_bad_steps=3``: one norm
per owned gradient and a 4-byte all-reduce per step) and off (``max_bad_steps=0``); rounds
alternate the two so that machine load drifts hit both.

Each launches its ranks with torchrun (gloo on CPU) and prints one JSON object. On the shared
2-core machine the figures are noisy; the spread is printed next to each median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import launch_workers  # noqa: E402


def _launch(args: argparse.Namespace, extra: list[str]) -> int:
    return launch_workers(Path(__file__), args, extra)


def _stats(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


# -- worker side ----------------------------------------------------------------------------------
def _make(model_name: str, plan: str, **cfg):
    import torch

    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime.config import ShardConfig
    from amsp_ext.runtime.shard import shard

    return shard(build_llama(model_name, seed=0), plan, lambda p: torch.optim.AdamW(p, lr=1e-3),
                 config=ShardConfig(gpus_per_node=2, timeout=600, **cfg))


def _step(model, opt, step: int, *, clip: bool, seq: int, mbs: int) -> float:
    import torch.distributed as dist

    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.models import causal_lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    b = micro_batch(step, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=mbs, seq_len=seq)
    opt.backward(causal_lm_loss(model, b))
    if clip:
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    model.amsp.wait_params()
    return time.perf_counter() - t0


def _all_done(pending) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if pending.done() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def worker_checkpoint(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from amsp_ext.runtime.state.checkpoint import save_checkpoint, wait_for_save

    model, opt = _make(a.model, a.plan)
    root = Path(a.dir)
    step = 0
    for _ in range(3):  # warm-up
        _step(model, opt, step, clip=True, seq=a.seq_len, mbs=a.micro_batch_size)
        step += 1
    out: dict = {"model": a.model, "plan": a.plan, "world": dist.get_world_size(),
                 "param_bytes": sum(p.numel() * 4 for p in model.parameters())}
    for mode in ("sync", "async", "sync", "async"):  # alternated: load drift hits both
        plain, during, stalls, published = [], [], [], []
        for _ in range(a.saves):
            for _ in range(a.every - 1):
                plain.append(_step(model, opt, step, clip=True, seq=a.seq_len, mbs=a.micro_batch_size))
                step += 1
            dist.barrier()
            t0 = time.perf_counter()
            pending = save_checkpoint(model, opt, root / f"{mode}", info={"step": step},
                                      async_save=(mode == "async"))
            stalls.append(time.perf_counter() - t0)
            if pending is None:
                published.append(stalls[-1])
            else:
                # steps while the background thread writes, until it has published on every
                # rank (decided together: every rank must run the same number of steps)
                while not _all_done(pending):
                    during.append(_step(model, opt, step, clip=True, seq=a.seq_len, mbs=a.micro_batch_size))
                    step += 1
                published.append(time.perf_counter() - t0)
                wait_for_save(model)
            plain.append(_step(model, opt, step, clip=True, seq=a.seq_len, mbs=a.micro_batch_size))
            step += 1
        r = out.setdefault(mode, {"stall": [], "published": [], "plain_step": [], "step_during_write": []})
        r["stall"] += stalls
        r["published"] += published
        r["plain_step"] += plain
        r["step_during_write"] += during
    for mode in ("sync", "async"):
        out[mode] = {k: _stats(v) for k, v in out[mode].items() if v}
    files = list((root / "sync").iterdir())
    out["checkpoint_bytes"] = sum(f.stat().st_size for f in files)
    return out


def worker_guard(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    out: dict = {"model": a.model, "plan": a.plan, "world": dist.get_world_size(), "clip": False}
    times: dict[str, list[float]] = {"guard_on": [], "guard_off": []}
    models = {"guard_on": _make(a.model, a.plan, max_bad_steps=3),
              "guard_off": _make(a.model, a.plan, max_bad_steps=0)}
    for rnd in range(a.rounds):
        for name in (("guard_on", "guard_off") if rnd % 2 == 0 else ("guard_off", "guard_on")):
            model, opt = models[name]
            for i in range(a.steps):
                t = _step(model, opt, i, clip=False, seq=a.seq_len, mbs=a.micro_batch_size)
                if i >= 2:
                    times[name].append(t)
    for k, v in times.items():
        out[k] = _stats(v)
    on, off = out["guard_on"]["median_s"], out["guard_off"]["median_s"]
    out["overhead_median"] = on / off - 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("checkpoint", "guard"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--model", default="small-llama")
    p.add_argument("--plan", default="p=2x1,g=2x1,os=2x2")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="saves per mode and round (checkpoint)")
    p.add_argument("--every", type=int, default=4, help="steps per save (checkpoint)")
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds (guard)")
    p.add_argument("--steps", type=int, default=10, help="steps per round (guard)")
    p.add_argument("--dir", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args(argv)
    if not a.worker:
        extra = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--worker"]
        with tempfile.TemporaryDirectory(prefix="amsp-bench-") as d:
            return _launch(a, [*extra, "--dir", d] if a.dir is None else extra)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    res = worker_checkpoint(a) if a.what == "checkpoint" else worker_guard(a)
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
