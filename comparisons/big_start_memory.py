"""Start-up memory of a model larger than a rank's share: the whole fp32 model built on every
rank (the path every shard() took before meta start) beside the model built on meta.

    python comparisons/big_start_memory.py [--out comparisons/results/big_start_cpu.json]
        [--nproc 4] [--plan zero3] [--layers 20] [--steps 2] [--modes whole,meta]

Per mode, one torchrun job of ``--nproc`` gloo ranks trains a Llama of about 300 M parameters
(vocab 32000, hidden 1024, MLP 2816, ``--layers`` layers; fp32) for ``--steps`` steps under
``--plan``. Each rank reports, from just before the model is built through the last step:
- ``tracker_peak_bytes``: torch's MemTracker, every tensor allocated in the window (the model,
  the engine's buffers, activations, gradients, optimizer states), and its peak up to the end of
  ``shard()`` (``tracker_startup_peak_bytes``);
- ``rss_peak_growth_bytes``: the process's peak resident memory (``ru_maxrss``) minus its
  resident memory before the build: what the machine must have for that rank.
``whole``: ``build_llama`` (seeded, fp32, whole) then ``shard()``; ``meta``: the same model
built on ``meta`` and sharded with ``init_seed`` (runtime/materialize.py).
The JSON keeps every rank's numbers and the command; the results README quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import amsp_ext
    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.models import build_llama, causal_lm_loss
    from amsp_ext.runtime import _torch_compat as compat
    from amsp_ext.runtime.config import ShardConfig
    from amsp_ext.tools.dryrun import memory_categories  # MemTracker's snapshot, meta left out

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)
    dist.barrier()
    rss0 = _rss()
    tracker = compat.mem_tracker()
    t0 = time.perf_counter()
    with tracker:
        model = build_llama("tiny-llama", seed=0, on_meta=args.mode == "meta", **shape)
        num_params = sum(p.numel() for p in model.parameters())
        model, opt = amsp_ext.shard(model, args.plan, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                    config=ShardConfig(gpus_per_node=world, init_seed=0))
        startup_peak = memory_categories(tracker.get_tracker_snapshot("peak"))["_total"]
        rss_startup = _peak_rss() - rss0
        t_start = time.perf_counter() - t0
        losses = []
        for step in range(args.steps):
            batch = micro_batch(step, 0, rank, world_size=world, num_micro_batches=1,
                                micro_batch_size=1, seq_len=64)
            loss = causal_lm_loss(model, batch)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        model.amsp.wait_params()
    peak = memory_categories(tracker.get_tracker_snapshot("peak"))["_total"]
    rec = {"rank": rank, "mode": args.mode, "num_params": num_params,
           "fp32_model_bytes": 4 * num_params, "tracker_startup_peak_bytes": startup_peak,
           "tracker_peak_bytes": peak, "rss_startup_peak_growth_bytes": rss_startup,
           "rss_peak_growth_bytes": _peak_rss() - rss0, "model_state_bytes": model.model_state_bytes(),
           "startup_s": t_start, "total_s": time.perf_counter() - t0, "losses": losses}
    out = [None] * world
    dist.all_gather_object(out, rec)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--plan", default="zero3")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", default="whole,meta")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # a rank's own mode
    args = ap.parse_args()
    if args.mode is not None:
        return worker(args)
    runs = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--mode", mode, "--plan", args.plan, "--layers", str(args.layers),
               "--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{mode} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        runs[mode] = json.loads(line[7:])
        r0 = runs[mode][0]
        print(f"{mode}: {r0['num_params'] / 1e6:.0f}M params; per rank "
              + ", ".join(f"rank {r['rank']} tracker peak {r['tracker_peak_bytes'] / 2**20:.0f} MiB "
                          f"(start-up {r['tracker_startup_peak_bytes'] / 2**20:.0f}), RSS growth "
                          f"{r['rss_peak_growth_bytes'] / 2**20:.0f} MiB" for r in runs[mode]), flush=True)
    result = {"command": " ".join(["python", "comparisons/big_start_memory.py", *sys.argv[1:]]),
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                    if l.startswith("model name")), "?")},
              "plan": args.plan, "nproc": args.nproc, "steps": args.steps, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
