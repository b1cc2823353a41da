"""The engine's own CPU work (issue 51): DDP and an AMSP plan with the communication taken out.

    python comparisons/engine_cpu_overhead.py rounds   --out DIR [--rounds 5 --world 4 --steps 10]
    python comparisons/engine_cpu_overhead.py paired   --out DIR [--steps 16]
    python comparisons/engine_cpu_overhead.py receivers --out DIR [--steps 16]
    python comparisons/engine_cpu_overhead.py sections --out DIR [--steps 14]
    python comparisons/engine_cpu_overhead.py toggle   --out DIR [--steps 20]
    python comparisons/engine_cpu_overhead.py profile  --out DIR --system amsp-plan [--steps 4]
    python comparisons/engine_cpu_overhead.py summary  --out DIR   (a campaign's folder)

Every mode runs small-llama, fp32, 4 micro-batches of 2 x 256 tokens, and the AMSP plan
``--plan`` (default ``p=1x1,g=1x1,os=2x1``, ``--all-reduce two_level``) on a world of ``--world``
ranks, ``--gpus-per-node`` per node, under torch's fake process group (no byte moves).

- ``rounds``: ``amsp compare``'s compute-only job (compare/limit.py [Note: a row's limit]: the
  same ranks, plan and batches on the fake group, ``compare.launch.run_compute_only``) for
  ``ddp`` and ``amsp-plan``, their order alternated round by round; ``DIR/rounds.json`` has
  per round and row the slowest rank's median step (``amsp compare``'s compute only), the last
  micro-batch's backward, and each rank's median training-thread CPU seconds per step.
- ``paired``: both rows as one rank of the same world in one process, steps alternated
  ([Note: paired steps in one process]); ``DIR/paired.json``: per step and phase (forward,
  the backwards before the last, the last backward, optimizer) the thread's CPU seconds.
- ``receivers``: two copies of the AMSP row in one process, one with the harness's zeroed
  receivers, one keeping them ([Note: what a receiver of a fake broadcast holds]);
  ``DIR/receivers.json``.
- ``sections``: the AMSP row alone, one rank; the thread CPU of the engine's parts per step
  (gradient hooks, end-of-backward flush and its parts, optimizer step, broadcasts, waits,
  clip, zero_grad), measured by wrapping those methods; ``DIR/sections.json``.
- ``toggle``: as ``sections``, with this change's cuts switched off and on between steps of
  one process ([Note: the cuts switched between steps]); ``DIR/toggle.json``.
- ``profile``: one row, one rank: cProfile on the thread's CPU clock and torch.profiler over
  a few steps; ``DIR/profile-<system>.json`` (the top entries by own time, own time by where
  the code lives, the top torch ops by self CPU time).

Run a mode under ``PYTHONPATH=<another checkout>`` to measure that checkout's engine (each
record names the tree and its commit).

[Note: one rank alone for the CPU figures]
Four ranks on two cores time-share the cores, so a rank's wall time includes waiting for one,
and a wall-clock profile charges that wait to whatever ran. One rank alone on the fake group
does the same per-rank work as in the job (the world size is kept), and the figures here are
the thread's CPU time (``time.thread_time``), which other processes shift far less than wall
time (they still do, through caches and memory bandwidth: compare alternated runs). cProfile
adds a microsecond or more to every Python call, so its Python-heavy entries (the engine's
hooks) read high against the C++ ones; compare an entry before and after, not across.

[Note: what a receiver of a fake broadcast holds]
The compare worker's compute-only job zeroes what a receiver of the fake group's broadcast gets
(compare/worker.py ``_finite_fake_broadcasts``: AMSP's packed broadcast buffers are otherwise
uninitialised memory). Under ``os=2x1`` that zeroes every parameter a rank does not own after
the first step, the norm weights among them, and the model's output goes uniform: its loss
stays at ln(vocab) = 5.545 from the second step on. ``--receivers keep`` (the default of the
in-process modes) leaves a receiver's tensors as they were instead (an in-place broadcast is
left alone, a packed buffer is filled from the receiver's own tensors), so the model keeps
training-like values. ``receivers`` measures whether the zeroes change the CPU a step takes;
``rounds`` runs the harness's job as ``amsp compare`` does, zeroes included.

[Note: paired steps in one process]
Both rows in one process, their steps alternated (ddp, amsp, amsp, ddp, ...): whatever else the
host runs slows both alike within a pair, so the per-pair difference of CPU seconds is the
engine's extra work with the load's drift taken out; its median and quartiles are the claim,
not either row's level.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = ("ddp", "amsp-plan")


def _spec(args: argparse.Namespace):
    from amsp_ext.compare.config import RunSpec

    return RunSpec(model=args.model, precision="fp32", reduce_dtype="fp32", seq_len=256,
                   micro_batch_size=2, num_micro_batches=4, num_steps=args.warmup + args.steps,
                   num_warmup_steps=args.warmup, amsp_plan=args.plan,
                   amsp_all_reduce=args.all_reduce, gpus_per_node=args.gpus_per_node, trace=False)


def _tree() -> dict:
    """Which amsp_ext this process runs: its folder, commit, and whether it has local edits."""
    import amsp_ext

    root = Path(amsp_ext.__file__).resolve().parents[1]

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()
    return {"root": str(root), "commit": git("rev-parse", "--short", "HEAD"),
            "edited": bool(git("status", "--porcelain", "--untracked-files=no", "amsp_ext"))}


def _record(args: argparse.Namespace, mode: str) -> dict:
    return {"mode": mode, "command": " ".join(["python", *sys.argv]), "tree": _tree(),
            "spec": json.loads(_spec(args).to_json()), "world": args.world, "rank": args.rank,
            "cpu_count": os.cpu_count(), "load_start": os.getloadavg()}


def _write(args: argparse.Namespace, name: str, record: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record["load_end"] = os.getloadavg()
    (out / name).write_text(json.dumps(record, indent=1, default=str) + "\n")


def _med(values: list[float]) -> float:
    return statistics.median(values)


# -- rounds: the harness's compute-only job -----------------------------------------------------
def _job_summary(ranks: list[dict], warmup: int) -> dict:
    from amsp_ext.compare.limit import compute_only_of
    from amsp_ext.common.metrics import median_after_warmup

    cpu = [median_after_warmup([c["main"] if isinstance(c, dict) else c for c in r["cpu_s"]], warmup)
           for r in ranks]
    return {"compute_only_s": compute_only_of(ranks, warmup),
            "last_backward_s": compute_only_of(ranks, warmup, "last_backward_s"),
            "rank_step_s": [median_after_warmup(r["step_s"], warmup) for r in ranks],
            "rank_cpu_s": cpu, "cpu_s_median": _med(cpu), "loss": ranks[0]["loss"]}


def rounds(args: argparse.Namespace) -> dict:
    from amsp_ext.compare.launch import LaunchConfig, run_compute_only

    spec, out = _spec(args), Path(args.out)
    launch = LaunchConfig(nproc_per_node=args.world, timeout_s=args.timeout)
    record = {**_record(args, "rounds"), "rounds": []}
    for r in range(args.rounds):
        order = ROWS if (r + args.first) % 2 == 0 else ROWS[::-1]
        this = {"order": list(order), "load_start": os.getloadavg(), "rows": {}}
        for system in order:
            res = run_compute_only(system, spec, out / f"round{r + 1}" / system, launch,
                                   world_size=args.world, gpus_per_node=args.gpus_per_node)
            if res["status"] != "ok":
                raise SystemExit(f"{system} round {r + 1}: {res['reason']}")
            row = this["rows"][system] = {**_job_summary(res["ranks"], args.warmup),
                                          "wall_s": res["wall_s"], "ranks": res["ranks"]}
            print(f"round {r + 1} {system:10s} compute only {row['compute_only_s']:.3f} s, "
                  f"last backward {row['last_backward_s']:.3f} s, CPU/rank {row['cpu_s_median']:.3f} s",
                  flush=True)
        record["rounds"].append(this)
    record["medians"] = {s: {k: _med([rd["rows"][s][k] for rd in record["rounds"]])
                             for k in ("compute_only_s", "last_backward_s", "cpu_s_median")} for s in ROWS}
    _write(args, "rounds.json", record)
    return record["medians"]


# -- one rank in this process ------------------------------------------------------------------
def _fake_receivers(mode: dict) -> None:
    """Both treatments of [Note: what a receiver of a fake broadcast holds], chosen per call by
    ``mode["now"]``: ``zero`` as the compare worker's compute-only job, ``keep`` a packed
    buffer filled from the receiver's own tensors and an in-place broadcast left alone."""
    import torch
    import torch.distributed as dist

    from amsp_ext.compare import worker
    from amsp_ext.runtime.sync import param_sync

    issue = param_sync.ParamSync._issue

    def _issue(self, k: int) -> None:
        issue(self, k)
        item, (_, buf) = self.items[k], self._inflight[k]
        if mode["now"] == "keep" and buf is not None and item.owner_rank != self.rank:
            torch.cat([t.local().reshape(-1) for t in item.tensors], out=buf)
    param_sync.ParamSync._issue = _issue
    plain = dist.broadcast
    worker._finite_fake_broadcasts()  # replaces dist.broadcast by its zeroing one
    zeroing = dist.broadcast

    def broadcast(*a, **k):
        return (zeroing if mode["now"] == "zero" else plain)(*a, **k)
    dist.broadcast = broadcast


