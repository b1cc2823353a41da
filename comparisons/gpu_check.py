"""The one short GPU run, for a session that is lent a device (one GPU, so no multi-rank NCCL).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 comparisons/gpu_check.py --out $OUT   # a few minutes
    PYTHONPATH=. python3 comparisons/gpu_check.py --device cpu --quick           # dry run here

What CPU machines cannot tell us, each written to ``<out>/gpu_check.json`` as it finishes:

1. ``peak``: dense bf16 matmul FLOP/s (``metrics.matmul_peak_flops``, the MFU denominator of
   ``amsp train`` and ``amsp compare``) at n = 4096 and 8192.
2. ``compute``: the step model's compute efficiency (``planner/step.py`` assumes 0.65). Forward +
   backward of LLaMA-7B-shaped decoder layers (h 4096, ffn 11008, 32 heads, seq 4096, one
   sequence, bf16, SDPA attention) with and without activation recomputation, as model FLOPs
   (the planner's Megatron-LM count) / time / measured peak. Few layers, so it fits; the
   embedding and head are included, as in the planner's count.
3. ``engine``: the same small model trained through ``amsp_ext.shard`` (plan ``ddp``, world 1,
   NCCL, bf16 with fp32 masters) and through plain PyTorch (bf16 autocast, fp32 params): losses
   side by side (the CUDA paths of masters, bf16 casting, the checkpoint RNG) and step times
   (the hook overhead on a GPU, where kernels are fast and Python costs show).
4. ``nccl``: every collective of ``runtime/collectives.py`` on a 1-rank NCCL group, async + wait
   (the stream-ordered wait path that gloo never takes), with the results checked.
5. ``calibration``: the compute part of the step model's calibration (planner/calibration.py)
   as ``amsp tune`` measures it, per model shape: forward and backward time of one micro-batch
   separately -> ``forward_flops_per_s`` / ``backward_flops_per_s`` (the planner's FLOPs count),
   an AdamW step on fp32 masters with the bf16 copy-back -> ``optimizer_bytes_per_s`` (the
   planner's 30 bytes per parameter), and the MFU peak (runtime/measure/peak.py: the device table, and
   the measured matmul rate beside it). ``section`` can be pasted into a profile's calibration.
   A 1-GPU run has no collectives, so the overlap and communication constants stay for a
   multi-GPU ``amsp tune``.
6. ``scale``: rank 0 of a 1,024-rank world (128 nodes x 8) on this GPU, LLaMA-7B, seq 4096, bf16,
   plans ``auto``, ``zero3`` and ``mics:8``: ``amsp dryrun --tensors real --device cuda``
   (tools/dryrun.py [Note: real tensors on a GPU]). The fake backend stands in for the
   other 1,023 ranks; the engine's CUDA streams, events and allocator are real. Per plan: the
   CUDA allocator's peak beside MemTracker's count and the planner's, and the step time without
   communication. The same job's CPU fake-tensor dry run is committed in
   comparisons/results/dryrun_7b/.
7. ``engine_large``: item 3 on LLaMA-7B's layer shape (4 layers, 1.07B parameters, seq 4096):
   the hooks' cost where kernels are long.
8. ``big_start``: rank 0 of a 64-rank world of LLaMA-65B under zero3 (bf16, recomputation),
   built on meta and started by ``shard()`` on the GPU: the start-up peak (allocator and
   MemTracker) beside the step's; 65B could never be held in fp32 here (260 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, *, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def check_peak(device, dtype, quick: bool) -> dict:
    from amsp_ext.common.metrics import matmul_peak_flops

    sizes = (512,) if quick else (4096, 8192)
    return {f"n{n}_tflops": matmul_peak_flops(device, dtype, n=n, seconds=0.5 if quick else 2.0) / 1e12
            for n in sizes}


def check_compute(device, dtype, peak_flops: float, quick: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from amsp_ext.common.metrics import flops_per_token

    if quick:
        cfg = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4,
                   num_key_value_heads=4, num_hidden_layers=2, vocab_size=512)
        seq = 256
    else:  # LLaMA-7B's layer shape, 4 layers
        cfg = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                   num_key_value_heads=32, num_hidden_layers=4, vocab_size=32000)
        seq = 4096
    cfg.update(max_position_embeddings=seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
    out = {"config": cfg, "seq_len": seq}
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds, not a minute of CPU
        model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa")).to(dtype)
    model.train()
    tokens = torch.randint(0, cfg["vocab_size"], (1, seq), device=device)
    fpt = flops_per_token({**cfg, "model_type": "llama"}, seq)
    for recompute in (False, True):
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def step():
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        t = statistics.median(_timed(step, device, reps=3 if quick else 10))
        achieved = fpt * seq / t
        out["recompute" if recompute else "no_recompute"] = {
            "step_s": t, "model_tflops": achieved / 1e12, "efficiency": achieved / peak_flops}
    return out


def check_calibration(device, quick: bool) -> dict:
    """The compute constants of a calibration (item 5 of the module doc)."""
    import datetime

    from transformers import LlamaConfig, LlamaForCausalLM

    from amsp_ext.common.models import llama_config_dict
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.planner.step import forward_flops_per_token
    from amsp_ext.runtime.measure.peak import device_peak

    dtype = torch.bfloat16
    from amsp_ext.runtime.collectives import CollectiveContext

    peak = device_peak(device, dtype, comm=CollectiveContext(timeout=60))
    shapes = {"small-llama": (llama_config_dict("small-llama"), 512, 8)}
    if quick:
        shapes = {"tiny-llama": (llama_config_dict("tiny-llama"), 128, 4)}
    else:  # LLaMA-7B's layer shape, 2 layers (fits with fp32 masters and AdamW states)
        shapes["llama-7b-2layers"] = (dict(
            llama_config_dict("small-llama"), hidden_size=4096, intermediate_size=11008,
            num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=2,
            vocab_size=32000, max_position_embeddings=4096), 4096, 1)
    out = {"peak": peak.as_dict(), "shapes": {}}
    for name, (cfg, seq, mbs) in shapes.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"},
                                                 attn_implementation="sdpa")).to(dtype)
        model.train()
        tokens = torch.randint(0, cfg["vocab_size"], (mbs, seq), device=device)
        fwd_flops = forward_flops_per_token(ModelSpec.from_hf_config(cfg), seq) * mbs * seq
        f_times, b_times = [], []
        for i in range(3 if quick else 8):
            _sync(device)
            t0 = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i:  # the first is warm-up
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
        masters = [p.detach().float().requires_grad_() for p in model.parameters()]
        for m in masters:
            m.grad = torch.randn_like(m)
        opt = torch.optim.AdamW(masters, lr=1e-4)
        params = list(model.parameters())

        def opt_step():
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(params, masters)  # the bf16 copy the engine keeps

        o_times = _timed(opt_step, device, reps=3 if quick else 10)
        n = sum(p.numel() for p in params)
        f, b, o = statistics.median(f_times), statistics.median(b_times), statistics.median(o_times)
        out["shapes"][name] = {
            "seq_len": seq, "micro_batch_size": mbs, "num_params": n,
            "forward_s": f, "backward_s": b, "optimizer_s": o,
            "forward_flops_per_s": fwd_flops / f, "backward_flops_per_s": 2 * fwd_flops / b,
            "optimizer_bytes_per_s": 30 * n / o,
            "forward_efficiency": fwd_flops / f / peak.flops,
            "backward_efficiency": 2 * fwd_flops / b / peak.flops,
        }
        model = opt = masters = params = None  # free before the next shape (the closure holds the names)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = "llama-7b-2layers" if "llama-7b-2layers" in out["shapes"] else next(iter(out["shapes"]))
    sh = out["shapes"][name]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out["section"] = {  # the compute part of a profile's "calibration" (1 GPU: no overlap figures)
        "source": f"comparisons/gpu_check.py, {name} seq {sh['seq_len']} x {sh['micro_batch_size']}, bf16",
        "date": datetime.date.today().isoformat(), "device": dev, "peak_flops": peak.flops,
        "forward_flops_per_s": sh["forward_flops_per_s"],
        "backward_flops_per_s": sh["backward_flops_per_s"],
        "optimizer_bytes_per_s": sh["optimizer_bytes_per_s"],
    }
    return out


def scale_spec(quick: bool, plan: str, device_type: str, **overrides):
    """Item 6's job (also gpu_scale_profile.py's): rank 0 of 128 x 8, LLaMA-7B, seq 4096, bf16,
    real tensors; ``quick``: tiny-llama on 4 x 8."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.tools.dryrun import DryRunSpec

    job = (dict(model="tiny-llama", num_nodes=4, gpus_per_node=8, seq_len=64) if quick else
           dict(model="llama-7b", num_nodes=128, gpus_per_node=8, seq_len=4096))
    return DryRunSpec(**job, plan=plan, engine=EngineConfig(precision="bf16"), ranks=(0,),
                      tensors="real", device=device_type, **overrides)


