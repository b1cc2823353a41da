"""Muon (with AdamW for the rest) under three layouts, on the lab (not a test):

- ``ddp``: gradients all-reduced, every rank runs Muon on every matrix (each matrix gathered,
  as a whole, on every rank);
- ``p=1x1,g=1x1,os=2x2``: AMSP's inter-tensor ownership: each of the 4 ranks runs Muon on its
  quarter of the matrices (greedy on bytes) and broadcasts them; no exchange (sp = 1);
- ``zero3``: row-sharded parameters; each matrix stepped whole by one rank of the param_shard
  group (runtime/optim/whole_tensor.py: two all-to-alls per step).

Each round runs the three in alternated order (reversed every other round), warm-up steps
first, then the timed ones; every rank records its step times, the time inside ``opt.step()``
and the bytes each collective kind carried in one timed step (the engine's collective log).

    amsp cluster up --nodes 2 --gpus-per-node 2 --inter-node-bandwidth 100mbit --name amsp
    amsp cluster run --name amsp -- comparisons/whole_tensor_bench.py --out DIR [--rounds 5]
    amsp cluster down --name amsp

Rank 0 writes DIR/results.json (raw: every round's per-step times) and prints one line per
layout: median step and optimizer times over the rounds' medians, and bytes per step.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

LAYOUTS = ("ddp", "p=1x1,g=1x1,os=2x2", "zero3")


def run_layout(plan: str, args, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.models import build_llama, causal_lm_loss
    from amsp_ext.runtime import collectives as C
    from amsp_ext.runtime.config import ShardConfig
    from amsp_ext.runtime.shard import shard

    from amsp_ext.runtime.optim.muon_adamw import muon_adamw_factory

    model, opt = shard(build_llama(args.model, seed=0), plan, muon_adamw_factory(muon={"lr": 0.02}, adamw={"lr": 3e-4}),
                       config=ShardConfig(gpus_per_node=args.gpus_per_node, timeout=600))
    steps, opt_s, sent = [], [], collections.Counter()

    def log(event, op, name, info):
        if event == "issued" and info is not None:
            sent[op] += int(info.nbytes)

    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        b = micro_batch(step, 0, rank, world_size=world, num_micro_batches=1,
                        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
        timed = step == args.warmup  # the first timed step's bytes
        with C.observing(model.amsp.comm, log) if timed else _null():
            opt.backward(causal_lm_loss(model, b))
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
        if step >= args.warmup:
            steps.append(t2 - t0)
            opt_s.append(t2 - t1)
    model.amsp.wait_params()
    return {"step_s": steps, "optimizer_s": opt_s, "bytes": dict(sent), "whole": opt.whole is not None,
            "owned_tensors": len(opt.masters)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    args = ap.parse_args()
    from amsp_ext.runtime import collectives as C

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = C.CollectiveContext(timeout=900)
    rounds = []
    for r in range(args.rounds):
        order = LAYOUTS if r % 2 == 0 else tuple(reversed(LAYOUTS))
        got = {}
        for plan in order:
            res = run_layout(plan, args, rank, world)
            # JSON over the wire (runtime/wire.py), not all_gather_object's pickles
            got[plan] = C.all_gather_objects(comm, res, None, name="world")
        rounds.append({"order": list(order), "layouts": got})
    if rank == 0:
        summary = {}
        for plan in LAYOUTS:
            # a step ends when its slowest rank does: the rank-max of each step, median per round
            med = [statistics.median(max(rk["step_s"][i] for rk in rd["layouts"][plan])
                                     for i in range(args.steps)) for rd in rounds]
            opt_med = [statistics.median(max(rk["optimizer_s"][i] for rk in rd["layouts"][plan])
                                         for i in range(args.steps)) for rd in rounds]
            first = rounds[0]["layouts"][plan]
            summary[plan] = {"step_s_median": statistics.median(med), "step_s_rounds": med,
                             "optimizer_s_median": statistics.median(opt_med), "optimizer_s_rounds": opt_med,
                             "bytes_per_step_rank0": first[0]["bytes"],
                             "bytes_per_step_all_ranks": [rk["bytes"] for rk in first],
                             "whole_tensor_exchange": first[0]["whole"]}
            print(f"{plan:<22} step {summary[plan]['step_s_median']:.3f} s (rounds {min(med):.3f}-{max(med):.3f}), "
                  f"optimizer {summary[plan]['optimizer_s_median']:.3f} s, rank-0 bytes/step "
                  f"{ {k: v for k, v in sorted(first[0]['bytes'].items())} }", flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({
            "meta": {"args": vars(args), "world": world, "date": time.strftime("%Y-%m-%d"),
                     "host": platform.processor() or platform.machine(), "optimizer": "MuonWithAdamW",
                     "layouts": LAYOUTS}, "summary": summary, "rounds": rounds}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
