"""``amsp compare``: the measured side-by-side of DDP, DeepSpeed ZeRO-1/2/3, ZeRO++, MiCS, FSDP2,
HSDP and AMSP on the same model, data, batch and steps.

    amsp compare --quick                                   # tiny model, 4 ranks as 2x2, ~5 min
    amsp compare --model small-llama --steps 20            # the full table
    amsp compare --mode dissociation                       # Fig. 16: DeepSpeed-MiCS vs AMSP-MiCS
    amsp compare --mode ablation --amsp-plan p=1x1,os=2x2  # Table V overlap switches
    amsp compare --launcher cluster                        # on the `amsp cluster up` lab
    amsp compare --quick --mode dissociation --repeats 5 --no-trace
                                                           # 5 rounds, alternating order: medians
                                                           # and per-round ratios
"""

from __future__ import annotations

import argparse
import shlex
import sys

from amsp_ext.choices import GRANULARITIES, MISSING_MESH
from amsp_ext.compare.config import PRECISIONS
from amsp_ext.engine_config import engine_default

HELP = "measured side-by-side: DDP, ZeRO-1/2/3, ZeRO++, MiCS, FSDP2/HSDP and AMSP on one job"

# --quick: a tiny model and few steps, so the whole table takes minutes on 2 CPU cores.
QUICK = dict(model="tiny-llama", seq_len=128, micro_batch_size=2, num_micro_batches=2,
             num_steps=8, num_warmup_steps=3, nproc_per_node=4, gpus_per_node=2)
