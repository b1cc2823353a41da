"""Rows -> ``<stem>.md`` (the table and how it was measured), ``<stem>/results.json`` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from amsp_ext.compare import limit
from amsp_ext.compare.peers import at_best, sweeps
from amsp_ext.compare.rounds import (CLAIM_AGREE, CLAIM_MIN_ROUNDS, CLAIM_MIN_TIMED_STEPS, TARGET,
                                    paired_ratio, timed_steps, verdict)
from amsp_ext.compare.wire import BYTES_TOLERANCE, not_as_asked, wire_mismatch

__all__ = ["breakdown_table", "cpu_table", "format_table", "ratio_records", "ratios", "sweep_lines", "wire_table",
           "write_plots", "write_report", "write_timeline"]

MIB = 2**20

METHOD = """\
- **tokens/GPU/s**: tokens one rank trains per optimizer step (micro-batch size x seq len x M)
  divided by the step time; a step's time is its slowest rank's; the median over the steps after
  the warm-up steps.
- **MFU**: model FLOPs per token by the Megatron-LM formula (Narayanan et al. 2021), counting
  Llama's real matmul weights (GQA, SwiGLU) in place of GPT's 24h^2; attention is **not** halved
  for causal masking, as in the paper; no recomputation. The peak is **measured** once per run
  before training (metrics.device_peak): {n}x{n} matmuls in the run's compute dtype on every
  rank at once, timed by the slowest rank, best of 5 trials; median over all runs: **{peak}**.
  On a shared CPU each rank's peak is its share of the cores.
- **Memory per rank** (CPU, no caching allocator): *peak RSS delta* = the kernel's resident
  high-water mark (VmHWM, reset just before the model is built) minus RSS at that point - all
  allocations incl. activations, buffers and allocator slack; *live tensors* = bytes of all live
  tensors (deduplicated by storage) after the last step minus before the model is built - the
  model states and persistent buffers a rank holds between steps. Max over ranks.
- **Communication**: torch.profiler trace of one extra step after the timed ones. *comm* = wall
  time with a collective in flight (gloo worker spans and c10d calls); *exposed* = the part of it
  during which the training threads run no aten op (see amsp_ext/compare/trace.py). Median over
  ranks.
- **Loss**: mean over ranks and micro-batches = the global-batch loss of each step (same data,
  same initial weights for every system)."""


CAVEATS = """\
- **DeepSpeed's `overlap_comm` cannot overlap on CPU.** It overlaps by running reductions on a
  separate accelerator stream; DeepSpeed's CPU accelerator is a "synchronized device"
  (`is_synchronized_device() == True`, so ZeRO-1/2 and ZeRO-3 create no reduction stream) and
  every DeepSpeed collective runs on the training thread. Exposed = total communication for the
  DeepSpeed rows here is a property of this machine, not of DeepSpeed on GPUs.
- **Tiny models, big constants.** With `tiny-llama` the model states are ~2 MB per rank, so peak
  RSS deltas are dominated by per-process constants (kernels, thread pools, allocator arenas)
  and only the *live tensors* column separates the systems' sharding.
- **Time-sharing.** With more ranks than cores, a rank waiting for a descheduled peer shows up as
  communication time; comm/exposed figures include that wait.
