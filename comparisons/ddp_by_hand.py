"""DDP outside the harness (issue 22 item 1's check): the same job as ``amsp compare``'s DDP row,
written plainly - same model, seed, data, AdamW, clipping, no_sync accumulation - timing each step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 comparisons/ddp_by_hand.py \
        --model tiny-llama --seq-len 128 --micro-batch-size 2 --micro-batches 2 --steps 8 --precision fp32
"""

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss

p = argparse.ArgumentParser()
p.add_argument("--model", default="tiny-llama")
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--micro-batch-size", type=int, default=2)
p.add_argument("--micro-batches", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--warmup-steps", type=int, default=3)
p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = DDP(build_llama(a.model, seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
M = a.micro_batches
amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.precision == "bf16" else contextlib.nullcontext
times = []
for step in range(a.steps):
    t = time.perf_counter()
    for m in range(M):
        b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                        micro_batch_size=a.micro_batch_size, seq_len=a.seq_len)
        with (contextlib.nullcontext() if m == M - 1 else model.no_sync()):
            with amp():
                loss = causal_lm_loss(model, b)
            (loss / M).backward()
        loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
if rank == 0:
    print(f"by hand: median step {statistics.median(times[a.warmup_steps:]):.4f} s "
          f"over steps {a.warmup_steps}..{a.steps - 1}: {[round(x, 4) for x in times]}")
dist.destroy_process_group()
