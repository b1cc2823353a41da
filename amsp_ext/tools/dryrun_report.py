"""Text, Markdown and PNG of a dry run's result (tools/dryrun.py): engine vs planner."""

from __future__ import annotations

import collections
import json
import os

from amsp_ext.topology.groups import ALL_REDUCE_KINDS, group_kind

__all__ = ["bytes_per_kind", "counts_per_group", "format_text", "planner_at", "tp_bytes_per_phase", "write_out"]

CATS = ("params", "grads", "optimizer", "activations", "temporary")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def bytes_per_kind(rank: dict) -> dict[str, int]:
    """One step's bytes per collective kind of the engine's gradient/parameter groups (the
    clip-norm and loss all-reduces on ``world``/``norm`` groups are not Eq. 3-7 terms)."""
    out = collections.Counter()
    for c in rank["collectives"]:
        group = group_kind(c["group"])
        if group in ALL_REDUCE_KINDS and c["group"] != group:
            # a two-level all-reduce (collectives.py [Note: two-level all-reduce]): its first
            # phase, in the node, carries the bucket's v; the other two move the same bucket
            if c["group"].endswith("_local") and c["kind"] in ("all_reduce", "reduce_scatter"):
                out["all_reduce"] += c["bytes"]
            continue
        if c["kind"] == "all_reduce" and group not in ALL_REDUCE_KINDS:
            continue
        if c["kind"] == "broadcast" and c["group"] != "optim_bcast":
            continue
        out[c["kind"]] += c["bytes"]
    return {k: out.get(k, 0) for k in KINDS}


def counts_per_group(rank: dict) -> dict[tuple[str, str], int]:
    """One step's collectives per (kind, group kind), as the engine issued them."""
    out = collections.Counter((c["kind"], group_kind(c["group"])) for c in rank["collectives"])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def _count_rows(result: dict, rank: dict) -> list[str]:
    """Collectives per step per group beside the planner's count and FSDP2's ZeRO-3 of the same
    sharding (planner/issued.py [Note: FSDP2's count]; '-': not one of its collectives)."""
    counts = result["planner"].get("collectives", {})
    planner, fsdp2 = counts.get("planner", {}), counts.get("fsdp2", {})
    fsdp2_group = {"all_gather": "param_shard", "reduce_scatter": "param_shard", "all_reduce": "param_replica"}
    head = (f"  {'collectives per step':<36} {'engine':>7} {'planner':>8} {'FSDP2':>7}"
            f"   (FSDP2: fully_shard per layer, then the root)")
    lines = [head]
    got = counts_per_group(rank)
    for kind, group in sorted(set(got) | {(k, g) for k, g in fsdp2_group.items() if k in fsdp2},
                              key=lambda kg: (kg[1], kg[0])):
        p = planner.get(kind, "-") if fsdp2_group.get(kind) == group else "-"
        f = fsdp2.get(kind, "-") if fsdp2_group.get(kind) == group else "-"
        lines.append(f"  {kind + ' ' + group:<36} {got.get((kind, group), 0):>7} {p:>8} {f:>7}")
    return lines


def tp_bytes_per_phase(rank: dict) -> dict[str, int]:
    """One step's TP collective bytes (tools/dryrun.py TPLog) by the loop's phase."""
    out = collections.Counter()
    for c in rank.get("tp_collectives", ()):
        out[c["phase"]] += c["bytes"]
    return {k: out.get(k, 0) for k in ("forward", "backward", "optimizer")}


def planner_at(result: dict, rank: dict) -> dict:
    """The planner's categories at the moment of the step where the engine's peak was
    (planner/memory.py [Note: temporary buffers and the peak]): model states are the same at
    every moment, activations and temporary buffers are that moment's. Where two moments are
    within a few per cent of each other the two sides may peak at different ones; comparing a
    category across moments would then say nothing about either model."""
    planner = result["planner"]
    at = dict(planner["memory"])
    moment = rank.get("peak_moment")
    if moment in planner.get("moments", {}):
        at.update(planner["moments"][moment])
    return at


