"""torchrun worker for the DeepSpeed-route tests: many cases in ONE launch, ``RESULT {json}`` lines.

Every case runs a DeepSpeed-style script - ``deepspeed.initialize(model=..., config=...)`` routed
to AMSP by ``amsp_ext.patch_deepspeed()``, then per micro-batch ``loss = engine(batch)``,
``engine.backward(loss)``, ``engine.step()`` - and compares each rank's per-micro-batch losses,
and the gradient norm of each step, with the same script on torch DDP (fp32): the independent
reference. Each rank trains on its own slice of real text (amsp_ext.common.data).

Usage: torchrun --nproc-per-node 4 -m tests.integrations_worker SUITE [ARGS]
  SUITE ds          parity of the routed deepspeed.initialize, ds scheduler, bf16, engine API
  SUITE migrated    every config path in ARGS (written by ``amsp migrate``) trains like DDP
  SUITE checkpoint  save -> load -> continue equals an uninterrupted run (same and other plan)
  SUITE adaptive    ds_config amsp.adaptive: a switch by itself on a (fake) slow link, like DDP
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from tests.dist_utils import end_worker, free_plan_groups

SEQ = 32
R = 2  # ranks per "node": 4 ranks pose as 2 nodes x 2


def base_config(**amsp):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "zero_optimization": {"stage": 0},
        "amsp": {"enabled": True, "gpus_per_node": R, "timeout": 120, **amsp},
    }


def batches(step, gas):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [micro_batch(step, m, rank, world_size=world, num_micro_batches=gas,
                        micro_batch_size=1, seq_len=SEQ) for m in range(gas)]


def ddp_reference(cfg, steps, *, first_step=0, scheduler=None):
    """The same loop on torch DDP: loss / GAS per micro-batch, no_sync before the last one,
    clip_grad_norm_, AdamW (weight decay 0.1), the DeepSpeed schedule class if any."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_llama("tiny-llama", seed=0)
    ddp = DDP(model)
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    sched = scheduler(opt) if scheduler else None
    gas, clip = cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]
    losses, norms, lrs = [], [], []
    for step in range(first_step, first_step + steps):
        for m, b in enumerate(batches(step, gas)):
            if m < gas - 1:
                with ddp.no_sync():
                    loss = causal_lm_loss(ddp, b)
                    (loss / gas).backward()
            else:
                loss = causal_lm_loss(ddp, b)
                (loss / gas).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return {"losses": losses, "norms": norms, "lrs": lrs, "model": model}


def train_ds(engine, steps, *, first_step=0):
    """The DeepSpeed-style loop: engine(batch), engine.backward(loss), engine.step() each micro-batch."""
    gas = engine.gradient_accumulation_steps()
    losses, norms, lrs, applied = [], [], [], []
    for step in range(first_step, first_step + steps):
        lrs.append(engine.get_lr()[0])
        for b in batches(step, gas):
            loss = causal_lm_loss(engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        applied.append(engine.was_step_applied())
    return {"losses": losses, "norms": norms, "lrs": lrs, "applied": applied}


def worst(values):
    t = torch.tensor([max(values, default=0.0)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rel(a, b):
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]


def emit(case, got, ref, **extra):
    res = {"case": case,
           "loss_max_rel_diff": worst(rel(got["losses"], ref["losses"])),
           "norm_max_rel_diff": worst(rel(got["norms"], ref["norms"])),
           "num_losses": len(got["losses"]), **extra}
    if "lrs" in got and "lrs" in ref:
        res["lr_max_abs_diff"] = worst([abs(x - y) for x, y in zip(got["lrs"], ref["lrs"])])
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)


def release(engine):
    """End of a case: detach the hooks and free the plan's groups (tests/dist_utils.py,
    [Note: freeing a case's groups in a worker])."""
    engine.module.amsp.wait_params()
    engine.module.amsp.grad_sync.remove()
    engine.module.amsp.param_sync.remove()
    free_plan_groups(engine.module.amsp.mesh)
    for mesh in getattr(engine.module.amsp, "retired_meshes", []):  # plans switched away from
        free_plan_groups(mesh)


def initialize(cfg, **kw):
    import deepspeed

    model = build_llama("tiny-llama", seed=kw.pop("seed", 0))
    engine, opt, loader, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config=cfg, **kw)
    return engine, opt, loader, sched