- **Logical nodes.** Under plain torchrun the node boundary is logical (`--gpus-per-node`): it
  decides the groups of hpZ, MiCS, HSDP and AMSP, but no slower link separates the "nodes".
  `--launcher cluster` runs on the network-namespace lab, where it does."""


def _load_text(load: dict | None) -> str:
    if not load or not load.get("start"):
        return ""
    fmt = lambda v: "/".join(f"{x:.1f}" for x in v) if v else "n/a"  # noqa: E731
    return (f" Load average (1/5/15 min) at the start: {fmt(load['start'])}, at the end: "
            f"{fmt(load.get('end'))}.")


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _mib(values: list | None) -> str:
    vals = [v for v in (values or []) if v is not None]
    return f"{max(vals) / MIB:.1f}" if vals else "—"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def _repeated(rows: list[dict[str, Any]]) -> int:
    """Rounds of the comparison (1 unless run with ``--repeats``)."""
    return max((r.get("num_rounds", 1) for r in rows), default=1)


def _tgs_cell(r: dict[str, Any]) -> str:
    rng = r.get("tokens_per_gpu_per_s_range")
    if r.get("num_rounds", 1) > 1 and rng:
        return f"{r['tokens_per_gpu_per_s']:.0f} ({rng[0]:.0f}–{rng[1]:.0f})"
    return f"{r['tokens_per_gpu_per_s']:.0f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    num_rounds = _repeated(rows)
    tgs_head = "tokens/GPU/s" if num_rounds == 1 else f"tokens/GPU/s, median of {num_rounds} rounds (min–max)"
    head = (f"| System | {tgs_head} | MFU | median step (s) | peak RSS Δ / rank (MiB) | "
            "live tensors / rank (MiB) | comm / step (ms) | exposed comm / step (ms) | "
            "loss step 0 → last | status |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.get("status") == "ok":
            loss = r["loss"]
            # A row with failed rounds is still ok (its other rounds ran); the status names them.
            status = "ok" if not r.get("failed_rounds") else f"ok; {r['reason']}".replace("|", "\\|")
            lines.append(
                f"| {r['label']} | {_tgs_cell(r)} | "
                f"{_fmt(r['mfu'] and r['mfu'] * 100, '.2f')}% | {r['median_step_s']:.3f} | "
                f"{_mib(r['peak_rss_delta_bytes'])} | {_mib(r['live_tensor_delta_bytes'])} | "
                f"{_ms(r['comm_s'])} | {_ms(r['exposed_comm_s'])} | "
                f"{loss[0]:.4f} → {loss[-1]:.4f} | {status} |")
        else:
            reason = str(r.get("reason", "")).replace("|", "\\|")
            lines.append(f"| {r['label']} | — | — | — | — | — | — | — | — | "
                         f"{r.get('status')}: {reason} |")
    return "\n".join(lines)


def _waits_text(waits: list[dict]) -> str:
    return "; ".join(f"{w['site']} {w['s'] * 1e3:.1f}" for w in waits if w["s"] >= 5e-5) or "—"


def breakdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per system, per (phase, collective kind) of one profiled step (compare/breakdown.py):
    count, MiB, busy, exposed, the compute it overlapped, and where the training thread was
    while it was exposed. Rank 0 (of the first round); the total line's exposed/busy are the
    median over ranks, and with rounds the median over rounds of those."""
    out = []
    for r in rows:
        b = r.get("breakdown")
        if r.get("status") != "ok" or not b:
            continue
        t = b["totals"]
        med = b.get("median_over_ranks", {}).get("total", {})
        over = ("median" if "median_over_rounds" not in b
                else f"median of {b['num_profiled_rounds']} rounds")
        med = b.get("median_over_rounds", {}).get("total", med)
        if not out:
            out = ["| System | phase | kind | count | MiB | busy (ms) | exposed (ms) | overlapped "
                   "compute (ms) | exposed while in (ms) |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for x in b["rows"]:
            out.append(f"| {r['label']} | {x['phase']} | {x['kind']} | {x['count']} | "
                       f"{x['bytes'] / MIB:.2f} | {x['busy_s'] * 1e3:.1f} | {x['exposed_s'] * 1e3:.1f} | "
                       f"{x['overlapped_s'] * 1e3:.1f} | {_waits_text(x['waits'])} |")
        out.append(f"| **{r['label']}** | **step** ({t['step_s'] * 1e3:.0f} ms, compute "
                   f"{t['compute_s'] * 1e3:.0f}) | all | {t['count']} | {t['bytes'] / MIB:.2f} | "
                   f"{t['comm_s'] * 1e3:.1f} ({over} {med.get('comm_s', 0) * 1e3:.1f}) | "
                   f"{t['exposed_s'] * 1e3:.1f} ({over} {med.get('exposed_s', 0) * 1e3:.1f}) | "
                   f"{(t['comm_s'] - t['exposed_s']) * 1e3:.1f} | |")
    return out


_KIND_COLORS = {"AG": "tab:blue", "RS": "tab:orange", "AR": "tab:red", "BC": "tab:purple",
                "other": "tab:gray"}


def write_timeline(rows: list[dict[str, Any]], folder: Path) -> str | None:
    """One profiled step per system (rank 0), as the paper's Fig. 14/15 traces: the training
    thread's compute, and per collective kind each collective queued (light) and running on
    gloo's worker (dark), on one time axis; AMSP's post-step broadcasts are the previous step's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and (r.get("breakdown") or {}).get("timeline")]
    if not ok:
        return None
    fig, axes = plt.subplots(len(ok), 1, figsize=(13, 1.3 + 1.1 * len(ok) * 2), squeeze=False)
    xmin = min(min([0.0] + [c["issued"] for cs in r["breakdown"]["timeline"]["collectives"].values()
                            for c in cs]) for r in ok)
    xmax = max(max([r["breakdown"]["totals"]["step_s"]]
                   + [c["end"] for cs in r["breakdown"]["timeline"]["collectives"].values() for c in cs])
               for r in ok)
    for ax, r in zip(axes[:, 0], ok):
        tl = r["breakdown"]["timeline"]
        lanes = ["compute"] + [k for k in _KIND_COLORS if k in tl["collectives"]]
        for y, lane in enumerate(lanes):
            if lane == "compute":
                ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in tl["compute"]], (y - 0.4, 0.8),
                               color="tab:green")
                continue
            cs = tl["collectives"][lane]
            ax.broken_barh([(c["issued"] * 1e3, (c["start"] - c["issued"]) * 1e3) for c in cs],
                           (y - 0.4, 0.8), color=_KIND_COLORS[lane], alpha=0.3)
            ax.broken_barh([(c["start"] * 1e3, max(c["end"] - c["start"], 1e-6) * 1e3) for c in cs],
                           (y - 0.4, 0.8), color=_KIND_COLORS[lane])
        t = r["breakdown"]["totals"]
        ax.axvline(0, color="black", linewidth=0.5)
        ax.axvline(t["step_s"] * 1e3, color="black", linewidth=0.5)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_xlim(xmin * 1e3, xmax * 1e3)
        ax.set_title(f"{r['label']}: step {t['step_s'] * 1e3:.0f} ms, comm {t['comm_s'] * 1e3:.0f} ms, "
                     f"exposed {t['exposed_s'] * 1e3:.0f} ms (rank 0)", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's start (light: queued, dark: running on gloo's worker)")
    fig.tight_layout()
    name = "timeline.png"
    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    return name


def _row(rows, key):
    return next((r for r in rows if r["key"] == key and r.get("status") == "ok"), None)


def _ablation_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ablation's AMSP rows, one per (M, overlap setting): harness.plan_runs keys them
    ``amsp-plan[M=<m>,<setting>]``."""
    return [r for r in rows if r["key"].startswith("amsp-plan[M=")]


def ratio_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """AMSP(planned) / each baseline (in ablation mode: each overlap setting / each peer),
    AMSP(MiCS config) / DeepSpeed-MiCS, AMSP(MiCS config) / FSDP2 HSDP and AMSP(planned) /
    AMSP(MiCS config), in tokens/GPU/s: per round where both
    rows ran, then median and range
    (``rounds.paired_ratio``; one round without ``--repeats``)."""
    out = []

    def add(num: dict[str, Any], den: dict[str, Any], text: str, note: str = "") -> None:
        rec = paired_ratio(num, den)
        if rec:
            steps = [s for s in (timed_steps(num), timed_steps(den)) if s is not None]
            wire_note = ("" if num.get("wire") and den.get("wire")
                         else "wire bytes not measured (no trace): not checked")
            refused = wire_mismatch(num, den)
            # a refused ratio is no claim, whatever its rounds: the rows did not send the same
            out.append({"numerator": num["key"], "denominator": den["key"], "text": text,
                        "note": "; ".join(n for n in (note, wire_note) if n), **rec,
                        "refused": refused,
                        "verdict": ({"claim": False, "met": None, "text": f"refused: {refused}"} if refused
                                    else verdict(rec, min(steps) if steps else None))})

    ok = [r for r in rows if r.get("status") == "ok"]
    planned = _row(rows, "amsp-plan")
    settings = _ablation_rows(ok)
    swept = sweeps(ok)
    for peer in at_best(ok):  # a swept peer at its best only (peers.py)
        for num in ([planned] if planned else []) + settings:
            add(num, peer, f"{num['label']} / {peer['label']}", _best_note(peer, swept))
    amsp_mics, ds_mics = _row(rows, "amsp-mics"), _row(rows, "mics")
    if amsp_mics and ds_mics:
        add(amsp_mics, ds_mics, "AMSP (MiCS config) / DeepSpeed-MiCS",
            "engine only: same sharding, paper Fig. 16")
    hsdp = _row(rows, "hsdp")
    if amsp_mics and hsdp:
        add(amsp_mics, hsdp, "AMSP (MiCS config) / FSDP2 HSDP",
            "engine only: the same sharding on torch's engine")
    if amsp_mics and planned:
        add(planned, amsp_mics, f"{planned['label']} / AMSP (MiCS config)",
            "sharding strategy only: same engine")
    return out


def _sizes(mbs: list) -> str:
    return ", ".join(f"{mb:g}" for mb in mbs if mb is not None)


def _best_note(peer: dict[str, Any], swept: dict[str, dict[str, Any]]) -> str:
    """A ratio's note when its peer is the best of a sweep: which setting won, of which."""
    sweep = next((s for s in swept.values() if s["best"] == peer["key"]), None)
    if sweep is None:
        return ""
    won = next(m for m in sweep["rows"] if m["key"] == peer["key"])
    return (f"DDP at its best: bucket_cap_mb {won['bucket_cap_mb']:g} of "
            f"{_sizes([m['bucket_cap_mb'] for m in sweep['rows']])} (lowest median step)")


def sweep_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Every row of a swept peer (DDP's bucket sizes) with its median step, and which won."""
    out = []
    for sweep in sweeps(rows).values():
        best = next((m for m in sweep["rows"] if m["key"] == sweep["best"]), None)
        won = (f"**bucket_cap_mb {best['bucket_cap_mb']:g}** ({best['label']}) had the lowest median step "
               "over the rounds; the ratios above are against it" if best else "no setting ran: no ratio")
        out += [(f"DDP ran at bucket_cap_mb {_sizes([m['bucket_cap_mb'] for m in sweep['rows']])} in the same "
                 f"rounds: {won} (amsp_ext/compare/peers.py). FSDP2/HSDP run with their defaults."), "",
                "| row | bucket_cap_mb | median step (s) | |", "|---|---:|---:|---|"]
        for m in sweep["rows"]:
            step = "—" if m["median_step_s"] is None else f"{m['median_step_s']:.3f}"
            mark = "best" if m["key"] == sweep["best"] else ("" if m["status"] == "ok" else m["status"])
            out.append(f"| {m['label']} | {_fmt(m['bucket_cap_mb'], 'g')} | {step} | {mark} |")
        out.append("")
    return out


def _no_ratio_line(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Why there is no ratio: an all-AMSP mode compares its rows in its own table below; in
    baselines mode an AMSP row or every baseline did not run."""
    if meta.get("mode") in ("ablation", "dissociation"):
        if any(not str(r.get("system", "")).startswith("amsp") for r in rows):
            return (f"- {meta['mode']} mode: the AMSP rows are compared in the {meta['mode']} table below; "
                    f"no peer timed beside them ran.")
        return (f"- {meta['mode']} mode: every row is AMSP; the comparison is the {meta['mode']} table "
                f"below.")
    return "- no AMSP row and baseline both ran (see their status)."


RATIO_RULES = (
    f"Per ratio: the median of the per-round ratios, their interquartile range and how many rounds "
    f"were above {TARGET:.1f}x. A *claim* needs >= {CLAIM_MIN_TIMED_STEPS} timed steps per job and "
    f">= {CLAIM_MIN_ROUNDS} rounds; its target is met only when the median is above {TARGET:.1f}x "
    f"and >= {CLAIM_AGREE:.0%} of the rounds are (amsp_ext/compare/rounds.py). A ratio between rows "
    "that sent gradients in different dtypes, or, for the same plan shape, gradient bytes per step "
    f"differing by more than {BYTES_TOLERANCE:.0%} (between the rows, or between one row's ranks and "
    "rounds), is refused (amsp_ext/compare/wire.py).")
WIRE_TEXT = (
    "Measured from each row's trace, not its settings: gradient bytes = the input bytes of every "
    "gradient reduction (all-reduce, reduce-scatter, reduce; scalars left out), per collective op "
    "the bytes of its full-size tensor (a reduce-scatter's input, an all-gather's output). "
    "`asked` is `--reduce-dtype`.")


def wire_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per row: how its compute dtype is reached, and its measured wire (compare/wire.py)."""
    out = []
    for r in rows:
        if r.get("status") != "ok" or not (r.get("wire") or r.get("mixed_precision")):
            continue
        if not out:
            out = ["| System | mixed precision | gradients (asked) | parameters | gradient bytes / step "
                   "| bytes / step by op |", "|---|---|---|---|---:|---|"]
        w = r.get("wire") or {}
        ops = ", ".join(f"{op} {n:,}" for op, n in (w.get("bytes_per_step") or {}).items()) or "—"
        grad = (f"{w.get('grad_dtype') or '—'} ({w.get('reduce_dtype_asked', '?')})" if w
                else "not measured (no trace)") + (" **not as asked: no ratios**" if not_as_asked(r) else "")
        nbytes = f"{w['grad_bytes_per_step']:,}" if w else "—"
        out.append(f"| {r['label']} | {r.get('mixed_precision') or '—'} | {grad} | "
                   f"{w.get('param_dtype') or '—'} | {nbytes} | {ops} |")
    return out


CPU_TEXT = (
    "CPU seconds per timed step of one rank: its training thread (forward, backward, hooks, copies, "
    "optimizer) and its other threads (gloo's workers and transport, mostly), each rank's median over "
    "the timed steps, then the median over ranks (and rounds). Where the ranks share cores, wall time "
    "also holds waiting for a core; equal CPU with a longer step is waiting, not work "
    "(amsp_ext/compare/cpu.py [Note: CPU time beside wall time]). Every rank runs on this host, so "
    "a step cannot be shorter than the CPU all ranks spend in it over the host's cores: *cores' "
    "floor* = ranks x all threads CPU / cores, and *floor / step* how close the step came to it.")


def cpu_table(rows: list[dict[str, Any]], cores: int | None = None) -> list[str]:
    """Per row: CPU seconds per step of the training thread and of the other threads, the median
    step's wall time beside them, and with ``cores`` (the host's; every rank runs on it) the
    floor the cores put under the step."""
    def floor(r: dict[str, Any], cpu: float) -> str:
        if not cores or not r.get("world_size"):
            return "— | —"
        f = r["world_size"] * cpu / cores
        return f"{f:.3f} | {f / r['median_step_s']:.2f}"

    body = [f"| {r['label']} | {r['median_step_s']:.3f} | {c['main']:.3f} | {c['other']:.3f} | "
            f"{c['main'] + c['other']:.3f} | {floor(r, c['main'] + c['other'])} |"
            for r in rows if r.get("status") == "ok" and (c := r.get("cpu_s_per_step"))]
    if not body:
        return []
    return ["| System | median step (s) | training thread CPU (s) | other threads CPU (s) | "
            "all threads CPU (s) | cores' floor (s) | floor / step |", "|---|---:|---:|---:|---:|---:|---:|", *body]


def _ratio_line(rec: dict[str, Any]) -> str:
    """One ratio: its median with the spread and verdict (rounds.py [Note: what a claim needs]),
    or, refused (wire.py [Note: which ratios are refused]), which rows and why, no number."""
    if rec.get("refused"):
        return f"- {rec['text']}: no ratio: {rec['refused']}"
    notes = []
    if rec["num_rounds"] > 1:
        paired = rec["num_paired_rounds"]
        notes.append(f"median of {paired} per-round ratios" + ("" if paired == rec["num_rounds"]
                                                                else f" ({rec['num_rounds']} rounds)")
                     + f", IQR {rec['q1']:.2f}–{rec['q3']:.2f}x, range {rec['min']:.2f}–{rec['max']:.2f}x, "
                       f"{rec['rounds_above_target']} of {paired} above {TARGET:.1f}x")
    if rec["note"]:
        notes.append(rec["note"])
    v = rec.get("verdict")
    return (f"- {rec['text']}: {rec['median']:.2f}x" + (f" ({'; '.join(notes)})" if notes else "")
            + (f"; {v['text']}" if v else ""))


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """The ratio lines of the report (see ``ratio_records``)."""
    return [_ratio_line(rec) for rec in ratio_records(rows)]


def ablation_table(rows: list[dict[str, Any]]) -> list[str]:
    """Table V's shape: per M, tokens/GPU/s of each overlap setting and the drop vs all on."""
    ok = _ablation_rows(rows)
    if not ok:
        return []
    from amsp_ext.compare.config import OVERLAP_LABELS

    out = ["| M | " + " | ".join(OVERLAP_LABELS.values()) + " |", "|---|" + "---|" * len(OVERLAP_LABELS)]
    for m in sorted({r["spec"]["num_micro_batches"] for r in ok}):
        by = {r["spec"]["amsp_overlap"]: r for r in ok if r["spec"]["num_micro_batches"] == m}
        base = by.get("all")
        cells = []
        for o in OVERLAP_LABELS:
            r = by.get(o)
            if not r or r.get("status") != "ok":
                cells.append(r.get("status", "—") if r else "—")
                continue
            tgs = r["tokens_per_gpu_per_s"]
            # With --repeats: the median of per-round changes (same round = same load).
            rel = (None if o == "all" or not base or base.get("status") != "ok"
                   else paired_ratio(r, base))
            drop = f" ({(rel['median'] - 1) * 100:+.1f}%)" if rel else ""
            cells.append(f"{tgs:.0f}{drop}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def write_plots(rows: list[dict[str, Any]], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    labels = [r["label"] for r in ok]
    files = []

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok)), 4))
    tgs = [r["tokens_per_gpu_per_s"] for r in ok]
    # With --repeats: the median over rounds, whiskers at the rounds' min and max.
    ranges = [r.get("tokens_per_gpu_per_s_range") or [t, t] for r, t in zip(ok, tgs)]
    yerr = None if _repeated(ok) == 1 else [[t - lo for t, (lo, _) in zip(tgs, ranges)],
                                            [hi - t for t, (_, hi) in zip(tgs, ranges)]]
    ax.bar(labels, tgs, color="tab:blue", yerr=yerr, capsize=4 if yerr else 0)
    ax.set_ylabel("tokens / GPU / s")
    ax.set_title("Throughput" if yerr is None
                 else f"Throughput: median of {_repeated(ok)} rounds, whiskers min-max")
    ax.tick_params(axis="x", rotation=35)
    plt.setp(ax.get_xticklabels(), ha="right")
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=120)
    plt.close(fig)
    files.append("throughput.png")

    peak = [max((v for v in r["peak_rss_delta_bytes"] if v is not None), default=0) / MIB for r in ok]
    live = [max(r["live_tensor_delta_bytes"]) / MIB for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 2 * len(ok)), 4.2))
    for ax, vals, title in ((axes[0], peak, "peak RSS delta (all allocations)"),
                            (axes[1], live, "live tensors after the last step")):
        ax.bar(labels, vals, color="tab:orange" if ax is axes[1] else "tab:green")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("MiB per rank (max over ranks)")
        ax.tick_params(axis="x", rotation=35)
        plt.setp(ax.get_xticklabels(), ha="right", fontsize=8)
    fig.suptitle("Memory per rank")
    fig.tight_layout()
    fig.savefig(folder / "memory.png", dpi=120)
    plt.close(fig)
    files.append("memory.png")

    ref = _ddp_reference(ok) or ok[0]
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(12, 4))
    for r in ok:
        steps = range(len(r["loss"]))
        ax.plot(steps, r["loss"], marker=".", label=r["label"])
        dax.plot(steps, [a - b for a, b in zip(r["loss"], ref["loss"])], marker=".", label=r["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    dax.set_xlabel("step")
    dax.set_ylabel(f"loss - {ref['label']} loss")
    dax.set_title(f"Difference from {ref['label']} (same data, same initial weights)")
    dax.axhline(0.0, color="black", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    plt.close(fig)
    files.append("loss.png")
    bound = limit.write_limit_plot(rows, folder)
    if bound:
        files.append(bound)
    tl = write_timeline(rows, folder)
    return files + ([tl] if tl else [])


def _ddp_reference(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row losses are compared with: ``ddp``, or with the bucket sweep in its place the
    first swept row that ran (bucket sizes change no gradient, only when it is reduced)."""
    from amsp_ext.compare.systems import peer_family

    return _row(rows, "ddp") or next((r for r in rows if r.get("status") == "ok"
                                      and peer_family(r.get("system", "")) == "ddp"), None)


def _loss_agreement(rows: list[dict[str, Any]]) -> list[str]:
    ref = _ddp_reference(rows)
    if not ref:
        return []
    out = []
    for r in rows:
        if r.get("status") == "ok" and r is not ref:
            d0 = abs(r["loss"][0] - ref["loss"][0])
            dmax = max(abs(a - b) for a, b in zip(r["loss"], ref["loss"]))
            out.append(f"| {r['label']} | {d0:.2e} | {dmax:.2e} |")
    if not out:
        return []
    return ["| System | abs. loss diff vs DDP, step 0 | max over steps |", "|---|---|---|", *out]


def rounds_section(rows: list[dict[str, Any]], ratio_recs: list[dict[str, Any]],
                   meta: dict[str, Any]) -> list[str]:
    """With ``--repeats``: the order and load of each round, each system's tokens/GPU/s per
    round and each ratio per round (what the medians above are taken over)."""
    num_rounds = meta.get("repeats", 1)
    if num_rounds == 1:
        return []
    loads = meta.get("round_loads") or [None] * num_rounds
    cols = " | ".join(f"round {i}" for i in range(1, num_rounds + 1))
    sep = "|---|" + "---:|" * num_rounds
    out = [f"### Rounds ({num_rounds})", "",
           f"Order: {meta['order_scheme']}. Ratios are taken within each round (both systems ran "
           "minutes apart, under about the same load) and the medians above are over rounds. "
           "Every round profiles steps after its timed steps (of several, each rank keeps the "
           "one whose exposed time is the median): the comm columns are the "
           "median over rounds (each round's median over ranks); the per-phase rows below are "
           "the first successful round's rank 0, their step line gives the medians over "
           "rounds. Loss and memory are from each system's first successful round.", "",
           "| round | order (first → last, row keys) | load at start (1 min) |", "|---|---|---:|"]
    busy = set(meta.get("overloaded_rounds") or ())
    for i, order in enumerate(meta["round_orders"], 1):
        load = loads[i - 1]
        flag = f" **above 2x the {meta.get('cpu_count')} cores**" if i in busy else ""
        out.append(f"| {i} | {' → '.join(order)} | "
                   f"{'n/a' if not load else f'{load[0]:.1f}'}{flag} |")
    out += ["", f"| tokens/GPU/s (position in round) | {cols} |", sep]
    for r in rows:
        cells = []
        for rd in r.get("rounds") or []:
            cells.append(f"{rd['tokens_per_gpu_per_s']:.0f} (#{rd['position']})" if rd.get("status") == "ok"
                         else f"{rd.get('status')} (#{rd['position']})")
        if cells:
            out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    if ratio_recs:
        out += ["", f"| ratio | {cols} |", sep]
        for rec in ratio_recs:
            out.append(f"| {rec['text']} | "
                       + " | ".join("—" if v is None else "refused" if rec.get("refused") else f"{v:.2f}x"
                                    for v in rec["per_round"]) + " |")
    return out + [""]


def write_report(*, rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path,
                 stem: str, plots: bool = True) -> Path:
    """``plots=False``: the JSON and the markdown only (the harness's after-every-system write)."""
    folder = out_dir / stem
    folder.mkdir(parents=True, exist_ok=True)
    ratio_recs = ratio_records(rows)
    (folder / "results.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ratios": ratio_recs}, indent=2, sort_keys=True,
                   default=str) + "\n")
    plots = write_plots(rows, folder) if plots else []
    lines = [*_header_lines(meta), *_results_lines(rows, ratio_recs, meta),
             *[f"![{p}]({stem}/{p})" for p in plots], "",
             *_setup_lines(meta), *_configuration_lines(rows)]
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _header_lines(meta: dict[str, Any]) -> list[str]:
    """Title, machine, mode and the command."""
    spec = meta["spec"]
    return [
        f"# amsp compare: {spec['model']} on {meta['hardware']}, {meta['date']}",
        "",
        *([f"**Incomplete: {meta['incomplete']}.**", ""] if meta.get("incomplete") else []),
        f"Machine: {meta['cpu']}." + _load_text(meta.get("load"))
        + (f" **Round(s) {', '.join(map(str, meta['overloaded_rounds']))} started with the load above "
           f"2x the {meta.get('cpu_count')} cores.**" if meta.get("overloaded_rounds") else ""),
        "",
        f"Mode: **{meta['mode']}**. Command:",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"> {meta['noise_note']}",
        "",
    ]


def _results_lines(rows: list[dict[str, Any]], ratio_recs: list, meta: dict[str, Any]) -> list[str]:
    """The results table, the ratios, the rounds, the overlap ablation, the loss agreement."""
    lines = ["## Results", "", format_table(rows), ""]
    rat = [_ratio_line(rec) for rec in ratio_recs] or [_no_ratio_line(rows, meta)]
    lines += ["### Ratios (tokens/GPU/s)", "", RATIO_RULES, "", *rat, ""]
    swept = sweep_lines(rows)
    if swept:
        lines += ["### Peers at their best (DDP bucket sweep)", "", *swept]
    lim = limit.limit_table(rows)
    if lim:
        lines += ["### Each row against its limit, max(compute, communication)", "", limit.LIMIT_TEXT, "",
                  *lim, ""]
    wire = wire_table(rows)
    if wire:
        lines += ["### What each row sent (one profiled step, rank 0)", "", WIRE_TEXT, "", *wire, ""]
    lines += rounds_section(rows, ratio_recs, meta)
    abl = ablation_table(rows)
    if abl:
        lines += ["### Overlap ablation (paper Table V shape): tokens/GPU/s, change vs all on", "",
                  *([] if meta.get("repeats", 1) == 1 else
                    [f"Median of {meta['repeats']} rounds; the change is the median of the per-round "
                     "changes (each against all on of the same round).", ""]),
                  *abl, ""]
    bd = breakdown_table(rows)
    if bd:
        lines += ["### Where a step's time goes (one profiled step, rank 0: with several, the "
                  "median by exposed time)", "",
                  "Per phase the collectives were issued in and kind (amsp_ext/compare/breakdown.py): "
                  "busy = wall time with one in flight (issue to end on gloo's worker), exposed = the "
                  "part of it when the training thread computed nothing, and where that thread was "
                  "meanwhile. `post_step_broadcast` = the previous step's parameter broadcasts, "
                  "waited for in this step's forward.", "", *bd, ""]
    cpu = cpu_table(rows, meta.get("cpu_count"))
    if cpu:
        lines += ["### CPU per step beside wall time", "", CPU_TEXT, "", *cpu, ""]
    agree = _loss_agreement(rows)
    if agree:
        lines += ["### Loss agreement with DDP (same data, same initial weights)", "", *agree, ""]
    return lines


def _setup_lines(meta: dict[str, Any]) -> list[str]:
    """What every system shared, the caveats and how each figure is measured."""
    spec = meta["spec"]
    peak = meta.get("peak_flops")
    peak_text = f"{peak / 1e9:.1f} GFLOP/s per rank ({meta['compute_dtype']})" if peak else "n/a"
    return [
        "## Setup held fixed across systems",
        "",
        f"- Model: `{spec['model']}` (transformers LlamaForCausalLM from a config, seed {spec['seed']}); "
        f"{meta['num_params']:,} parameters; FLOPs/token (Megatron, see below) {meta['flops_per_token']:,.0f}.",
        f"- Data: byte tokens of the Python reference manual (`amsp_ext.common.data`), seq len {spec['seq_len']}, "
        f"micro-batch {spec['micro_batch_size']} per rank, M = {spec['num_micro_batches']} micro-batches, "
        f"global batch {meta['global_batch_sequences']} sequences ({meta['global_batch_tokens']:,} tokens).",
        f"- Steps: {spec['num_steps']} timed ({spec['num_warmup_steps']} warm-up excluded from the median)"
        # results written before trace_steps existed read one profiled step
        + (f" + {spec.get('trace_steps', 1)} profiled" if spec["trace"] else "")
        + (f", in each of {meta['repeats']} rounds" if meta.get("repeats", 1) > 1 else "")
        + ".",
        f"- Optimizer: AdamW lr {spec['lr']}, betas (0.9, 0.95), weight decay {spec['weight_decay']}; "
        f"global grad-norm clipping {spec['grad_clip']}.",
        f"- Precision: **{spec['precision']}**. {meta['precision_note']}",
        f"- Topology: {meta['topology']}",
        f"- Cluster link: {meta['cluster_link']}",
        f"- Planner inputs for an `auto` AMSP plan: {meta.get('planner', 'n/a')}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        *(["- DeepSpeed patches (applied only where a local probe said they are needed):",
           *(f"  - `patches/{k}.py`: {v}" for k, v in meta["patches"].items())]
          # "-": how results.json files written before the empty dict said "none"
          if set(meta["patches"]) - {"-"} else ["- DeepSpeed patches: none applied"]),
        "",
        "## Reading these numbers",
        "",
        CAVEATS,
        "",
        "## How each figure is measured",
        "",
        METHOD.format(n=1024, peak=peak_text),
        "",
    ]


def _configuration_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each system's settings, as it ran."""
    lines = ["## Per-system configuration", ""]
    for r in rows:
        settings = r.get("settings")
        source = f" Plan from {r['plan_source']}." if r.get("plan_source") else ""
        lines.append(f"- **{r['label']}**:{source} `{json.dumps(settings, sort_keys=True)}`" if settings
                     else f"- **{r['label']}**:{source} {r.get('status')}")
    lines += ["", "Each row's own command is in `results.json` (`rows[].command`)."]
    return lines