FULL = dict(model="small-llama", seq_len=256, micro_batch_size=2, num_micro_batches=4,
            num_steps=20, num_warmup_steps=5, nproc_per_node=4, gpus_per_node=None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="tiny-llama, seq 128, M=2, 8 steps, 4 ranks posing as 2 nodes x 2")
    p.add_argument("--mode", default="baselines", choices=("baselines", "dissociation", "ablation"))
    p.add_argument("--systems", help="comma-separated subset (baselines mode), e.g. ddp,zero1,mics")
    p.add_argument("--model", help="tiny-llama | small-llama")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch-size", type=int, help="sequences per rank per micro-batch")
    p.add_argument("--micro-batches", type=int, help="M, gradient accumulation steps")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="steps left out of the throughput median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=PRECISIONS,
                   help="compute dtype of every system (default bf16, or fp32 on a CPU without "
                   "native bf16, which says so before the run)")
    p.add_argument("--launcher", default="torchrun", choices=("torchrun", "cluster"))
    p.add_argument("--nproc-per-node", type=int, help="ranks (torchrun launcher)")
    p.add_argument("--gpus-per-node", type=int,
                   help="logical GPUs per node (default: ranks per launched node)")
    p.add_argument("--cluster-name", default="amsp", help="lab name for --launcher cluster")
    p.add_argument("--mics-shard-size", type=int, help="default: one node")
    p.add_argument("--hpz-partition-size", type=int, help="default: one node")
    p.add_argument("--amsp-plan", default="auto",
                   help="plan of the 'AMSP (planner's plan)' row: auto | ddp | zero1 | mics:K | p=AxB,g=..,os=..")
    p.add_argument("--amsp-granularity", default=engine_default("granularity"), choices=GRANULARITIES,
                   help="sharding unit of the AMSP rows: one per decoder layer, as the FSDP2 rows "
                   "wrap (default), or every Linear (the paper's module-level AG/RS)")
    p.add_argument("--profile", default="paper-a800", metavar="NAME|PATH",
                   help="planner profile for --amsp-plan auto (bundled name or a JSON from `amsp profile`)")
    p.add_argument("--gpu-memory", default="80GiB", metavar="SIZE",
                   help="memory per GPU the planner plans for (--amsp-plan auto), e.g. 80GiB, 4MiB")
    p.add_argument("--memory-reserve", default="2GiB", metavar="SIZE",
                   help="memory per GPU the planner keeps free (default 2GiB, as `amsp plan`)")
    p.add_argument("--missing-mesh", choices=MISSING_MESH, default="fit",
                   help="a mesh the profile lacks: estimate by alpha-beta fit (default) or refuse")
    p.add_argument("--ablation-micro-batches", help="ablation mode: comma-separated M values, "
                   "e.g. 1,2,4,8 as in the paper's Table V (default: --micro-batches)")
    p.add_argument("--no-trace", action="store_true", help="skip the profiled step")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every system N times, in rounds of alternating order; report the "
                   "median tokens/GPU/s, its range and ratios as the median of per-round ratios "
                   "(default 1; prefer an even N)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per system (default 600)")
    p.add_argument("--out", default="comparisons/results", help="report folder")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.harness import PlannerInputs, run_comparison
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.compare.launch import LaunchConfig
    from amsp_ext.compare.report import breakdown_table, format_table, ratios

    import dataclasses
    import signal

    from amsp_ext.cli.precision import cpu_precision

    d = QUICK if args.quick else FULL
    # RunSpec holds the one default; only a CPU without native bf16 changes it
    default = {f.name: f.default for f in dataclasses.fields(RunSpec)}["precision"]
    precision = cpu_precision(args.precision, default)
    pick = lambda v, k: d[k] if v is None else v  # noqa: E731
    spec = RunSpec(
        model=pick(args.model, "model"), seq_len=pick(args.seq_len, "seq_len"),
        micro_batch_size=pick(args.micro_batch_size, "micro_batch_size"),
        num_micro_batches=pick(args.micro_batches, "num_micro_batches"),
        num_steps=pick(args.steps, "num_steps"), num_warmup_steps=pick(args.warmup_steps, "num_warmup_steps"),
        seed=args.seed, precision=precision,
        gpus_per_node=args.gpus_per_node if args.gpus_per_node is not None
        else (d["gpus_per_node"] if args.launcher == "torchrun" else None),
        mics_shard_size=args.mics_shard_size, hpz_partition_size=args.hpz_partition_size,
        amsp_plan=args.amsp_plan, amsp_granularity=args.amsp_granularity,
        trace=not args.no_trace, dist_timeout_s=min(300.0, args.timeout),
    )
    launch = LaunchConfig(launcher=args.launcher, nproc_per_node=pick(args.nproc_per_node, "nproc_per_node"),
                          cluster_name=args.cluster_name, timeout_s=args.timeout)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    command = "amsp compare " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "compare"
                                           else sys.argv[1:])
    planner = PlannerInputs(profile=args.profile, missing=args.missing_mesh,
                            gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
                            memory_reserve_bytes=parse_size(args.memory_reserve, field="--memory-reserve",
                                                            allow_zero=True))
    ablation_ms = None
    if args.ablation_micro_batches:
        try:
            ablation_ms = [int(x) for x in args.ablation_micro_batches.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--ablation-micro-batches must be integers like 1,2,4,8, "
                             f"got {args.ablation_micro_batches!r}") from None

    def stop(signum, frame):  # noqa: ARG001 - a scheduler's SIGTERM stops it like Ctrl-C
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        path, rows = run_comparison(mode=args.mode, spec=spec, launch=launch, out_dir=Path(args.out),
                                    command=command.strip(), systems=systems,
                                    ablation_micro_batches=ablation_ms, planner=planner,
                                    repeats=args.repeats, show_bar=True)
    except KeyboardInterrupt as e:
        print(f"amsp compare: stopped ({e or 'SIGINT'}); every system it started is stopped",
              file=sys.stderr)
        return 130
    print()
    print(format_table(rows))
    for line in ratios(rows):
        print(line)
    table = breakdown_table(rows)
    if table:
        print("\nWhere a step's time goes (one profiled step, rank 0; ms):")
        print("\n".join(table))
    print(f"\nreport: {path}")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1
