"""``amsp tune``: measure the candidate plans on the real cluster, check the planner against them,
and optionally calibrate its step model. Runs on every rank, like ``amsp profile``:

    amsp cluster run -- -m amsp_ext.cli tune --model small-llama --profile lab.json \\
        --seq-len 128 --micro-batch-size 4 --micro-batches 1 --repeats 2 \\
        --out comparisons/results/tune-A --calibrate-out lab.calibrated.json
    torchrun --nproc-per-node 8 -m amsp_ext.cli tune --model-config config.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

HELP = "measure the candidate plans on this cluster; planner vs measured, calibration"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from amsp_ext.models import MODEL_CONFIGS

    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", default=None, help=f"built-in model: {', '.join(sorted(MODEL_CONFIGS))} "
                                                 "(default small-llama)")
    m.add_argument("--model-config", metavar="PATH", help="a Llama-style Hugging Face config.json")
    j = p.add_argument_group("job shape")
    j.add_argument("--seq-len", type=int, default=128)
    j.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    j.add_argument("--micro-batches", type=int, default=1, help="M micro-batches per step")
    j.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    j.add_argument("--recompute", action="store_true")
    j.add_argument("--granularity", default="layer", choices=("module", "layer"))
    j.add_argument("--bucket-size", default="1MiB", metavar="SIZE", help="gradient bucket U (default 1MiB)")
    pl = p.add_argument_group("planner")
    pl.add_argument("--profile", default="paper-a800", metavar="NAME|PATH",
                    help="bandwidth profile (with a calibration section: its predictions are shown too)")
    pl.add_argument("--missing-mesh", choices=("error", "fit"), default="fit")
    pl.add_argument("--gpu-memory", default=None, metavar="SIZE",
                    help="memory per GPU the plans must fit in (default: the device's; CPU: RAM / ranks per node)")
    pl.add_argument("--memory-reserve", default="0B", metavar="SIZE", help="kept free per GPU (default 0B)")
    pl.add_argument("--top", type=int, default=None,
                    help="the planner's top K per objective plus the fitting baselines "
                         "(default: every fitting legal plan when at most 16, else 8)")
    pl.add_argument("--plan", action="append", default=[], metavar="PLAN",
                    help="measure these plans instead (repeatable): factors or ddp|zero1|zero2|zero3|mics:K")
    ms = p.add_argument_group("measurement")
    ms.add_argument("--steps", type=int, default=8, help="timed steps per plan and round (default 8)")
    ms.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before them (default 2)")
    ms.add_argument("--repeats", type=int, default=2,
                    help="rounds over all plans, in alternated order (default 2)")
    ms.add_argument("--probe-steps", type=int, default=5, help="compute-probe steps per round")
    ms.add_argument("--peak-tflops", type=float, default=None,
                    help="MFU peak per GPU (default: the device table on GPU, measured on CPU)")
    ms.add_argument("--seed", type=int, default=0)
    ms.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective times out")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="tune-out", help="folder for tune.json, tune.md and the plot")
    o.add_argument("--calibrate-out", metavar="PATH", default=None,
                   help="fit the step model's constants on this run and write the profile with a "
                        "calibration section here")


def spec_from_args(args: argparse.Namespace):
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.tune.spec import SpecError, TuneSpec

    model_config = None
    if args.model_config:
        try:
            with open(args.model_config) as f:
                model_config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SpecError(f"--model-config {args.model_config}: cannot read a JSON object ({e})") from None
    return TuneSpec(
        model=args.model or "small-llama", model_config=model_config, seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size, num_micro_batches=args.micro_batches,
        precision=args.precision, recompute=args.recompute, granularity=args.granularity,
        bucket_bytes=parse_size(args.bucket_size, field="--bucket-size"),
        profile=args.profile, missing=args.missing_mesh,
        gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory") if args.gpu_memory else None,
        memory_reserve_bytes=parse_size(args.memory_reserve, field="--memory-reserve", allow_zero=True),
        top=args.top, plans=tuple(args.plan), steps=args.steps, warmup_steps=args.warmup_steps,
        repeats=args.repeats, probe_steps=args.probe_steps, seed=args.seed, timeout=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    from amsp_ext.planner.profile import load_profile

    spec = spec_from_args(args)  # bad flags fail here, before any rank talks to another
    load_profile(spec.profile)  # a bad profile too
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ValueError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR") if k not in os.environ]
    if missing:
        raise ValueError(
            "amsp tune runs on every rank; start it with torchrun or the lab, e.g. `amsp cluster "
            f"run -- -m amsp_ext.cli tune ...` (missing {', '.join(missing)})")
    from amsp_ext.tune.run import run_tune

    command = "amsp " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "amsp tune"
    return run_tune(spec, out_dir=args.out, calibrate_out=args.calibrate_out,
                    peak_override=args.peak_tflops * 1e12 if args.peak_tflops else None,
                    command=command)
