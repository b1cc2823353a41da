"""Muon's optimizer step on each owner, owners balanced by bytes vs by the optimizer's work
(runtime/optim/ownership.py [Note: owners balanced by the optimizer's work]); not a test.

Under sp = 1 (``p=1x1,g=1x1,os=Bx1``) each of B owners runs the optimizer on the whole tensors
it owns, then broadcasts them: every rank waits for the slowest owner. This times that phase
alone: ``torch.optim.Muon.step`` on the tensors the assignment gives each owner, with fixed
random gradients, one thread. ``--mode sequential`` (default): one process times every owner's
step in turn (on a cluster each owner has its own device; on a small shared host two concurrent
owners mostly measure each other); ``concurrent``: B processes started together at a barrier
every step. Arms alternate order every round. The step of an arm is, per step, the slowest
owner's time.

Models (shapes only, forward order):
- ``alternating``: 8 x (512 x 512, 4096 x 64), equal element counts, Newton-Schulz work
  512^3 vs 4096 * 64^2 (8x): a byte balance deals the squares to one owner;
- ``small-llama``: the hidden matrices of amsp's small-llama (4 layers, h = 256, GQA k/v
  128 x 256, MLP 688 x 256): the two balances give the same assignment at B = 2.

python comparisons/whole_owner_balance_bench.py --model alternating --owners 2 --rounds 5 --steps 5 \
    [--mode concurrent] --out comparisons/results/whole_owner_balance_<model>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import statistics
import time

MODELS = {
    "alternating": [(512, 512), (4096, 64)] * 8,
    "small-llama": [s for _ in range(4) for s in ((256, 256), (128, 256), (128, 256), (256, 256),
                                                    (688, 256), (688, 256), (256, 688))],
}
ARMS = ("bytes", "cost")


def assignment(shapes, owners: int, arm: str) -> list[int]:
    from amsp_ext.runtime.optim.ownership import assign_by_cost, assign_greedy, step_cost

    numels = [math.prod(s) for s in shapes]
    if arm == "bytes":
        return assign_greedy(numels, owners)
    return assign_by_cost([step_cost(s) for s in shapes], numels, owners)


def _optimizer(shapes, mine, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for i in mine:
        p = torch.nn.Parameter(torch.randn(*shapes[i], generator=g))
        p.grad = torch.randn(*shapes[i], generator=g)
        params.append(p)
    return torch.optim.Muon(params, lr=0.02) if params else None


def _optimizers(shapes, owners, ranks):
    """(rank, arm) -> Muon over that owner's tensors (None: it owns none), warmed up."""
    opts = {(r, arm): _optimizer(shapes, [i for i, k in enumerate(assignment(shapes, owners, arm)) if k == r], r)
            for r in ranks for arm in ARMS}
    for opt in opts.values():  # warm-up: first-call allocations
        if opt is not None:
            opt.step()
    return opts


def _timed(opt) -> float:
    t0 = time.perf_counter()
    if opt is not None:
        opt.step()
    return time.perf_counter() - t0


def worker(rank, owners, shapes, rounds, steps, barrier, queue):
    import torch

    torch.set_num_threads(1)
    opts = _optimizers(shapes, owners, [rank])
    times = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            for _ in range(steps):
                barrier.wait()
                times[arm].append(_timed(opts[(rank, arm)]))
    queue.put((rank, times))


def sequential(owners, shapes, rounds, steps):
    import torch

    torch.set_num_threads(1)
    opts = _optimizers(shapes, owners, range(owners))
    per_rank = {r: {arm: [] for arm in ARMS} for r in range(owners)}
    for r in range(rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            for _ in range(steps):
                for k in range(owners):
                    per_rank[k][arm].append(_timed(opts[(k, arm)]))
    return per_rank


def concurrent(owners, shapes, rounds, steps):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(owners), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, owners, shapes, rounds, steps, barrier, queue))
             for r in range(owners)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return per_rank


def summarise(shapes, owners, per_rank, rounds):
    from amsp_ext.runtime.optim.ownership import load_per_owner, step_cost

    numels, costs = [math.prod(s) for s in shapes], [step_cost(s) for s in shapes]
    out = {}
    for arm in ARMS:
        own = assignment(shapes, owners, arm)
        slowest = [max(per_rank[r][arm][i] for r in range(owners)) for i in range(len(per_rank[0][arm]))]
        out[arm] = {"owners": own, "work_per_owner": load_per_owner(costs, own, owners),
                    "elements_per_owner": load_per_owner(numels, own, owners),
                    "median_s_per_owner": [statistics.median(per_rank[r][arm]) for r in range(owners)],
                    "median_step_s": statistics.median(slowest), "slowest_owner_s": slowest}
    out["bytes_over_cost"] = out["bytes"]["median_step_s"] / out["cost"]["median_step_s"]
    # the host's load drifts over a run: the ratio within each round (both arms back to back)
    n = len(per_rank[0]["bytes"]) // rounds
    out["round_ratios"] = [statistics.median(out["bytes"]["slowest_owner_s"][i * n:(i + 1) * n])
                           / statistics.median(out["cost"]["slowest_owner_s"][i * n:(i + 1) * n])
                           for i in range(rounds)]
    out["median_round_ratio"] = statistics.median(out["round_ratios"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="alternating")
    ap.add_argument("--owners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mode", choices=("sequential", "concurrent"), default="sequential")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = MODELS[args.model]
    run = sequential if args.mode == "sequential" else concurrent
    per_rank = run(args.owners, shapes, args.rounds, args.steps)
    import torch

    result = {"model": args.model, "mode": args.mode, "shapes": shapes, "owners": args.owners, "rounds": args.rounds,
              "steps_per_round": args.steps, "optimizer": "torch.optim.Muon(lr=0.02)", "threads_per_owner": 1,
              "host": f"{platform.machine()} {platform.processor()}".strip(), "torch": torch.__version__,
              **summarise(shapes, args.owners, per_rank, args.rounds)}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: result[k] for k in ("model", "mode", "owners", "bytes_over_cost", "median_round_ratio",
                                             "round_ratios")}
                     | {a: {k: result[a][k] for k in ("median_step_s", "median_s_per_owner", "work_per_owner")}
                        for a in ARMS}))


if __name__ == "__main__":
    main()