def _one_rank(args: argparse.Namespace, systems: tuple[str, ...], receivers: dict | None = None) -> dict:
    """Rank ``args.rank`` of a ``args.world`` world on the fake group, each of ``systems`` (a
    name, or ``name#tag`` for a second copy) set up on its own copy of the model as the
    compute-only worker sets it up (compare/worker.py). ``receivers``: the switch of
    ``_fake_receivers`` (default: ``args.receivers`` throughout)."""
    import torch
    import torch.distributed as dist

    from amsp_ext.common.models import build_llama
    from amsp_ext.compare import worker
    from amsp_ext.compare.systems import runner
    from amsp_ext.compare.systems.base import Context
    from amsp_ext.runtime._torch_compat import fake_store

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=fake_store(), rank=args.rank, world_size=args.world)
    _fake_receivers(receivers if receivers is not None else {"now": args.receivers})
    spec = _spec(args)
    ctx = Context(spec=spec, rank=args.rank, world_size=args.world,
                  num_nodes=args.world // args.gpus_per_node, gpus_per_node=args.gpus_per_node,
                  compute_only=True, spans=[])
    worker._warm_process(ctx)
    return {s: runner(s.split("#")[0]).setup(s.split("#")[0], build_llama(spec.model, seed=spec.seed), ctx)
            for s in systems}