def _rows(result: dict) -> list[str]:
    lines = []
    pm = result["planner"]["memory"]
    for rank in result["ranks"]:
        at = planner_at(result, rank)
        lines.append(f"rank {rank['rank']}: peak {_gib(rank['peak_bytes'])} GiB at {rank.get('peak_moment')} "
                     f"(planner: {_gib(pm['total'])} GiB at {result['planner'].get('peak_moment')}), "
                     f"{rank['seconds']['total']:.1f} s")
        lines.append(f"  start-up (meta model to sharded): peak {_gib(rank['startup_peak_bytes'])} GiB "
                     f"(planner: {_gib(pm['startup'])} GiB)")
        lines.append(f"  {'category':<12} {'engine GiB':>11} {'planner GiB':>12} {'ratio':>7}"
                     f"   (planner at the engine's peak moment)")
        for c in CATS:
            e, p = rank["memory"][c], at[c]
            lines.append(f"  {c:<12} {_gib(e):>11} {_gib(p):>12} {e / p if p else float('nan'):>7.2f}")
        real = rank.get("real")
        if real and "peak_allocated_bytes" in real:  # [Note: real tensors on a GPU]
            lines.append(f"  {real['device']} (torch {real['torch']}): allocator peak "
                         f"{_gib(real['startup_peak_allocated_bytes'])} GiB at start-up, "
                         f"{_gib(real['peak_allocated_bytes'])} GiB allocated, "
                         f"{_gib(real['peak_reserved_bytes'])} GiB reserved; step "
                         f"{real['untracked_step_s']:.3f} s without communication; "
                         f"{real['steps_skipped']} step(s) skipped")
        got, want = bytes_per_kind(rank), result["planner"]["bytes"]
        lines.append(f"  {'collective':<15} {'engine MiB':>11} {'planner MiB':>12}")
        for k in KINDS:
            lines.append(f"  {k:<15} {got[k] / 2**20:>11.2f} {want[k] / 2**20:>12.2f}")
        lines += _count_rows(result, rank)
        tp = result["planner"].get("tensor_parallel") or {}
        if tp.get("degree", 1) > 1:
            got_tp = tp_bytes_per_phase(rank)
            lines.append(f"  TP (all-reduces in the TP group of {tp['degree']}, apart from AMSP's above; "
                         f"planner: 2 per layer per pass of {tp['activation_allreduce_bytes']:,} B)")
            for k in ("forward", "backward"):
                lines.append(f"  {'tp ' + k:<15} {got_tp[k] / 2**20:>11.2f} {tp['step_bytes'][k] / 2**20:>12.2f}")
            if got_tp["optimizer"]:
                lines.append(f"  {'tp optimizer':<15} {got_tp['optimizer'] / 2**20:>11.2f} {0:>12.2f}")
    return lines


def format_text(result: dict) -> str:
    T = (result["planner"].get("tensor_parallel") or {}).get("degree", 1)
    layout = f" (TP {T} x data-parallel {result['world'] // T})" if T > 1 else ""
    head = f"dry run: {result['model']} on {result['world']} ranks{layout}, plan {result['plan']}, {result['shape']}"
    verdict = ("fits" if result["fits"] else "does NOT fit") + \
        f" in {_gib(result['gpu_memory_bytes'])} GiB by the engine's count"
    kernel = result["ranks"][0]["sdpa_kernel"] if result["ranks"] else ""
    return "\n".join([head, *_rows(result), f"attention: {kernel}", verdict,
                      f"{result['seconds']:.1f} s"])


def write_out(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dryrun.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("# amsp dryrun\n\n```\n" + format_text(result) + "\n```\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank = result["ranks"][0]
    x = range(len(CATS))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.2 for i in x], [rank["memory"][c] / 2**30 for c in CATS], 0.4, label="engine (dry run)")
    at = planner_at(result, rank)
    ax.bar([i + 0.2 for i in x], [at[c] / 2**30 for c in CATS], 0.4, label="planner (same moment)")
    ax.set_xticks(list(x), CATS)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{result['model']} {result['plan']} on {result['world']} ranks (rank {rank['rank']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory.png"), dpi=100)
    plt.close(fig)
