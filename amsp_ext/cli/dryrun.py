"""``amsp dryrun``: run the real engine for sampled ranks of a huge world on fake tensors
(``--tensors real --device cuda``: allocated on this machine's GPU, its allocator measured).

    amsp dryrun --model llama-7b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB \\
                --seq-len 4096 --micro-batches 1 --precision bf16 --plan zero3 [--ranks 0,1023] [--json] [--out DIR]

See tools/dryrun.py [Note: dry run]. Each sampled rank runs in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from amsp_ext import schema
from amsp_ext.cli.plan import PLANNED_ENGINE_FIELDS
from amsp_ext.choices import DRYRUN_DEVICES, DRYRUN_TENSORS
from amsp_ext.engine_config import EngineConfig
from amsp_ext.cli.planner_flags import add_gpu_memory, add_missing_mesh, add_profile, check_counts

HELP = ("dry-run the engine for sampled ranks of a large world (fake backend; fake tensors, "
        "or real ones on a GPU)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from amsp_ext.planner.model_spec import MODEL_PRESETS
    from amsp_ext.common.models import MODEL_CONFIGS

    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help=f"preset: {', '.join([*MODEL_PRESETS, *MODEL_CONFIGS])}")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json of a Llama-style model")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, required=True, help="N, number of nodes")
    c.add_argument("--gpus-per-node", type=int, required=True, help="R, GPUs per node")
    add_gpu_memory(c)
    add_profile(c, what="bandwidth profile for --plan auto")
    add_missing_mesh(c)
    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int, required=True)
    t.add_argument("--micro-batch-size", type=int, default=1)
    t.add_argument("--micro-batches", type=int, default=1, help="M per step")
    # the engine's own flags and defaults (engine_config.py), as `amsp plan` has them
    schema.add_arguments(t, EngineConfig, only=PLANNED_ENGINE_FIELDS)
    d = p.add_argument_group("dry run")
    d.add_argument("--plan", default="auto", help="auto, a name (zero3, mics:8, ...) or p=..,g=..,os=..")
    d.add_argument("--ranks", default=None, help="comma-separated ranks (default: 0, a middle node's, the last)")
    # None: DryRunSpec's default (defined once, there; importing it here would load torch)
    d.add_argument("--steps", type=int, default=None, help="steps to run; the last is measured")
    d.add_argument("--tensors", default=None, choices=DRYRUN_TENSORS,
                   help="fake: no storage (any model on any machine); real: allocated, on --device "
                        "(tools/dryrun.py [Note: real tensors on a GPU])")
    d.add_argument("--device", default=None, choices=DRYRUN_DEVICES,
                   help="cuda: this machine's GPU (its streams, events and allocator; one rank at a time)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--out", default=None, metavar="DIR", help="write report.md, dryrun.json, memory.png")


def _ranks(text: str | None):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file, not a folder")  # before the run, not after
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.tools.dryrun import DryRunSpec, dry_run
    from amsp_ext.tools.dryrun_report import format_text, write_out

    check_counts(args, ("nodes", "gpus_per_node", "seq_len", "micro_batch_size", "micro_batches", "steps"))
    spec = DryRunSpec(model=args.model, model_config=args.model_config, num_nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node,
                      gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
                      plan=args.plan, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                      micro_batches=args.micro_batches,
                      engine=dataclasses.replace(schema.from_namespace(EngineConfig, args), gpus_per_node=None),
                      ranks=_ranks(args.ranks), profile=args.profile, missing_mesh=args.missing_mesh,
                      **{k: getattr(args, k) for k in ("steps", "tensors", "device")
                         if getattr(args, k) is not None})
    result = dry_run(spec)
    if args.out:
        write_out(result, args.out)
    print(json.dumps(result) if args.json else format_text(result))
    return 0
