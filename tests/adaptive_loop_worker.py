"""torchrun worker: adaptive AMSP outside ``amsp train``, ``RESULT {json}`` lines.

Two cases in one launch of 4 gloo ranks posing as 2 nodes x 2, tiny-llama, M = 1, plan zero3
(its gathers and reduce-scatters cross nodes), adaptive with window 4 and no minimum between
switches. From step ``K`` (``AMSP_FAULTS`` set by the test: ``slow`` multiplies the monitor's
measured cross-node times, faults.py) the monitor sees a slow link, so each case must switch
plans by itself, at the end of an ``optimizer.step()``:

* ``loop``: your own loop on ``amsp_ext.shard(..., config=ShardConfig(adaptive=...))``;
* ``deepspeed``: a DeepSpeed script (``deepspeed.initialize`` routed by patch_deepspeed) with
  ds_config ``amsp.adaptive``.

Every step's loss and gradient norm is compared with the same loop on torch DDP (fp32), the
independent reference: they hold only if the switch moved masters and optimizer states exactly
and the loop went on with the same optimizer object.

Usage: torchrun --nproc-per-node 4 -m tests.adaptive_loop_worker
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from amsp_ext.models import build_llama, causal_lm_loss
from tests.dist_utils import end_worker
from tests.integrations_worker import (SEQ, base_config, batches, ddp_reference, emit, initialize,
                                       train_ds)

K, WINDOW, STEPS = 4, 4, 12
ADAPTIVE = {"window": WINDOW, "band": [1e-3, 1e4], "min_steps_between_switches": 0}


def loop_case(cfg) -> dict:
    import amsp_ext
    from amsp_ext.runtime.config import AdaptiveConfig, AutoPlanConfig, ShardConfig

    p = cfg["optimizer"]["params"]
    config = ShardConfig(
        gpus_per_node=2, granularity="layer", timeout=120,
        adaptive=AdaptiveConfig(**ADAPTIVE),
        auto=AutoPlanConfig(seq_len=SEQ, micro_batch_size=1, num_micro_batches=1,
                            gpu_memory_bytes=4 << 30))
    model, opt = amsp_ext.shard(
        build_llama("tiny-llama", seed=0), "zero3",
        lambda params: torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                         weight_decay=p["weight_decay"]), config=config)
    losses, norms = [], []
    for step in range(STEPS):
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
    import amsp_ext

    t0 = time.perf_counter()
    cfg = base_config(plan="zero3", seq_len=SEQ, adaptive=ADAPTIVE, granularity="layer",
                      cluster={"gpus_per_node": 2, "gpu_memory": "4GiB"})
    cfg["gradient_accumulation_steps"] = 1
    ref = ddp_reference(cfg, STEPS)
    got = loop_case(cfg)
    emit("loop", got, ref, switches=got["switches"], decisions=got["decisions"])

    amsp_ext.patch_deepspeed()
    engine, _, _, _ = initialize(cfg)
    got = train_ds(engine, STEPS)
    opt = engine.optimizer
    inner = getattr(opt, "adaptive", None) or getattr(getattr(opt, "optimizer", None), "adaptive", None)
    emit("deepspeed", got, ref, switches=list(engine.module.amsp.switches),
         decisions=[d.line() for d in inner.decisions] if inner else None)
    end_worker(t0)


if __name__ == "__main__":
    main()
