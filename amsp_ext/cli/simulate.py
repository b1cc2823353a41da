"""``amsp simulate``: the paper's Figure 11 (MFU vs GPUs for LLaMA-7B/13B/30B) predicted by the
planner's models, with the paper's reported numbers side by side (torch-free).

    amsp simulate                                    # paper-a800, 8..1024 GPUs, 3 models
    amsp simulate --profile my-cluster.json --gpus 16,32,64 --models llama-7b
    amsp simulate --models llama-65b --gpus 1024,8192 --missing-mesh fit --micro-batches 1 \
                  --tensor-parallel auto --max-global-batch-tokens 16777216   # TP layouts side by side
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

from dataclasses import dataclass

from amsp_ext import schema
from amsp_ext.cli.planner_flags import (gpu_memory_option, max_global_batch_tokens_option, missing_mesh_option,
                                        profile_option, tensor_parallel_option)
from amsp_ext.planner.simulate import PAPER_GPU_COUNTS, PAPER_MODELS, PAPER_SHAPE
from amsp_ext.planner.specs import StepShape
from amsp_ext.schema import check_options, option

HELP = ("predict MFU and tokens/GPU/s of ZeRO-1/2/3, ZeRO++, MiCS and AMSP at 8..1024 GPUs, or of "
        "tensor-parallel layouts side by side (--tensor-parallel)")

# Plotted series: (system, colour, marker). The tables have every system.
_SERIES = (("zero1", "tab:blue", "o"), ("zero3", "tab:orange", "s"), ("zero++", "tab:green", "^"),
           ("mics", "tab:purple", "D"), ("amsp-planner", "tab:red", "*"),
           ("amsp-table-iv", "tab:brown", "P"), ("amsp-planner-step", "tab:pink", "v"))


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, e.g. 8,16,32; got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} must list integers >= 1, got {text!r}")
    return vals


def _names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        raise ValueError(f"{flag} must be comma-separated names with none empty, e.g. llama-7b,llama-13b; "
                         f"got {text!r}")
    return names


@dataclass(frozen=True, kw_only=True)
class SimulateOptions(StepShape):
    """The step's shape (StepShape's flags; not given: the paper's, planner/simulate.py
    PAPER_SHAPE, and M from --global-batch-tokens) and the grid."""

    profile: str = profile_option()
    models: str = option(",".join(PAPER_MODELS), help="comma-separated presets (default: the paper's three)")
    gpus: str = option(",".join(map(str, PAPER_GPU_COUNTS)), help="comma-separated GPU counts")
    gpus_per_node: int = option(8, minimum=1)
    gpu_memory: str = gpu_memory_option()
    global_batch_tokens: int = option(4 * 2**20, minimum=1)
    missing_mesh: str = missing_mesh_option()
    tensor_parallel: str = tensor_parallel_option(
        what="TP degree of the joint pick (auto: searched with the six factors); not 1, or either "
             "flag below, gives the TP rows (planner/simulate_tp.py) instead of the paper's grid")
    max_global_batch_tokens: int | None = max_global_batch_tokens_option(what="a row over it says so")
    efficiency: float | None = option(None, help="fraction of peak the compute reaches (default: the "
                                                 "planner's 0.65)")
    out: str = option("comparisons/results", help="folder for the report")
    no_plot: bool = option(False, help="skip the PNG")
    no_write: bool = option(False, help="print only; write no files")

    def __post_init__(self) -> None:
        check_options(self)
        if self.efficiency is not None and not 0 < self.efficiency <= 1:  # nan fails both
            raise ValueError(f"--efficiency must be in (0, 1], got {self.efficiency}")


# not given, the step's shape is the paper's (--micro-batches given: M per data-parallel rank, the
# TP rows, and the global batch shrinks as T grows; else --global-batch-tokens fixes the batch)
_PAPER_UNLESS_GIVEN = ("seq_len", "micro_batch_size", "num_micro_batches")


def add_arguments(p: argparse.ArgumentParser) -> None:
    schema.add_arguments(p, SimulateOptions, unset=_PAPER_UNLESS_GIVEN)


def run(args: argparse.Namespace) -> int:
    from amsp_ext.planner.simulate import SimSettings, side_by_side, simulate
    from amsp_ext.planner.simulate_report import format_markdown, format_side_by_side, to_json
    from amsp_ext.planner.specs import parse_size
    from amsp_ext.planner.step import DEFAULT_EFFICIENCY

    from amsp_ext.planner.tensor_parallel import parse_tensor_parallel

    given = {n: getattr(args, n) for n in _PAPER_UNLESS_GIVEN if getattr(args, n) is not None}
    schema.from_namespace(SimulateOptions, argparse.Namespace(**{**vars(args), **vars(PAPER_SHAPE), **given}))
    shape = dataclasses.replace(PAPER_SHAPE, **{k: v for k, v in given.items() if k != "num_micro_batches"})
    settings = SimSettings(
        models=_names(args.models, "--models"),
        gpu_counts=_ints(args.gpus, "--gpus"), gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
        shape=shape, global_batch_tokens=args.global_batch_tokens, profile=args.profile,
        efficiency=DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency,
        missing_mesh=args.missing_mesh, tensor_parallel=parse_tensor_parallel(args.tensor_parallel),
        max_global_batch_tokens=args.max_global_batch_tokens, micro_batches=given.get("num_micro_batches"),
    )
    if settings.tp_mode:
        return _run_tp(args, settings)
    cells = simulate(settings)
    rows = side_by_side(cells)
    command = _command(args)
    print(format_side_by_side(rows, cells, markdown=False))
    if args.no_write:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"simulate_{Path(settings.profile).stem}"
    plot = None
    if not args.no_plot:
        plot = f"{stem}.png"
        write_plot(cells, out / plot, settings)
    (out / f"{stem}.md").write_text(format_markdown(cells, rows, settings, command=command,
                                                    plot=plot, versions=_versions()))
    (out / f"{stem}.json").write_text(_dumps(to_json(cells, rows, settings, command=command)))
    print(f"\nreport: {out / (stem + '.md')}")
    return 0


def _run_tp(args: argparse.Namespace, settings) -> int:
    """The TP rows (planner/simulate_tp.py [Note: the TP rows]): a table, its markdown and JSON."""
    from amsp_ext.planner.simulate_report import format_tp_markdown, format_tp_table, tp_to_json
    from amsp_ext.planner.simulate_tp import simulate_tp

    rows = simulate_tp(settings)
    command = _command(args)
    print(format_tp_table(rows, markdown=False))
    if args.no_write:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"simulate_tp_{Path(settings.profile).stem}"
    (out / f"{stem}.md").write_text(format_tp_markdown(rows, settings, command=command))
    (out / f"{stem}.json").write_text(_dumps(tp_to_json(rows, settings, command=command)))
    print(f"\nreport: {out / (stem + '.md')}")
    return 0


def _dumps(doc: dict) -> str:
    """Indented JSON with one line per cell and per side-by-side row (small, diffable)."""
    lines = ["{"]
    for i, (k, v) in enumerate(doc.items()):
        end = "," if i < len(doc) - 1 else ""
        if isinstance(v, list) and v and isinstance(v[0], dict):
            body = ",\n".join("  " + json.dumps(x) for x in v)
            lines.append(f" {json.dumps(k)}: [\n{body}\n ]{end}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}{end}")
    return "\n".join(lines + ["}"]) + "\n"


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (the options that differ from the defaults)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    parts = ["amsp", "simulate"]
    for action in parser._actions:
        k = action.dest
        if k == "help" or getattr(args, k, None) == defaults.get(k):
            continue
        flag = action.option_strings[0]
        parts += [flag] if isinstance(getattr(args, k), bool) else [flag, str(getattr(args, k))]
    return shlex.join(parts)


def _versions() -> str:
    import platform
    return f"Python {platform.python_version()}"


def write_plot(cells, path: Path, settings) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from amsp_ext.planner.simulate import PAPER_MFU, SYSTEMS

    models = list(dict.fromkeys(c.model for c in cells))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for system, colour, marker in _SERIES:
            for engine, style in (("ideal", "-"), ("deepspeed", "--")):
                pts = sorted((c.gpus, c) for c in cells if c.model == model
                             and c.system == system and c.engine == engine)
                if engine == "deepspeed" and system.startswith("amsp"):
                    continue
                ok = [(g, c.mfu * 100) for g, c in pts if c.mfu is not None]
                if ok:
                    ax.plot(*zip(*ok), style, color=colour, marker=marker, markersize=4,
                            linewidth=1.4 if engine == "ideal" else 1.0,
                            label=SYSTEMS[system] if engine == "ideal" else None)
                oom = [g for g, c in pts if not c.feasible]
                if oom and engine == "ideal":
                    ax.plot(oom, [0.5] * len(oom), "x", color=colour, markersize=7)
            paper = [(g, v[0]) for (s, m, g), v in PAPER_MFU.items()
                     if s == system and m == model and v[0] is not None]
            if paper:
                ax.plot(*zip(*sorted(paper)), linestyle="none", marker=marker, markersize=9,
                        markerfacecolor="none", markeredgecolor=colour, markeredgewidth=1.6)
        for (s, m, g), v in PAPER_MFU.items():
            if m == model and v[0] is None:
                colour = next((c for k, c, _ in _SERIES if k == s), "black")
                ax.annotate(f"paper: {SYSTEMS[s]} OOM at {g}", (g, 0.5), xytext=(g, 9),
                            fontsize=7, ha="center", color=colour,
                            arrowprops=dict(arrowstyle="->", color=colour, lw=0.8))
        ax.set_xscale("log", base=2)
        gpus = sorted({c.gpus for c in cells if c.model == model})
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_ylim(0, 75)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("MFU (%)")
        ax.set_title(model.replace("llama-", "LLaMA-").upper().replace("LLAMA", "LLaMA"))
        ax.grid(alpha=0.3)
    h, l = axes[0][0].get_legend_handles_labels()
    from matplotlib.lines import Line2D
    h += [Line2D([], [], color="grey", linestyle="--"),
          Line2D([], [], color="grey", linestyle="none", marker="o", markerfacecolor="none"),
          Line2D([], [], color="grey", linestyle="none", marker="x")]
    l += ["DeepSpeed-engine assumption", "paper (reported)", "OOM"]
    fig.legend(h, l, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(f"Predicted MFU vs GPUs (profile {settings.profile}; solid: ideal engine)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