def _phase_cpu(spans: list) -> contextlib.AbstractContextManager:
    """Context.phase that also appends (name, thread CPU seconds) of each phase to ``spans``."""
    from amsp_ext.compare.systems import base

    original = base.Context.phase

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.thread_time()
        try:
            with original(self, name):
                yield
        finally:
            spans.append((name, time.thread_time() - t0))
    base.Context.phase = phase
    return spans


def _phases(spans: list, total: float) -> dict[str, float]:
    backward = [s for n, s in spans if n == "backward"]
    return {"total": total, "forward": sum(s for n, s in spans if n == "forward"),
            "backward_before_last": sum(backward[:-1]), "last_backward": backward[-1] if backward else 0.0,
            "optimizer": sum(s for n, s in spans if n == "optimizer")}


def _minor_faults() -> int:
    """This thread's minor page faults so far: memory the kernel had to map and zero, which a
    heap that gave pages back and takes them again pays on every step."""
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _quartiles(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": q[1], "q1": q[0], "q3": q[2], "n": len(values)}


def paired(args: argparse.Namespace) -> dict:
    """[Note: paired steps in one process]."""
    spans = _phase_cpu([])
    runs = _one_rank(args, ROWS)
    steps = {s: [] for s in ROWS}
    for step in range(args.warmup + args.steps):
        for s in ROWS if step % 2 == 0 else ROWS[::-1]:
            spans.clear()
            f0, t0 = _minor_faults(), time.thread_time()
            loss = runs[s].train_step(step)
            steps[s].append({**_phases(spans, time.thread_time() - t0), "loss": loss,
                             "page_faults": _minor_faults() - f0})
    kept = {s: v[args.warmup:] for s, v in steps.items()}
    diff = {k: _quartiles([b[k] - a[k] for a, b in zip(kept["ddp"], kept["amsp-plan"])])
            for k in kept["ddp"][0] if k not in ("loss", "page_faults")}
    record = {**_record(args, "paired"), "receivers": args.receivers, "steps": steps,
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
              "page_faults_median": {s: _med([x["page_faults"] for x in v]) for s, v in kept.items()},
              "cpu_s_median": {s: {k: _med([x[k] for x in v]) for k in diff} for s, v in kept.items()},
              "amsp_minus_ddp_cpu_s": diff}
    _write(args, "paired.json", record)
    return {"cpu_s_median": record["cpu_s_median"], "amsp_minus_ddp_cpu_s": diff,
            "page_faults_median": record["page_faults_median"]}


def receivers(args: argparse.Namespace) -> dict:
    """Two copies of the AMSP row in one process, steps alternated: one with its receivers
    zeroed (the harness's compute-only job), one keeping theirs ([Note: what a receiver of a
    fake broadcast holds]); the per-pair difference of CPU per phase."""
    spans = _phase_cpu([])
    mode = {"now": "keep"}
    runs = _one_rank(args, ("amsp-plan#keep", "amsp-plan#zero"), receivers=mode)
    steps: dict[str, list] = {"keep": [], "zero": []}
    for step in range(args.warmup + args.steps):
        for k in ("keep", "zero") if step % 2 == 0 else ("zero", "keep"):
            mode["now"] = k
            spans.clear()
            t0 = time.thread_time()
            loss = runs[f"amsp-plan#{k}"].train_step(step)
            steps[k].append({**_phases(spans, time.thread_time() - t0), "loss": loss})
    kept = {k: v[args.warmup:] for k, v in steps.items()}
    diff = {ph: _quartiles([z[ph] - k[ph] for k, z in zip(kept["keep"], kept["zero"])])
            for ph in kept["keep"][0] if ph != "loss"}
    record = {**_record(args, "receivers"), "steps": steps, "zero_minus_keep_cpu_s": diff,
              "loss_last": {k: v[-1]["loss"] for k, v in steps.items()}}
    _write(args, "receivers.json", record)
    return {"zero_minus_keep_ms": {ph: {q: round(v * 1e3, 1) for q, v in d.items() if q != "n"}
                                   for ph, d in diff.items()}, "loss_last": record["loss_last"]}


# the engine's parts ``sections`` times: (module, class, method, label); a part timed inside
# another (indented label) is counted in both
SECTIONS = (
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_on_grad", "gradient hooks"),
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_launch_ready", "  hooks and flush: launch buckets"),
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_flush", "end-of-backward flush"),
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_complete_oldest", "  flush: wait + select & drop"),
    ("amsp_ext.runtime.sync.grad_exposure", "GradExposure", "expose", "  flush: .grad exposure"),
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_end_pass", "  end of each pass (grad bytes)"),
    ("amsp_ext.runtime.optim.optimizer", "AMSPOptimizer", "step", "optimizer step + broadcasts"),
    ("torch.optim", "AdamW", "step", "  inner AdamW step"),
    ("amsp_ext.runtime.sync.param_sync", "ParamSync", "broadcast_all", "  issue broadcasts"),
    ("amsp_ext.runtime.optim.optimizer", "AMSPOptimizer", "clip_grad_norm_", "clip"),
    ("amsp_ext.runtime.sync.param_sync", "ParamSync", "wait_unit", "pre-forward broadcast waits"),
    ("amsp_ext.runtime.sync.grad_sync", "GradSync", "_before_forward", "pre-forward .grad release"),
    ("amsp_ext.runtime.optim.optimizer", "AMSPOptimizer", "zero_grad", "zero_grad"),
)


def _wrap_sections(acc: collections.Counter) -> None:
    """Time each SECTIONS method on the thread's CPU clock into ``acc`` (outermost call only)."""
    import importlib

    def wrap(f, label):
        depth = [0]

        @functools.wraps(f)
        def timed(*a, **k):
            if depth[0]:
                return f(*a, **k)
            depth[0] += 1
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.thread_time() - t0
                depth[0] -= 1
        return timed
    for module, cls, method, label in SECTIONS:
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, method, wrap(getattr(owner, method), label))


