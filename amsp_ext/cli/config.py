"""``amsp config``: write ready configs for running AMSP under Accelerate, the HF Trainer or DeepSpeed.

    amsp config accelerate [--plan auto] [--num-processes N] [--seq-len L] [-o amsp.yaml]
        -> amsp.yaml (DEEPSPEED-type Accelerate config, absolute path to:)
           amsp.ds_config.json (batch/precision "auto" for Accelerate to fill, the amsp block)
    amsp config deepspeed [--plan ...] [--micro-batch-size B --grad-accum M] [-o ds_config.json]
        -> a ds_config with the amsp block, for TrainingArguments(deepspeed=...) or
           deepspeed.initialize(config=...)

[Note: why generated, not shipped]
The files are written from this module, so they exist wherever amsp_ext is installed (a
repository's ``configs/`` does not travel with ``pip install``), and the Accelerate YAML names
its ds_config by absolute path: Accelerate reads ``deepspeed_config_file`` relative to the
directory the job is launched from. The amsp block is validated before anything is written.
Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from amsp_ext import schema
from amsp_ext.choices import PRECISIONS, check_int
from amsp_ext.engine_config import EngineConfig
from amsp_ext.cli.planner_flags import add_gpu_memory, add_profile
from amsp_ext.planner.defaults import CLUSTER_PROFILE
from amsp_ext.planner.specs import StepShape

HELP = "write a ready Accelerate YAML + ds_config pair (accelerate) or a ds_config (deepspeed) that runs AMSP"

_AUTO = "auto"


def _count_gpus() -> int:
    """GPUs the NVIDIA driver lists (torch-free); 0 without one."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _common(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("-o", "--output", default=default_out, metavar="PATH",
                   help=f"where to write (default: ./{default_out})")
    p.add_argument("--plan", default="auto",
                   help="'auto' (the planner at start-up; default), a baseline (ddp, zero1, zero2, "
                        "zero3, mics:K) or factors such as p=8x1,g=8x1,os=8x4")
    # written as amsp.seq_len, for the planner; no guess: plan "auto" sizes activations by it
    schema.add_arguments(p, StepShape, only=("seq_len",), unset=("seq_len",))
    schema.add_arguments(p, EngineConfig, only=("gpus_per_node",))  # the amsp block's, as it is
    add_gpu_memory(p, default=None, what="memory per GPU for the planner")
    add_profile(p, what="bandwidth profile for the planner", default=CLUSTER_PROFILE)
    p.add_argument("--precision", choices=(_AUTO, *PRECISIONS), default=_AUTO,
                   help="'auto' (default): the Trainer / Accelerate fill it from their own flags")
    p.add_argument("--gradient-clipping", default="auto", metavar="X|auto",
                   help="global-norm clipping threshold, 0 for none (default auto: the launcher fills it)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    a = sub.add_parser("accelerate", help="an Accelerate YAML + its ds_config (accelerate launch --config_file)")
    _common(a, "amsp.yaml")
    a.add_argument("--num-processes", type=int, default=None,
                   help="ranks in all (default: this machine's GPUs, or 2 CPU ranks without one)")
    a.add_argument("--num-machines", type=int, default=1, help="machines (default 1)")
    a.add_argument("--ds-config", default=None, metavar="PATH",
                   help="where to write the ds_config (default: <output stem>.ds_config.json)")
    d = sub.add_parser("deepspeed", help="a ds_config for the HF Trainer or deepspeed.initialize")
    _common(d, "ds_config.amsp.json")
    d.add_argument("--micro-batch-size", type=int, default=None,
                   help="train_micro_batch_size_per_gpu (default 'auto': the Trainer fills it; "
                        "a plain DeepSpeed script needs a number)")
    d.add_argument("--grad-accum", type=int, default=None,
                   help="gradient_accumulation_steps (default 'auto', as above)")


def _positive(v: int | None, flag: str) -> None:
    check_int(v, flag, allow_none=True)


def _clip(text: str) -> float | str:
    if text == _AUTO:
        return _AUTO
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if v < 0:
        raise ValueError(f"--gradient-clipping must be 'auto' or a number >= 0, got {text!r}")
    return v


def ds_config(args, *, micro_batch: int | None, grad_accum: int | None) -> dict[str, Any]:
    """The ds_config both targets write (validated amsp block)."""
    from amsp_ext.integrations.settings import AMSPSettings

    for flag in ("seq_len", "gpus_per_node"):
        _positive(getattr(args, flag), f"--{flag.replace('_', '-')}")
    block: dict[str, Any] = {"enabled": True, "plan": args.plan}
    if args.gpus_per_node is not None:
        block["gpus_per_node"] = args.gpus_per_node
    if args.gpu_memory is not None:
        block["gpu_memory"] = args.gpu_memory
    if args.plan.strip().lower() == _AUTO:
        if args.seq_len is None:
            raise ValueError("--seq-len is required with --plan auto (the planner sizes activations by it; "
                             "it is written as amsp.seq_len); or give --plan as factors or a baseline name")
        block["seq_len"] = args.seq_len
        block["profile"] = args.profile
    AMSPSettings.from_dict(block)  # one line naming the field, before anything is written
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch if micro_batch is not None else _AUTO,
        "gradient_accumulation_steps": grad_accum if grad_accum is not None else _AUTO,
        "gradient_clipping": _clip(args.gradient_clipping),
    }
    if micro_batch is None or grad_accum is None:
        cfg["train_batch_size"] = _AUTO
    if args.precision == _AUTO:
        cfg["bf16"] = {"enabled": _AUTO}
    else:
        cfg["bf16"] = {"enabled": args.precision == "bf16"}
        cfg["fp16"] = {"enabled": args.precision == "fp16"}
    # Accelerate requires the block; AMSP's plan replaces it, and "enabled": false runs stage 0
    cfg["zero_optimization"] = {"stage": 0}
    cfg["amsp"] = block
    return cfg


