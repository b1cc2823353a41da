"""Where one rank's step goes at 1,024 ranks on a GPU: AMSP's plans and plain FSDP2, same units.

    AMSP_ALLOW_UNCHECKED_TORCH=1 PYTHONPATH=. PYTHONUNBUFFERED=1 \
        python3 comparisons/gpu_scale_profile.py --out $OUT
    PYTHONPATH=. python3 comparisons/gpu_scale_profile.py --device cpu --quick --out /tmp/gsp   # dry run here

gpu_check.py's ``scale`` item ran rank 0 of a 128 x 8 world (fake backend, real tensors on the
GPU; tools/dryrun.py [Note: real tensors on a GPU]) and found ZeRO-3's step without
communication twice as long as the other plans' (0.88 s against 0.42-0.43 s, LLaMA-7B, seq
4096). Each case here runs in its own process and reports:

* ``step_s``: the median of 3 timed steps after 2 warm-up steps (no memory tracker);
* ``fake_backend_cpu_s``: host time per step inside the engine's collective calls (its
  observer's ``issue`` to ``issued``). On this backend that is the fake process group's own
  work: it fills an all-gather's output with one copy per rank (1,024 copy kernels a gather),
  which a real NCCL all-gather does not launch, so it is the simulation's cost, not the engine's;
* ``peak_allocated`` / ``peak_reserved`` bytes over the timed steps;
* one profiled step (``torch.profiler``, CPU and CUDA): ``gpu_busy_s``, the kernels' own time
  summed (kernels that overlap on two streams count twice, and the profiler slows them: on the
  H200 it exceeded the unprofiled step), the number of kernels, the host time under each
  ``amsp::`` and ``FSDP::`` label, and the ops with the most host time.

Cases: ``amsp:<plan>`` (``amsp_ext.shard``, bf16, fp32 masters) and ``fsdp2:zero3``: torch's
``fully_shard`` applied to the same units as the engine's (its ``granularity``, by default one
per decoder layer plus the embedding, the final norm and the head) over one 1,024-rank mesh,
with bf16 parameters and fp32 reduction: the same sharding without AMSP's code. ``+expandable``
runs a case with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (reserved against
allocated memory). Results: comparisons/results/gpu_h200_2026-12-04.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("amsp:zero3", "fsdp2:zero3", "amsp:mics:8+expandable", "amsp:mics:8", "amsp:p=8x16,g=8x16,os=8x16")


def _spec(quick: bool, plan: str, device: str):
    from gpu_check import scale_spec  # the same job as gpu_check.py's item `scale`

    if quick and plan.startswith("p="):  # factors for 128 nodes do not fit 4
        plan = "p=8x2,g=8x2,os=8x2"
    return scale_spec(quick, plan, device)


def _fsdp2(model, world: int, device, granularity: str):
    """Plain FSDP2 on the engine's units (see the module doc)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from amsp_ext.runtime.sync.units import list_units

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = list_units(model, granularity)
    for u in reversed(units[1:]):  # innermost first (a Linear before its layer, with "module")
        fully_shard(u.module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_case(case: str, quick: bool, device_type: str, profile_step: bool = True) -> dict:
    import torch
    import torch.distributed as dist

    from amsp_ext.runtime import _torch_compat as compat
    from amsp_ext.runtime import collectives as C
    from amsp_ext.tools.dryrun import CollectiveLog, build_model, dry_step
    from amsp_ext.runtime.shard import shard
    from amsp_ext.common.models import causal_lm_loss

    system, plan = case.split("+")[0].split(":", 1)
    spec = _spec(quick, plan, device_type)
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=spec.world)
    cuda = device_type == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"case": case, "world": spec.world, "model": spec.model, "seq_len": spec.seq_len,
                 "torch": torch.__version__}
    t0 = time.perf_counter()
    model = build_model(spec, device, on_meta=False)
    out["build_s"] = time.perf_counter() - t0
    fake_s = [0.0]
    started: dict = {}

    def timer(event, op, name, info):  # host time inside each collective call (see module doc)
        if event == "issue":
            started[op, name] = time.perf_counter()
        elif event == "issued" and (op, name) in started:
            fake_s[0] += time.perf_counter() - started.pop((op, name))

    clog = CollectiveLog(world=spec.world, gpus_per_node=spec.gpus_per_node)
    if system == "amsp":
        comm = C.CollectiveContext(timeout=spec.engine.timeout, observers=[clog, timer])
        config = dataclasses.replace(spec.engine, gpus_per_node=spec.gpus_per_node)
        model, opt = shard(model, spec.plan, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                           config=config, comm=comm)
        out["plan"] = str(model.amsp.plan)

        def step():
            dry_step(model, opt, spec, device, clog)
    else:
        model, opt = _fsdp2(model, spec.world, device, spec.engine.granularity)

        def step():
            batch = torch.zeros(spec.micro_batch_size, spec.seq_len + 1, dtype=torch.long, device=device)
            loss = causal_lm_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    out["shard_s"] = time.perf_counter() - t0 - out["build_s"]
    for _ in range(2):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    fake_s[0] = 0.0
    for _ in range(3):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    out["step_s"] = statistics.median(times)
    out["step_times"] = times
    out["fake_backend_cpu_s"] = fake_s[0] / 3 if system == "amsp" else None
    if cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
    print(json.dumps(out), flush=True)  # the timings survive a slow profile
    if not profile_step:
        return out
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
        sync()
    t = time.perf_counter()
    avgs = prof.key_averages()

    def dev_self(e):  # the name changed between releases
        return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)

    kernels = [e for e in avgs if dev_self(e) > 0]
    out["profile"] = {
        "gpu_busy_s": sum(dev_self(e) for e in kernels) / 1e6,
        "num_kernels": sum(e.count for e in kernels),
        "labels_cpu_s": {e.key: e.cpu_time_total / 1e6 for e in avgs
                         if e.key.startswith(("amsp::", "FSDP::")) and e.cpu_time_total > 1000},
        "top_self_cpu": [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in
                         sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:15]],
        "postprocess_s": time.perf_counter() - t,
    }
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_scale_profile_out"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny-llama on 32 ranks (a dry run on CPU)")
    ap.add_argument("--cases", default=";".join(CASES),
                    help="';'-separated cases (plans contain commas)")
    ap.add_argument("--case-timeout", type=float, default=100.0)
    ap.add_argument("--no-profile", action="store_true", help="timings only, no profiled step")
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._one:
        run_case(a._one, a.quick, a.device, profile_step=not a.no_profile)
        os._exit(0)  # the fake groups' teardown is not worth waiting for
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in a.cases.split(";"):
        env = dict(os.environ)
        if case.endswith("+expandable"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cmd = [sys.executable, __file__, "--_one", case, "--device", a.device] + \
            (["--quick"] if a.quick else []) + (["--no-profile"] if a.no_profile else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.case_timeout, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            results[case] = json.loads(lines[-1]) if lines else {
                "error": (p.stderr.strip().splitlines() or ["(no output)"])[-1][:1000]}
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            results[case] = json.loads(lines[-1]) if lines else {"error": "timed out"}
            results[case]["timed_out_after_s"] = a.case_timeout
        results[case]["wall_s"] = time.perf_counter() - t0
        print(f"gpu_scale_profile: {case}: {json.dumps(results[case])[:1200]}", flush=True)
        (out_dir / "gpu_scale_profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