def sections(args: argparse.Namespace) -> dict:
    acc: collections.Counter = collections.Counter()
    _wrap_sections(acc)
    run = _one_rank(args, ("amsp-plan",))["amsp-plan"]
    per: dict[str, list[float]] = collections.defaultdict(list)
    for step in range(args.warmup + args.steps):
        acc.clear()
        t0 = time.thread_time()
        run.train_step(step)
        total = time.thread_time() - t0
        if step >= args.warmup:
            per["step"].append(total)
            for _, _, _, label in SECTIONS:
                per[label].append(acc[label])
    record = {**_record(args, "sections"), "receivers": args.receivers, "per_step_cpu_s": per,
              "median_ms": {k: 1e3 * _med(v) for k, v in per.items()}}
    _write(args, "sections.json", record)
    return {k: round(v, 2) for k, v in record["median_ms"].items()}


# -- toggle: this change's cuts on and off between steps of one process ------------------------
def _switches() -> dict[str, tuple]:
    """(module, attribute, value before the cuts) of each cut of the engine-overhead change:
    every label a record_function (3770c42), the gradient hooks' generator side-stream context
    and unconditional torch.no_grad (ed8a614). Switching them between steps runs the engine as it
    was and as it is on the same model, in the same process."""
    import torch
    from torch.profiler import record_function

    from amsp_ext.runtime import _torch_compat
    from amsp_ext.runtime.sync import grad_sync

    @contextlib.contextmanager
    def side_stream(self):
        if self.stream is None:
            yield
            return
        with self._side_stream():
            yield
    return {"label": (_torch_compat, "label", record_function),
            "no_grad": (grad_sync, "_no_grad", torch.no_grad),
            "side_stream": (grad_sync.GradSync, "_on_side_stream", side_stream)}