def suite_ds(_args):
    import amsp_ext
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    amsp_ext.patch_deepspeed()
    # 1. routed deepspeed.initialize, a sharded plan, 5 steps, vs DDP
    cfg = base_config(plan="p=2x1,g=2x1,os=2x2")
    ref = ddp_reference(cfg, 5)
    # each rank builds different weights: initialize broadcasts rank 0's (as DeepSpeed and DDP do)
    engine, opt, loader, sched = initialize(cfg, seed=dist.get_rank())
    got = train_ds(engine, 5)
    emit("routed:p=2x1,g=2x1,os=2x2", got, ref,
         engine=type(engine).__name__, optimizer=type(opt).__name__,
         plan=str(engine.module.amsp.plan), global_steps=engine.global_steps,
         global_samples=engine.global_samples, micro_steps=engine.micro_steps,
         applied=got["applied"], batch=[engine.train_batch_size(),
                                        engine.train_micro_batch_size_per_gpu(),
                                        engine.gradient_accumulation_steps()],
         overflow=opt.overflow)
    # the consolidated state dict equals DDP's weights after the same 5 steps
    sd = engine.state_dict()
    z3 = engine._zero3_consolidated_16bit_state_dict()
    diff = max(float((sd[n] - p.detach()).abs().max()) for n, p in ref["model"].named_parameters())
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, len(z3))
    saves = check_saves(engine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"case": "state_dict", "max_abs_diff_vs_ddp": worst([diff]),
                                      "num_keys": len(sd), "z3_keys_per_rank": sizes,
                                      "saves": saves}), flush=True)
    else:
        worst([diff])
    release(engine)

    # 2. a scheduler block (DeepSpeed's WarmupDecayLR) and the Adam name with adam_w_mode
    cfg = base_config(plan="p=1x1,g=2x2,os=2x2")
    cfg["optimizer"]["type"] = "Adam"  # DeepSpeed: AdamW unless adam_w_mode is false
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 5}}
    ref = ddp_reference(cfg, 5, scheduler=lambda o: WarmupDecayLR(
        o, total_num_steps=5, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=2))
    engine, opt, _, sched = initialize(cfg, mpu=_DataParallelOnlyMPU())  # a Megatron-style call
    got = train_ds(engine, 5)
    emit("scheduler:WarmupDecayLR", got, ref, scheduler=type(sched).__name__, lrs=got["lrs"])
    release(engine)

    # 3. the Accelerate / HF Trainer style: boundary set before each backward, no_sync, one
    #    step() per micro-batch, client optimizer object and client callable scheduler
    cfg = base_config(plan="p=1x1,g=1x1,os=2x2")
    cfg.pop("optimizer")
    ref = ddp_reference(base_config(), 3)
    import deepspeed

    model = build_llama("tiny-llama", seed=0)
    client = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    engine, opt, _, sched = deepspeed.initialize(
        model=model, optimizer=client, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))
    losses, norms = [], []
    for step in range(3):
        bs = batches(step, 2)
        for m, b in enumerate(bs):
            last = m == len(bs) - 1
            engine.set_gradient_accumulation_boundary(last)
            ctx = engine.no_sync() if not last else _null()
            with ctx:
                loss = causal_lm_loss(engine, b)
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    emit("boundary-api+client-optimizer", {"losses": losses, "norms": norms}, ref,
         same_optimizer_object=opt.inner is client, client_lr=client.param_groups[0]["lr"])
    release(engine)

    # 4. bf16: parameters in bf16, fp32 masters, losses close to fp32 DDP
    cfg = base_config(plan="p=2x1,g=2x1,os=2x2")
    cfg["bf16"] = {"enabled": True}
    ref = ddp_reference(base_config(), 3)
    engine, opt, _, _ = initialize(cfg)
    got = train_ds(engine, 3)
    emit("bf16", got, ref, param_dtype=str(next(engine.module.parameters()).dtype),
         master_dtype=str(next(iter(opt.masters.values())).dtype) if opt.masters else None,
         bf16_enabled=engine.bfloat16_enabled())
    release(engine)

    # 5. fp16: the dynamic loss scale from the fp16 block; an overflowing step is skipped the
    #    DeepSpeed way (optimizer.overflow, was_step_applied False, no scheduler step, counters)
    cfg = base_config(plan="p=1x1,g=2x2,os=2x2")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1000}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, opt, _, sched = initialize(cfg)
    trace = []
    for step in range(3):
        for m, b in enumerate(batches(step, 2)):
            loss = causal_lm_loss(engine, b)
            if step == 1 and m == 1 and dist.get_rank() == 3:
                loss = loss * float("inf")  # one rank, one micro-batch: the whole step must skip
            engine.backward(loss)
            engine.step()
        trace.append({"overflow": opt.overflow, "applied": engine.was_step_applied(),
                      "lr": engine.get_lr()[0], "scale": engine.get_loss_scale(),
                      "global_steps": engine.global_steps, "skipped": engine.skipped_steps})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"case": "fp16-overflow", "trace": trace,
                                      "param_dtype": str(next(engine.module.parameters()).dtype)}),
              flush=True)
    release(engine)

    # 6. the DeepSpeed dataloader from training_data: DistributedSampler, micro-batch size
    data = [torch.tensor([i]) for i in range(16)]
    engine, _, loader, _ = initialize(base_config(plan="ddp"), training_data=data)
    seen = [int(x) for b in loader for x in b.flatten()]
    all_seen = [None] * dist.get_world_size()
    dist.all_gather_object(all_seen, seen)
    if dist.get_rank() == 0:
        flat = sorted(x for s in all_seen for x in s)
        print("RESULT " + json.dumps({"case": "dataloader", "per_rank": [len(s) for s in all_seen],
                                      "disjoint_cover": flat == list(range(16)),
                                      "batch_size": loader.batch_size}), flush=True)
    release(engine)