def check_scale(device, quick: bool) -> dict:
    """Item 6 of the module doc: one plan at a time, so one that fails keeps the others."""
    from amsp_ext.tools.dryrun import dry_run

    plans = ("zero3", "mics:8") if quick else ("auto", "zero3", "mics:8")
    out = {}
    for plan in plans:
        spec = scale_spec(quick, plan, device.type, steps=3)
        try:
            r = dry_run(spec, timeout_s=240)
        except Exception as e:  # noqa: BLE001 - keep the other plans
            out[plan] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        rank = r["ranks"][0]
        out[plan] = {"plan": r["plan"], "world": r["world"], "real": rank.get("real"),
                     "memtracker_peak_bytes": rank["peak_bytes"], "memory": rank["memory"],
                     "peak_moment": rank["peak_moment"], "model_state_bytes": rank["model_state_bytes"],
                     "planner": r["planner"]["memory"], "planner_peak_moment": r["planner"]["peak_moment"],
                     "seconds": rank["seconds"], "num_collectives_per_step": len(rank["collectives"])}
    return out


def check_big_start(device, quick: bool) -> dict:
    """Item 8: rank 0 of a 64-rank world (8 x 8) of LLaMA-65B under zero3, bf16, recomputation,
    built on meta and started by shard() on the GPU (real tensors, the fake backend): 65B in fp32
    is 260 GB, more than the H200 holds, so reaching the step at all is the check; the start-up
    and step peaks are the allocator's beside MemTracker's and the planner's. ``quick``:
    tiny-llama on 8 x 8."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.tools.dryrun import DryRunSpec, dry_run

    job = (dict(model="tiny-llama", seq_len=64) if quick else dict(model="llama-65b", seq_len=4096))
    spec = DryRunSpec(**job, num_nodes=8, gpus_per_node=8, plan="zero3", ranks=(0,), steps=1,
                      engine=EngineConfig(precision="bf16", recompute=True), tensors="real",
                      device=device.type)
    r = dry_run(spec, timeout_s=420)
    rank = r["ranks"][0]
    return {"plan": r["plan"], "world": r["world"], "real": rank.get("real"),
            "startup_peak_bytes": rank["startup_peak_bytes"], "startup_memory": rank["startup_memory"],
            "memtracker_peak_bytes": rank["peak_bytes"], "memory": rank["memory"],
            "model_state_bytes": rank["model_state_bytes"], "planner": r["planner"]["memory"],
            "seconds": rank["seconds"]}


def _llama_7b_layers(device, quick: bool):
    """LLaMA-7B's layer shape, 4 layers (1.07B parameters), fp32, initialised on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = (dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_hidden_layers=2,
                vocab_size=512) if quick else
           dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=4,
                vocab_size=32000))
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=cfg["num_attention_heads"],
                                            max_position_embeddings=4096, rms_norm_eps=1e-5,
                                            tie_word_embeddings=False, attn_implementation="sdpa"))