def toggle(args: argparse.Namespace) -> dict:
    """[Note: the cuts switched between steps]
    A before/after of two checkouts needs two processes, whose CPU seconds differ by what the
    host ran meanwhile. The cuts of this change only replace three functions, so one process can
    run steps with the old ones and with the new, alternated (old, new, new, old, ...): the
    per-pair difference of the engine parts' CPU is the cuts' effect with the load's drift out."""
    acc: collections.Counter = collections.Counter()
    _wrap_sections(acc)
    run = _one_rank(args, ("amsp-plan",))["amsp-plan"]
    switches = _switches()
    current = {name: getattr(owner, attr) for name, (owner, attr, _) in switches.items()}
    per: dict[str, dict[str, list[float]]] = {"old": collections.defaultdict(list),
                                              "new": collections.defaultdict(list)}
    for step in range(args.warmup + 2 * args.steps):
        version = ("old", "new")[(step // 2 + step) % 2]  # old, new, new, old, old, new, ...
        for name, (owner, attr, old) in switches.items():
            setattr(owner, attr, old if version == "old" else current[name])
        acc.clear()
        t0 = time.thread_time()
        run.train_step(step)
        total = time.thread_time() - t0
        if step >= args.warmup:
            per[version]["step"].append(total)
            for _, _, _, label in SECTIONS:
                per[version][label].append(acc[label])
    n = min(len(per["old"]["step"]), len(per["new"]["step"]))
    diff = {k: _quartiles([b - a for a, b in zip(per["old"][k][:n], per["new"][k][:n])]) for k in per["old"]}
    record = {**_record(args, "toggle"), "receivers": args.receivers, "per_step_cpu_s": per,
              "new_minus_old_cpu_s": diff}
    _write(args, "toggle.json", record)
    return {k: {q: round(v * 1e3, 2) for q, v in d.items() if q != "n"} for k, d in diff.items()}


# -- profile -----------------------------------------------------------------------------------
def _where(file: str) -> str:
    """Which code a cProfile entry belongs to: the engine (amsp_ext), torch, the model, ..."""
    for key, name in (("amsp_ext", "amsp_ext"), ("torch/nn/parallel", "torch ddp"), ("torch", "torch"),
                      ("transformers", "transformers")):
        if f"/{key}/" in file:
            return name
    return "other"


def _cprofile_tables(prof, n: int, k: int) -> dict:
    """The top ``n`` entries by own time, and own time by where the code lives, per step (``k``
    steps profiled). A builtin's own time (a tensor method, a torch op) is charged to where its
    callers live, so an engine's ``copy_`` counts as the engine's."""
    import pstats

    stats = pstats.Stats(prof).stats
    rows, by_where = [], collections.Counter()
    for (file, line, fn), (_, nc, tt, ct, callers) in stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})" if line else fn, "calls": nc / k,
                     "tottime_s": tt / k, "cumtime_s": ct / k})
        if file != "~":
            by_where[_where(file)] += tt / k
            continue
        for (cfile, _, _), (_, _, ctt, _) in callers.items():
            by_where[_where(cfile)] += ctt / k
    return {"top": sorted(rows, key=lambda r: -r["tottime_s"])[:n],
            "own_time_by_code": dict(by_where.most_common())}


