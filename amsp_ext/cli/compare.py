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
    amsp compare --reduce-dtype bf16 --steps 13 --warmup-steps 3 --repeats 5
                                                           # bf16 gradients for every row; enough
                                                           # steps and rounds for a claim
    amsp compare --systems ddp,amsp-plan --ddp-buckets 1,5,25 --repeats 6
                                                           # DDP at three bucket sizes; ratios
                                                           # against the fastest of them
"""

from __future__ import annotations

import argparse
import shlex
import sys

from amsp_ext.planner.defaults import CLUSTER_PROFILE
from amsp_ext.cli.planner_flags import add_gpu_memory, add_memory_reserve, add_missing_mesh, add_profile
from amsp_ext.compare.config import COMPARE_MISSING_MESH, SYSTEM_TIMEOUT_S

HELP = "measured side-by-side: DDP, ZeRO-1/2/3, ZeRO++, MiCS, FSDP2/HSDP and AMSP on one job"

# --quick: a tiny model and few steps, so the whole table takes minutes on 2 CPU cores.
QUICK = dict(model="tiny-llama", seq_len=128, micro_batch_size=2, num_micro_batches=2,
             num_steps=8, num_warmup_steps=3, nproc_per_node=4, gpus_per_node=2)
FULL = dict(model="small-llama", seq_len=256, micro_batch_size=2, num_micro_batches=4,
            num_steps=20, num_warmup_steps=5, nproc_per_node=4, gpus_per_node=None)


# RunSpec's options that are `amsp compare`'s flags (schema.py generates them); the others are
# fixed for a comparison (optimizer) or set by the command (amsp_overlap by the ablation mode,
# dist_timeout_s from --timeout)
SPEC_FLAGS = ("model", "seq_len", "micro_batch_size", "num_micro_batches", "num_steps",
              "num_warmup_steps", "seed", "precision", "reduce_dtype", "gpus_per_node", "mics_shard_size",
              "hpz_partition_size", "amsp_plan", "amsp_granularity", "amsp_all_reduce", "trace",
              "trace_steps", "limit_rounds")
# unset on the command line: --quick's or the full table's value; precision: cpu_precision's
PRESET = tuple(k for k in QUICK if k != "nproc_per_node")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from amsp_ext import schema
    from amsp_ext.compare.config import RunSpec

    p.add_argument("--quick", action="store_true",
                   help="tiny-llama, seq 128, M=2, 8 steps, 4 ranks posing as 2 nodes x 2")
    p.add_argument("--mode", default="baselines", choices=("baselines", "dissociation", "ablation"))
    p.add_argument("--systems", help="comma-separated subset (baselines mode), e.g. ddp,zero1,mics; ablation "
                   "mode: peers timed beside the AMSP rows (default none)")
    p.add_argument("--ddp-buckets", metavar="MB,...",
                   help="run DDP at each bucket_cap_mb (of 1, 5, 25; e.g. 1,5,25) in the same rounds "
                   "(ddp, torch's default 25, gives its place to the 25 row); ratios are against the "
                   "fastest by median step (compare/peers.py)")
    flag = {f.name: schema.flag_of(f) for _, f in schema.options(RunSpec)}
    full = ", ".join(f"{flag[k]} {v}" for k, v in FULL.items() if k in PRESET and v is not None)
    quick = ", ".join(f"{flag[k]} {v}" for k, v in QUICK.items() if k in PRESET)
    t = p.add_argument_group("what every system runs (RunSpec)",
                             f"unset: the full table's {full}; with --quick {quick}")
    schema.add_arguments(t, RunSpec, only=SPEC_FLAGS, unset=(*PRESET, "precision"))
    p.add_argument("--launcher", default="torchrun", choices=("torchrun", "cluster"))
    p.add_argument("--nproc-per-node", type=int, help="ranks (torchrun launcher)")
    p.add_argument("--cluster-name", default="amsp", help="lab name for --launcher cluster")
    add_profile(p, what="planner profile for --amsp-plan auto", default=CLUSTER_PROFILE)
    add_gpu_memory(p, what="memory per GPU the planner plans for (--amsp-plan auto)")
    add_memory_reserve(p)
    add_missing_mesh(p, default=COMPARE_MISSING_MESH)  # compare's own (compare/config.py)
    p.add_argument("--ablation-micro-batches", help="ablation mode: comma-separated M values, "
                   "e.g. 1,2,4,8 as in the paper's Table V (default: --micro-batches)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every system N times, in rounds of alternating order; report the "
                   "median tokens/GPU/s, its range and ratios as the median of per-round ratios "
                   "(default 1; prefer an even N)")
    p.add_argument("--timeout", type=float, default=SYSTEM_TIMEOUT_S,
                   help="seconds per system (default %(default)g)")
    p.add_argument("--out", default="comparisons/results", help="report folder")


def run_spec(args: argparse.Namespace):
    """The RunSpec of the parsed flags: the unset ones from the preset (the gpus-per-node preset
    on torchrun only; the lab says its own), the precision checked against this CPU, the
    workers' collective timeout from --timeout (at most compare/config.py WORKER_TIMEOUT_S)."""
    import dataclasses

    from amsp_ext import schema
    from amsp_ext.cli.precision import cpu_precision
    from amsp_ext.compare.config import WORKER_TIMEOUT_S, RunSpec

    d = QUICK if args.quick else FULL
    values = {k: getattr(args, k) for k in SPEC_FLAGS}
    for k in PRESET:
        if values[k] is None and (k != "gpus_per_node" or args.launcher == "torchrun"):
            values[k] = d[k]
    # RunSpec holds the one default; only a CPU without native bf16 changes it
    default = {f.name: f.default for f in dataclasses.fields(RunSpec)}["precision"]
    values["precision"] = cpu_precision(args.precision, default)
    values["dist_timeout_s"] = min(WORKER_TIMEOUT_S, args.timeout)
    return schema.from_namespace(RunSpec, argparse.Namespace(**values))


