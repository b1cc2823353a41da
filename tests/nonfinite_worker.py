"""torchrun worker for the non-finite guard: NaN injected into one rank's loss, in fp32, bf16 and
fp16, with and without clipping, on plans whose optim group is the world (os=2x2 on 4 ranks),
half of it (os=2x1) or one rank (os=1x1, NaN in the loss only). Prints ``RESULT {json}`` per
rank and case.

Usage: python -m tests.nonfinite_worker
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import FP16Config, ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.export import consolidated_state_dict
from amsp_ext.runtime.optim.nonfinite import NonFiniteError
from tests.dist_utils import end_worker

NAN_RANK = 2


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def weights(model):
    return consolidated_state_dict(model, rank0_only=False)


def run_case(name, plan, *, precision, clip, nan_steps, steps, nan_in_gradient=True, **cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = shard(build_llama("tiny-llama", seed=0), plan,
                       lambda p: torch.optim.AdamW(p, lr=1e-3),
                       config=ShardConfig(gpus_per_node=2, timeout=60, precision=precision, **cfg))
    log = Records()
    logging.getLogger("amsp_ext").addHandler(log)
    rows, error = [], None
    for step in range(steps):
        before = weights(model) if step in nan_steps else None
        b = micro_batch(step, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=2, seq_len=16)
        loss = causal_lm_loss(model, b)
        if step in nan_steps and rank == NAN_RANK:
            # a NaN factor makes the gradients NaN too; a NaN constant added leaves them finite,
            # so only the loss verdict can tell the other ranks
            loss = loss * float("nan") if nan_in_gradient else loss + torch.tensor(float("nan"))
        applied_before = opt.num_steps
        try:
            opt.backward(loss)
            if clip:
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        except NonFiniteError as e:
            error = {"step": step, "message": str(e)}
            break
        row = {"step": step, "loss": float(loss), "applied": opt.num_steps > applied_before}
        if before is not None:
            after = weights(model)
            row["unchanged"] = all(torch.equal(after[k], before[k]) for k in after)
            row["finite"] = all(bool(torch.isfinite(v).all()) for v in after.values())
        rows.append(row)
    final = weights(model)
    logging.getLogger("amsp_ext").removeHandler(log)
    sys.stdout.write("RESULT " + json.dumps({
        "case": name, "rank": rank, "rows": rows, "error": error, "skipped": opt.skipped_steps,
        "final_finite": all(bool(torch.isfinite(v).all()) for v in final.values()),
        "log": log.lines}) + "\n")
    sys.stdout.flush()
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    t0 = time.perf_counter()
    # one NaN at step 3, then three in a row from step 6 (the job stops at the third)
    nan_steps = {3, 6, 7, 8, 9}
    run_case("fp32-clip", "p=1x1,g=1x1,os=2x1", precision="fp32", clip=True, nan_steps=nan_steps, steps=10)
    run_case("bf16-noclip", "p=2x1,g=2x1,os=2x2", precision="bf16", clip=False, nan_steps=nan_steps, steps=10)
    # fp16: the NaN at step 3 is an overflow above the minimum scale (skipped, not counted);
    # from step 6 the scale is at its minimum and the overflows count
    run_case("fp16-noclip", "p=1x1,g=1x1,os=2x1", precision="fp16", clip=False, nan_steps=nan_steps, steps=10,
             fp16=FP16Config(initial_scale=2.0, min_scale=1.0))
    # the replicate plan (sos = 1): no norm all-reduce, the verdict rides on the gradients'
    # (nonfinite.py [Note: one decision, on the norm all-reduce]); the gradients stay finite
    run_case("fp32-replicate-clip", "p=1x1,g=1x1,os=1x1", precision="fp32", clip=True,
             nan_steps=nan_steps, steps=10, nan_in_gradient=False)
    # negative control: the guard off, fp32 applies the NaN step
    run_case("fp32-guard-off", "p=1x1,g=1x1,os=2x1", precision="fp32", clip=False, nan_steps={3}, steps=5,
             max_bad_steps=0)
    end_worker(t0)


if __name__ == "__main__":
    main()
