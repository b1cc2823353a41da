"""Worker for tests/test_whole_tensor_optim.py's resume on fewer ranks: a whole-tensor optimizer
(Adafactor) trained under a row-sharded plan on 4 ranks, saved, and resumed on 2 ranks under
another plan; every step and the final parameters against one uninterrupted process.

Usage: python -m tests.whole_resume_worker SUITE DIR   (SUITE: save4 or load2)
The global batch is the same 4 sequences per step on every world size (M = 4 / world
micro-batches of one sequence). Prints ``RESULT {json}`` on rank 0; pytest decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from amsp_ext.runtime.state.export import consolidated_state_dict
from tests.dist_utils import end_worker, free_plan_groups

SEQ, GLOBAL_SEQS, LR = 16, 4, 1e-2
BEFORE, AFTER = (0, 1), (2, 3)
# (checkpoint name, plan on 4 ranks, plan on 2 ranks)
CASES = (("zero3-to-os2", "zero3", "p=1x1,g=1x1,os=2x1"), ("p2os4-to-zero3", "p=2x1,g=2x1,os=2x2", "zero3"))
# the negative control: the weights loaded, Adafactor's factors and step counts not
CONTROL = ("control-no-optimizer-state", "zero3-to-os2", "p=1x1,g=1x1,os=2x1")


def adafactor(params):
    return torch.optim.Adafactor(params, lr=LR)


def train(model, opt, steps, *, world, rank):
    M = GLOBAL_SEQS // world
    losses = []
    for step in steps:
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(M):
            b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=1, seq_len=SEQ)
            with contextlib.nullcontext() if m == M - 1 or world == 1 else model.no_sync():
                loss = causal_lm_loss(model, b) / M
                loss.backward() if world == 1 else opt.backward(loss)
            total += loss.detach().double()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
        opt.step()
        opt.zero_grad()
    return losses


def reference():
    """One process, the whole global batch, four steps without a checkpoint."""
    model = build_llama("tiny-llama", seed=0)
    opt = adafactor(list(model.parameters()))
    losses = train(model, opt, BEFORE + AFTER, world=1, rank=0)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make(plan, seed):
    R = int(os.environ["LOCAL_WORLD_SIZE"]) // 2 if dist.get_world_size() == 4 else 2
    return shard(build_llama("tiny-llama", seed=seed), plan, adafactor,
                 config=ShardConfig(gpus_per_node=R, timeout=120))


def release(model):
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    model.amsp.wait_params()
    free_plan_groups(model.amsp.mesh)


def emit(obj):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(obj), flush=True)


def suite_save4(root: Path):
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, plan, _ in CASES:
        model, opt = make(plan, seed=0)
        losses = train(model, opt, BEFORE, world=world, rank=rank)
        save_checkpoint(model, opt, root / name)
        emit({"case": name, "suite": "save4", "plan": plan, "losses": losses, "whole": opt.whole is not None})
        release(model)


def suite_load2(root: Path):
    world, rank = dist.get_world_size(), dist.get_rank()
    ref_losses, ref_params = reference()
    for case, name, plan in [(n, n, p) for n, _, p in CASES] + [CONTROL]:
        model, opt = make(plan, seed=1)  # other weights: a load that does nothing fails the test
        rec = {"case": case, "suite": "load2", "plan": plan, "ref_losses": ref_losses}
        try:
            load_checkpoint(model, opt, root / name, optimizer_states=case != CONTROL[0])
            rec["losses"] = train(model, opt, AFTER, world=world, rank=rank)
            full = consolidated_state_dict(model, rank0_only=False)
            rec["param_diff"] = max(float((full[k] - v).abs().max()) for k, v in ref_params.items())
            rec["whole"] = opt.whole is not None
        except Exception as e:  # noqa: BLE001 - the test decides
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        emit(rec)
        release(model)


def main():
    dist.init_process_group("gloo")
    suite, root = sys.argv[1], Path(sys.argv[2])
    t0 = time.perf_counter()
    {"save4": suite_save4, "load2": suite_load2}[suite](root)
    end_worker(t0)


if __name__ == "__main__":
    main()
