"""torchrun worker: adaptive AMSP in your own loop, a ``RESULT {json}`` line.

4 gloo ranks posing as 2 nodes x 2, tiny-llama, M = 1, plan zero3 (its gathers and
reduce-scatters cross nodes), ``amsp_ext.shard(..., config=ShardConfig(adaptive=...))`` with
window 4 and no minimum between switches (the settings of the DeepSpeed-route case,
integrations_worker.suite_adaptive). From the test's step K (``AMSP_FAULTS`` ``slow``
multiplies the monitor's measured cross-node times, common/faults.py) the monitor sees a slow link, so
the loop must switch plans by itself, in the ``optimizer.zero_grad()`` after the deciding step. Every step's loss
and gradient norm is compared with the same loop on torch DDP (fp32), the independent
reference: they hold only if the switch moved masters and optimizer states exactly and the
loop went on with the same optimizer object.

Usage: torchrun --nproc-per-node 4 -m tests.adaptive_loop_worker
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from amsp_ext.common.models import build_llama, causal_lm_loss
from tests.dist_utils import end_worker
from tests.integrations_worker import (ADAPTIVE, ADAPTIVE_STEPS, SEQ, adaptive_config, batches,
                                       ddp_reference, emit)


def loop_case(cfg) -> dict:
    import amsp_ext
    from amsp_ext.runtime.config import AdaptiveConfig, AutoPlanConfig, ShardConfig

    p = cfg["optimizer"]["params"]
    config = ShardConfig(
        gpus_per_node=2, granularity="layer", timeout=120,
        adaptive=AdaptiveConfig(**ADAPTIVE),
        auto=AutoPlanConfig(seq_len=SEQ, micro_batch_size=1, num_micro_batches=1,
                            gpu_memory_bytes=4 << 30, profile="paper-a800"))
    model, opt = amsp_ext.shard(
        build_llama("tiny-llama", seed=0), "zero3",
        lambda params: torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                         weight_decay=p["weight_decay"]), config=config)
    losses, norms = [], []
    for step in range(ADAPTIVE_STEPS):
        loss = causal_lm_loss(model, batches(step, 1)[0])
        opt.backward(loss)
        norms.append(float(opt.clip_grad_norm_(cfg["gradient_clipping"])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "norms": norms, "switches": list(model.amsp.switches),
           "decisions": [d.line() for d in opt.adaptive.decisions]}
    opt.adaptive.close()
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    return out


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    t0 = time.perf_counter()
    cfg = adaptive_config()
    got = loop_case(cfg)
    emit("loop", got, ddp_reference(cfg, ADAPTIVE_STEPS), switches=got["switches"],
         decisions=got["decisions"])
    end_worker(t0)


if __name__ == "__main__":
    main()