def profile(args: argparse.Namespace) -> dict:
    import cProfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run = _one_rank(args, (args.system,))[args.system]
    times: dict[str, list[float]] = {"step_s": [], "cpu_s": []}
    step = 0
    for step in range(args.warmup + args.steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        run.train_step(step)
        times["step_s"].append(time.perf_counter() - t0)
        times["cpu_s"].append(time.thread_time() - c0)
    k = args.profile_steps
    prof = cProfile.Profile(time.thread_time)  # [Note: one rank alone for the CPU figures]
    prof.enable()
    for step in range(step + 1, step + 1 + k):
        run.train_step(step)
    prof.disable()
    with torch_profile(activities=[ProfilerActivity.CPU]) as tp:
        for step in range(step + 1, step + 1 + k):
            run.train_step(step)
    ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
    record = {**_record(args, "profile"), "system": args.system, "receivers": args.receivers, **times,
              "cpu_s_median": _med(times["cpu_s"][args.warmup:]), "profiled_steps": k,
              "cprofile": _cprofile_tables(prof, args.top, k),
              "torch_ops_top": [{"name": e.key, "calls": e.count / k,
                                 "self_cpu_s": e.self_cpu_time_total / 1e6 / k} for e in ops]}
    _write(args, f"profile-{args.system}.json", record)
    return {"system": args.system, "cpu_s_median": record["cpu_s_median"],
            "own_time_by_code_s": record["cprofile"]["own_time_by_code"]}


# -- summary of a campaign (engine_cpu_overhead_campaign.sh) ------------------------------------
def _runs(root: Path, kind: str, name: str) -> dict[str, list[dict]]:
    """``root/kind/{before,after}-*/name`` as {"before": [...], "after": [...]}, in run order."""
    out: dict[str, list[dict]] = {"before": [], "after": []}
    for f in sorted(root.glob(f"{kind}/*/{name}")):
        tag = f.parent.name.split("-")[0]
        if tag in out:
            out[tag].append(json.loads(f.read_text()))
    return out


def _fmt(values: list[float], scale: float = 1e3, nd: int = 1) -> str:
    return " / ".join(f"{v * scale:.{nd}f}" for v in values)


def _summary_sections(root: Path) -> list[str]:
    runs = _runs(root, "sections", "sections.json")
    if not runs["before"]:
        return []
    lines = ["| engine part (one rank, thread CPU ms per step, median per run) | before | after |",
             "|---|---|---|"]
    for label in runs["before"][0]["median_ms"]:
        lines.append(f"| {label.strip()}{' (inside the above)' if label.startswith('  ') else ''} | "
                     f"{_fmt([r['median_ms'][label] for r in runs['before']], 1, 2)} | "
                     f"{_fmt([r['median_ms'].get(label, float('nan')) for r in runs['after']], 1, 2)} |")
    return lines


def _summary_paired(root: Path) -> list[str]:
    lines = ["| run | receivers | phase | ddp | amsp | amsp - ddp: median (q1, q3) |", "|---|---|---|---|---|---|"]
    for f in sorted(root.glob("paired/*/paired.json")):
        r = json.loads(f.read_text())
        for phase, d in r["amsp_minus_ddp_cpu_s"].items():
            lines.append(f"| {f.parent.name} ({r['tree']['commit']}) | {r['receivers']} | {phase} | "
                         f"{r['cpu_s_median']['ddp'][phase] * 1e3:.1f} | {r['cpu_s_median']['amsp-plan'][phase] * 1e3:.1f} | "
                         f"{d['median'] * 1e3:+.1f} ({d['q1'] * 1e3:+.1f}, {d['q3'] * 1e3:+.1f}) |")
    return lines


def _summary_rounds(root: Path) -> list[str]:
    lines = ["| run | load at start | row | compute only (s) | last backward (s) | CPU per rank (s) | loss, last step |",
             "|---|---|---|---|---|---|---|"]
    for f in sorted(root.glob("rounds/*/rounds.json"), key=lambda f: (f.parent.name.split("-")[1], f.parent.name)):
        r = json.loads(f.read_text())
        for rd in r["rounds"]:
            for s in rd["order"]:
                row = rd["rows"][s]
                lines.append(f"| {f.parent.name} ({r['tree']['commit']}) | {rd['load_start'][0]:.1f} | {s} | "
                             f"{row['compute_only_s']:.3f} | {row['last_backward_s']:.3f} | "
                             f"{row['cpu_s_median']:.3f} | {row['loss'][-1]:.3f} |")
    return lines


def _summary_rounds_ratio(root: Path) -> list[str]:
    """Per tree: each round's amsp-plan / ddp compute only, their median and range."""
    lines = []
    for tag in ("before", "after"):
        ratios, cpu = [], []
        for f in sorted(root.glob(f"rounds/{tag}-*/rounds.json")):
            for rd in json.loads(f.read_text())["rounds"]:
                ratios.append(rd["rows"]["amsp-plan"]["compute_only_s"] / rd["rows"]["ddp"]["compute_only_s"])
                cpu.append(rd["rows"]["amsp-plan"]["cpu_s_median"] - rd["rows"]["ddp"]["cpu_s_median"])
        if ratios:
            lines.append(f"- {tag}: amsp-plan / ddp compute only per round {', '.join(f'{r:.2f}' for r in ratios)}; "
                         f"median {_med(ratios):.2f}; CPU per rank amsp - ddp (ms) "
                         f"{', '.join(f'{c * 1e3:+.0f}' for c in cpu)}")
    return lines


def _summary_toggle(root: Path) -> list[str]:
    lines = ["| run | engine part | new - old, ms per step: median (q1, q3), pairs |", "|---|---|---|"]
    for f in sorted(root.glob("toggle/*/toggle.json")):
        r = json.loads(f.read_text())
        for part, d in r["new_minus_old_cpu_s"].items():
            lines.append(f"| {f.parent.name} ({r['tree']['commit']}) | {part.strip()} | "
                         f"{d['median'] * 1e3:+.2f} ({d['q1'] * 1e3:+.2f}, {d['q3'] * 1e3:+.2f}), {d['n']} |")
    return lines


def _summary_receivers(root: Path) -> list[str]:
    lines = []
    for f in sorted(root.glob("receivers/*/receivers.json")):
        r = json.loads(f.read_text())
        parts = "; ".join(f"{ph} {d['median'] * 1e3:+.1f} ({d['q1'] * 1e3:+.1f}, {d['q3'] * 1e3:+.1f})"
                          for ph, d in r["zero_minus_keep_cpu_s"].items())
        lines.append(f"- {f.parent.name} ({r['tree']['commit']}): zero - keep, ms per step, median (q1, q3): "
                     f"{parts}; last loss {r['loss_last']}")
    return lines


def _summary_malloc(root: Path) -> list[str]:
    lines = ["| run | MALLOC_ env | load | page faults per step (ddp, amsp) | CPU per step ms (ddp, amsp) |",
             "|---|---|---|---|---|"]
    for f in sorted(root.glob("malloc/*/paired.json")):
        r = json.loads(f.read_text())
        pf, cpu = r["page_faults_median"], r["cpu_s_median"]
        lines.append(f"| {f.parent.name} | {' '.join(f'{k}={v}' for k, v in r['malloc_env'].items()) or '-'} | "
                     f"{r['load_start'][0]:.1f} | {pf['ddp']:.0f}, {pf['amsp-plan']:.0f} | "
                     f"{cpu['ddp']['total'] * 1e3:.1f}, {cpu['amsp-plan']['total'] * 1e3:.1f} |")
    return lines


def _summary_profile(root: Path, n: int = 8) -> list[str]:
    lines = []
    for f in sorted(root.glob("profile/*/profile-*.json")):
        r = json.loads(f.read_text())
        own = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["cprofile"]["own_time_by_code"].items())
        lines += [f"- {f.parent.name} {r['system']} ({r['tree']['commit']}): CPU per step "
                  f"{r['cpu_s_median'] * 1e3:.0f} ms; cProfile own time per step by code (ms): {own}"]
        engine = [e for e in r["cprofile"]["top"] if "amsp_ext" in e["function"] or e["function"].startswith(
            ("grad_sync", "param_sync", "optimizer", "collectives", "step.py"))][:n]
        lines += [f"  - {e['function']}: {e['calls']:.0f} calls, own {e['tottime_s'] * 1e3:.2f} ms, "
                  f"cumulative {e['cumtime_s'] * 1e3:.1f} ms" for e in engine]
    return lines