def check_saves(engine):
    """Every way a DeepSpeed script saves ``engine.module`` (a sharded plan: its parameters are
    DTensors) against amsp_ext.consolidated_state_dict: max abs difference per way (rank 0)."""
    from safetensors.torch import load_file

    import amsp_ext

    module = engine.module
    ref = amsp_ext.consolidated_state_dict(module, rank0_only=False)
    root = tempfile.mkdtemp(prefix="amsp-saves-") if dist.get_rank() == 0 else None
    obj = [root]
    dist.broadcast_object_list(obj, src=0)
    root = obj[0]
    main = dist.get_rank() == 0
    try:
        got = {"module.state_dict": module.state_dict(), "engine.state_dict": engine.state_dict()}
        module.save_pretrained(os.path.join(root, "plain"), is_main_process=main)
        module.save_pretrained(os.path.join(root, "sd"), is_main_process=main, state_dict=module.state_dict())
        engine.save_16bit_model(os.path.join(root, "16bit"))
        dist.barrier()
        got["save_pretrained"] = load_file(os.path.join(root, "plain", "model.safetensors"))
        got["save_pretrained+state_dict"] = load_file(os.path.join(root, "sd", "model.safetensors"))
        got["save_16bit_model"] = torch.load(os.path.join(root, "16bit", "pytorch_model.bin"))
        out = {}
        for name, sd in got.items():
            if sorted(sd) != sorted(ref):
                out[name] = f"keys differ: {sorted(set(sd) ^ set(ref))[:3]}"
            else:
                out[name] = max(float((sd[k].float().cpu() - ref[k]).abs().max()) for k in ref)
        dist.barrier()  # every rank has read the files
    finally:  # also when a save or a read failed: no folder left behind
        if main:
            shutil.rmtree(root, ignore_errors=True)
    return out


class _DataParallelOnlyMPU:
    """What Megatron-style scripts pass as ``mpu`` when tensor and pipeline parallelism are 1."""

    def get_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_data_parallel_world_size(self):
        return dist.get_world_size()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def suite_migrated(paths):
    import amsp_ext

    amsp_ext.patch_deepspeed()
    ref = None
    for path in paths:
        with open(path) as f:
            cfg = json.load(f)
        cfg["amsp"]["timeout"] = 120
        if ref is None:
            ref = ddp_reference(cfg, 3)
        engine, _, _, _ = initialize(cfg)
        got = train_ds(engine, 3)
        emit(f"migrated:{os.path.basename(path)}", got, ref, plan=str(engine.module.amsp.plan),
             written_plan=cfg["amsp"]["plan"])
        release(engine)