def _check_before_launch(args: argparse.Namespace) -> None:
    """What the runs would refuse one by one (after others ran), refused here in one line."""
    from pathlib import Path

    from amsp_ext.choices import check_number
    from amsp_ext.compare.peers import parse_ddp_buckets
    from amsp_ext.planner.plan import check_plan_text
    from amsp_ext.planner.profile import load_profile

    check_number(args.timeout, "--timeout", above=0)
    if args.systems is not None and not [s for s in args.systems.split(",") if s.strip()]:
        raise ValueError(f"--systems {args.systems!r} names no system (comma-separated, e.g. ddp,zero1,amsp-plan)")
    if args.amsp_plan is not None:
        check_plan_text(args.amsp_plan, "--amsp-plan")
    if args.ddp_buckets is not None:
        parse_ddp_buckets(args.ddp_buckets)
    if args.profile != CLUSTER_PROFILE:
        load_profile(args.profile)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")


def _systems(args: argparse.Namespace) -> list[str] | None:
    """The rows --systems names (None: the mode's own), with --ddp-buckets' sweep in place of ddp."""
    from amsp_ext.compare.peers import parse_ddp_buckets, with_ddp_sweep
    from amsp_ext.compare.systems import default_systems

    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    if args.ddp_buckets is None:
        return systems
    return with_ddp_sweep(systems or default_systems(args.mode), parse_ddp_buckets(args.ddp_buckets))


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amsp_ext.compare.harness import PlannerInputs, run_comparison
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.compare.launch import LaunchConfig
    from amsp_ext.compare.report import breakdown_table, format_table, ratios

    import signal

    _check_before_launch(args)
    spec = run_spec(args)
    d = QUICK if args.quick else FULL
    pick = lambda v, k: d[k] if v is None else v  # noqa: E731
    launch = LaunchConfig(launcher=args.launcher, nproc_per_node=pick(args.nproc_per_node, "nproc_per_node"),
                          cluster_name=args.cluster_name, timeout_s=args.timeout)
    systems = _systems(args)
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