def check_engine(device, quick: bool, large: bool = False) -> dict:
    """``large``: the 7B-layer model at seq 4096 (``engine_large``): the hooks' cost where kernels
    are long, beside small-llama's where they are short."""
    import amsp_ext
    from amsp_ext.common.data import micro_batch
    from amsp_ext.common.models import build_llama, causal_lm_loss
    from amsp_ext.runtime.config import ShardConfig

    name, steps, seq, mbs = ("tiny-llama", 4, 64, 2) if quick else ("small-llama", 20, 512, 8)
    build = lambda: build_llama(name, seed=0)  # noqa: E731
    if large:
        name, steps, seq, mbs = ("7b-layers", 4, 64, 1) if quick else ("7b-layers", 10, 4096, 1)
        build = lambda: _llama_7b_layers(device, quick)  # noqa: E731

    def batch(step):
        return micro_batch(step, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=mbs,
                           seq_len=seq).to(device)

    def run(model, opt, backward, autocast: bool) -> tuple[list[float], list[float]]:
        losses, times = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = causal_lm_loss(model, batch(s))
            backward(loss)
            opt.step()
            opt.zero_grad()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return losses, times

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    plain = build().to(device)
    p_losses, p_times = run(plain, adamw(plain.parameters()), lambda l: l.backward(), True)
    plain = None  # free its states before the engine's copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model, opt = amsp_ext.shard(build(), "ddp", adamw,
                                config=ShardConfig(gpus_per_node=1, precision="bf16", timeout=120))
    a_losses, a_times = run(model, opt, opt.backward, False)
    warm = max(1, steps // 4)
    return {"model": name, "seq_len": seq, "micro_batch_size": mbs,
            "plain_autocast": {"losses": p_losses, "median_step_s": statistics.median(p_times[warm:])},
            "amsp_ddp_bf16": {"losses": a_losses, "median_step_s": statistics.median(a_times[warm:])},
            "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(a_losses, p_losses))}


def check_collectives(device) -> dict:
    from amsp_ext.runtime import collectives as C

    g = dist.group.WORLD
    ctx = C.CollectiveContext(timeout=30)
    out = {}
    x = torch.arange(8, dtype=torch.float32, device=device)
    p = C.all_reduce(ctx, x, g, name="world", stream=None, async_op=True)
    C.wait(p)
    out["all_reduce"] = bool(torch.equal(x, torch.arange(8, dtype=torch.float32, device=device)))
    y = torch.full((4,), 3.0, device=device)
    C.wait(C.broadcast(ctx, y, 0, g, name="world", stream=None, async_op=True))
    out["broadcast"] = bool((y == 3).all())
    o = torch.empty(8, device=device)
    C.wait(C.all_gather_into_tensor(ctx, o, x, g, name="world", stream=None, async_op=True))
    out["all_gather"] = bool(torch.equal(o, x))
    r = torch.empty(8, device=device)
    C.wait(C.reduce_scatter_tensor(ctx, r, x, g, name="world", stream=None, async_op=True))
    out["reduce_scatter"] = bool(torch.equal(r, x))
    C.barrier(ctx, g, name="world")
    out["barrier"] = True
    big = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB: an async op the host can outrun
    t0 = time.perf_counter()
    p = C.all_reduce(ctx, big, g, name="world", stream=None, async_op=True)
    issue = time.perf_counter() - t0
    C.wait(p)
    _sync(device)
    out["issue_s_64mib"], out["done_s_64mib"] = issue, time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a dry run on CPU)")
    ap.add_argument("--only", default=None, help="comma-separated checks to run (default: all): "
                    "nccl, peak, engine, scale, compute, calibration, engine_large, big_start")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no GPU; use --device cpu --quick for a dry run",
              file=sys.stderr)
        return 2
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "backend": dist.get_backend()}

    def save():
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))

    steps = [("nccl", lambda: check_collectives(device)),
             ("peak", lambda: check_peak(device, torch.bfloat16, a.quick)),
             ("engine", lambda: check_engine(device, a.quick)),
             ("scale", lambda: check_scale(device, a.quick)),
             ("compute", lambda: check_compute(device, torch.bfloat16,
                                               max(result["peak"].values()) * 1e12, a.quick)),
             ("calibration", lambda: check_calibration(device, a.quick)),
             ("engine_large", lambda: check_engine(device, a.quick, large=True)),
             ("big_start", lambda: check_big_start(device, a.quick))]
    only = set(a.only.split(",")) if a.only else None
    for key, fn in steps:
        if only is not None and key not in only:
            continue
        t0 = time.perf_counter()
        try:
            result[key] = fn()
        except Exception as e:  # keep the other checks' results: one device run is all we get
            result[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"gpu_check: {key} ({time.perf_counter() - t0:.1f} s): {json.dumps(result[key])[:400]}",
              flush=True)
        save()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