def suite_checkpoint(_args):
    import amsp_ext

    amsp_ext.patch_deepspeed()
    root = tempfile.mkdtemp(prefix="amsp-ds-ckpt-") if dist.get_rank() == 0 else None
    obj = [root]
    dist.broadcast_object_list(obj, src=0)
    root = obj[0]
    try:
        _checkpoint_cases(root)
        dist.barrier()  # no rank reads the checkpoints any more
    finally:  # also when a case failed: no folder left behind
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(root + "-damaged", ignore_errors=True)


def _checkpoint_cases(root):
    cfg = base_config(plan="p=2x1,g=2x1,os=2x2")
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}
    a, _, _, _ = initialize(cfg)
    train_ds(a, 3)
    a.save_checkpoint(root, client_state={"epoch": 7})
    uninterrupted = train_ds(a, 2, first_step=3)
    release(a)
    for plan in ("p=2x1,g=2x1,os=2x2", "p=1x1,g=2x2,os=2x2"):
        c = copy.deepcopy(cfg)
        c["amsp"]["plan"] = plan
        b, _, _, _ = initialize(c, seed=5)
        path, client = b.load_checkpoint(root)
        resumed = train_ds(b, 2, first_step=3)
        emit(f"resume:{plan}", resumed, uninterrupted, client_state=client,
             global_steps=b.global_steps, tag=os.path.basename(path or ""),
             latest=open(os.path.join(root, "latest")).read().strip())
        release(b)
    # a flipped byte in one rank's data file: every rank refuses with one line naming the file
    if dist.get_rank() == 0:
        shutil.copytree(root, root + "-damaged")
        f = os.path.join(root + "-damaged", "global_step3", "shard-00002-model-00001-of-00001.safetensors")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(f, "wb").write(bytes(data))
    dist.barrier()
    d, _, _, _ = initialize(cfg, seed=5)
    try:
        d.load_checkpoint(root + "-damaged")
        err = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        err = f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    emit("damaged", {"losses": [], "norms": []}, {"losses": [], "norms": []}, errors=errors,
         listing=sorted(os.listdir(root)))
    release(d)




# adaptive: ADAPTIVE_K and the 4 ranks' AMSP_FAULTS "slow" come from the test (one constant)
ADAPTIVE_STEPS = 12
ADAPTIVE = {"window": 4, "band": [1e-3, 1e4], "min_steps_between_switches": 0}


def adaptive_config():
    """zero3 on 2 x 2 (its gathers cross nodes), M = 1, ds_config ``amsp.adaptive`` with the
    band of tests/test_adaptive_train.py (the bundled A800 profile is ~200x off on CPU)."""
    cfg = base_config(plan="zero3", seq_len=SEQ, adaptive=ADAPTIVE, granularity="layer",
                      gpus_per_node=R, gpu_memory="4GiB")
    cfg["gradient_accumulation_steps"] = 1
    return cfg


def suite_adaptive(_args):
    """A DeepSpeed script with ds_config ``amsp.adaptive`` switches plans by itself once the
    monitor sees the (fake) slow link, and trains like DDP on every step."""
    import amsp_ext

    amsp_ext.patch_deepspeed()
    cfg = adaptive_config()
    ref = ddp_reference(cfg, ADAPTIVE_STEPS)
    engine, opt, _, _ = initialize(cfg)
    got = train_ds(engine, ADAPTIVE_STEPS)
    emit("adaptive", got, ref, switches=list(engine.module.amsp.switches),
         decisions=[d.line() for d in opt.adaptive.decisions])
    opt.adaptive.close()
    release(engine)


SUITES = {"ds": suite_ds, "migrated": suite_migrated, "checkpoint": suite_checkpoint,
          "adaptive": suite_adaptive}


def main():
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    t0 = time.perf_counter()
    for suite in sys.argv[1].split(","):
        args = [a for a in sys.argv[2:]]
        SUITES[suite](args)
    end_worker(t0)


if __name__ == "__main__":
    main()