def _yaml(ds_path: Path, num_processes: int, num_machines: int) -> str:
    # written by hand (no YAML library needed); every value is a plain scalar
    return "\n".join([
        "# Written by `amsp config accelerate`: an Accelerate DEEPSPEED-type config whose ds_config",
        "# carries \"amsp\": {\"enabled\": true}; amsp_ext's start-up hook then runs AMSP instead of",
        "# DeepSpeed. Set \"enabled\": false in the ds_config to run DeepSpeed.",
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: DEEPSPEED",
        "deepspeed_config:",
        f"  deepspeed_config_file: {json.dumps(str(ds_path))}",
        "  deepspeed_multinode_launcher: standard",
        "machine_rank: 0",
        "main_training_function: main",
        f"num_machines: {num_machines}",
        f"num_processes: {num_processes}",
        "rdzv_backend: static",
        "same_network: true",
        "use_cpu: false",
        "",
    ])


def _plan_words(cfg: dict[str, Any]) -> str:
    b = cfg["amsp"]
    if str(b["plan"]).lower() == _AUTO:
        return f"plan auto (the planner chooses at start-up for seq {b['seq_len']})"
    return f"plan {b['plan']}"


def _run_accelerate(args) -> int:
    _positive(args.num_processes, "--num-processes")
    _positive(args.num_machines, "--num-machines")
    num = args.num_processes
    note = ""
    if num is None:
        gpus = _count_gpus()
        num, note = (gpus, f" ({gpus} GPUs found)") if gpus else (2, " (no GPU found: 2 CPU ranks)")
    if num % args.num_machines:
        raise ValueError(f"--num-processes {num} must be a multiple of --num-machines {args.num_machines}")
    cfg = ds_config(args, micro_batch=None, grad_accum=None)
    out = Path(args.output).resolve()
    ds_path = Path(args.ds_config).resolve() if args.ds_config else out.with_name(out.stem + ".ds_config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    ds_path.parent.mkdir(parents=True, exist_ok=True)
    ds_path.write_text(json.dumps(cfg, indent=2) + "\n")
    out.write_text(_yaml(ds_path, num, args.num_machines))
    print(f"wrote {out}: Accelerate DEEPSPEED-type config, {num} process(es) on "
          f"{args.num_machines} machine(s){note}")
    print(f"wrote {ds_path}: amsp.enabled, {_plan_words(cfg)}; batch, precision and clipping "
          f"'auto' (Accelerate fills them)")
    print(f"run:  accelerate launch --config_file {out} your_script.py")
    return 0


def _run_deepspeed(args) -> int:
    _positive(args.micro_batch_size, "--micro-batch-size")
    _positive(args.grad_accum, "--grad-accum")
    cfg = ds_config(args, micro_batch=args.micro_batch_size, grad_accum=args.grad_accum)
    out = Path(args.output).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    autos = [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                         "gradient_clipping") if cfg[k] == _AUTO]
    if cfg["bf16"]["enabled"] == _AUTO:
        autos.append("bf16.enabled")
    print(f"wrote {out}: amsp.enabled, {_plan_words(cfg)}")
    print(f"HF Trainer:  TrainingArguments(..., deepspeed={str(out)!r})")
    print(f"DeepSpeed:   deepspeed.initialize(..., config={str(out)!r})")
    if autos:
        print(f"  'auto' ({', '.join(autos)}) is filled by the Trainer and Accelerate; a plain "
              f"DeepSpeed script needs numbers: --micro-batch-size, --grad-accum, --precision, "
              f"--gradient-clipping")
    return 0


def run(args: argparse.Namespace) -> int:
    return _run_accelerate(args) if args.target == "accelerate" else _run_deepspeed(args)