def summary(args: argparse.Namespace) -> dict:
    root = Path(args.out)
    text = ["## sections", *_summary_sections(root), "", "## toggle", *_summary_toggle(root), "",
            "## paired", *_summary_paired(root), "", "## receivers", *_summary_receivers(root), "",
            "## heap (paired, default vs fixed glibc thresholds)", *_summary_malloc(root), "",
            "## rounds", *_summary_rounds(root), "", *_summary_rounds_ratio(root), "",
            "## profile", *_summary_profile(root)]
    (root / "summary.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return {"written": str(root / "summary.md")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("rounds", "paired", "receivers", "sections", "toggle", "profile", "summary"))
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="small-llama")
    p.add_argument("--plan", default="p=1x1,g=1x1,os=2x1")
    p.add_argument("--all-reduce", default="two_level")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--first", type=int, choices=(0, 1), default=0,
                   help="rounds: 0 starts with ddp, 1 with amsp-plan (then they alternate)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--receivers", choices=("keep", "zero"), default="keep",
                   help="[Note: what a receiver of a fake broadcast holds]")
    p.add_argument("--system", default="amsp-plan", help="profile: ddp or amsp-plan")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    result = {"rounds": rounds, "paired": paired, "receivers": receivers, "sections": sections, "toggle": toggle,
              "profile": profile, "summary": summary}[args.mode](args)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
