"""What greedy generation costs per token on a sharded model, with and without gathering it
once (not a test):

- ``per_layer``: ``model.generate`` on the AMSP model as it trains: with p > 1 every unit is
  all-gathered in its own forward, once per generated token;
- ``gather_once``: the same call inside ``deepspeed.zero.GatheredParameters`` over every
  parameter (integrations/gathered.py, TRL's route under AMSP: patches/trl_amsp_backend.py):
  one all-gather per unit on entering, none per token.

Each round runs both modes in alternated order (reversed every other round) after one warm-up
call of each; every rank records the seconds per new token of its call and the all-gathers the
call issued (counted at the dispatcher), and rank 0 checks that both modes produced the same
tokens.

    torchrun --nproc-per-node 2 comparisons/generation_gather_bench.py --out DIR
    amsp cluster run --name amsp -- comparisons/generation_gather_bench.py --out DIR   # the lab

Rank 0 writes DIR/results.json (raw: every round's seconds per token and counts) and prints one
line per mode: the median over rounds of the seconds per new token, and all-gathers per call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

MODES = ("per_layer", "gather_once")


def _counting():
    """A dispatch mode counting the all-gathers issued inside it (c10d and functional ops; not
    FSDP2's ``all_gather_copy_in`` / ``_copy_out``, local copies around each one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            if ("allgather" in name or "all_gather" in name) and "copy" not in name:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    return Count


def generate(model, prompt, args, mode: str) -> tuple[float, int, list[int]]:
    """One greedy generation: (seconds per new token, all-gathers issued, the tokens)."""
    import torch
    import torch.distributed as dist

    import deepspeed  # its GatheredParameters acts on AMSP parameters (patches/deepspeed_gathered_parameters.py)

    count = _counting()
    dist.barrier()
    t0 = time.perf_counter()
    with count(), torch.no_grad():
        gathered = (deepspeed.zero.GatheredParameters(list(model.parameters())) if mode == "gather_once"
                    else contextlib.nullcontext())
        with gathered:
            out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                 min_new_tokens=args.new_tokens, pad_token_id=0)
    seconds = time.perf_counter() - t0
    return seconds / args.new_tokens, count.n, out[0].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small-llama")
    p.add_argument("--plan", default="zero3")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from amsp_ext.common.models import build_llama
    from amsp_ext.runtime.config import ShardConfig
    from amsp_ext.runtime.shard import shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # a forward-only engine (a reference or a policy between steps holds the same shards)
    model, _ = shard(build_llama(args.model, seed=0), args.plan, None,
                     config=ShardConfig(gpus_per_node=args.gpus_per_node, timeout=600))
    model.eval()
    prompt = torch.randint(1, 200, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    for mode in MODES:  # warm-up: the first call's allocations and gathers are not timed
        generate(model, prompt, args, mode)
    rounds = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        rounds.append({mode: dict(zip(("s_per_token", "all_gathers", "tokens"), generate(model, prompt, args, mode)))
                       for mode in order})
    if rank == 0:
        _report(args, world, rounds)
    dist.destroy_process_group()


def _cpu() -> str:
    """The CPU's model name and core count (the host every figure is from)."""
    import os

    try:
        name = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def _report(args, world: int, rounds: list[dict]) -> None:
    same = all(r["per_layer"]["tokens"] == r["gather_once"]["tokens"] for r in rounds)
    summary = {m: {"median_s_per_token": statistics.median(r[m]["s_per_token"] for r in rounds),
                   "per_round_s_per_token": [r[m]["s_per_token"] for r in rounds],
                   "all_gathers_per_call": rounds[0][m]["all_gathers"]} for m in MODES}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": f"comparisons/generation_gather_bench.py --model {args.model} --plan {args.plan} "
                      f"--prompt-len {args.prompt_len} --new-tokens {args.new_tokens} --rounds {args.rounds}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": _cpu(), "world": world, "same_tokens": same,
           "summary": summary, "rounds": [{m: {k: v for k, v in r[m].items() if k != "tokens"} for m in MODES}
                                          for r in rounds]}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    for m in MODES:
        s = summary[m]
        print(f"{m}: {1e3 * s['median_s_per_token']:.1f} ms per new token (median of {len(rounds)} rounds), "
              f"{s['all_gathers_per_call']} all-gathers per call")
    print(f"same greedy tokens in both modes: {same}")


if __name__ == "__main__":
    main()
