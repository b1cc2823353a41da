"""``amsp migrate``: turn a DeepSpeed ``ds_config.json`` into one that runs AMSP (torch-free).

    amsp migrate ds_config.json --model llama-7b [--nodes N --gpus-per-node R --gpu-memory M]
                 [--seq-len L] [--plan PLAN|auto] [-o out.json] [--json]
    amsp migrate ds_config.json [-o out.json]    # only upgrade an amsp block of the old shape

Reads the ZeRO stage, hpZ size (``zero_hpz_partition_size``), MiCS shard size, bucket size,
bf16/fp16, gradient accumulation and clipping; writes the same config plus an ``"amsp"`` block
(``enabled: true`` and the planned factors; DeepSpeed's own keys are kept, so ``"enabled":
false`` runs DeepSpeed again, except the keys frameworks would act on behind AMSP's back -
offload, the hybrid engine - which are removed and listed: ds_keys.REMOVED_ON_MIGRATE); prints the old layout as factors next to the planned one, with
the planner's predicted communication (Tp, Tg, T0_os, T1_os) and memory for both. Every key it
does not map is reported on stderr, one line each, with what AMSP does instead.

[Note: the two bucket sizes]
DeepSpeed's ``reduce_bucket_size`` counts elements (default 5e8). The old layout is costed with
that bucket; the AMSP plan with the config's explicit ``reduce_bucket_size`` (converted to
bytes and written as ``amsp.grad_bucket_bytes``), or else the engine's default (25 MiB) - DeepSpeed's
default would make one bucket of a 1B-element model and defeat overlap.

[Note: the two jobs]
The layouts differ in more than the bucket. The old one is DeepSpeed's: gradients reduced in
the compute dtype unless the config names one (``named_reduce_dtype``), prefetched per submodule.
The AMSP plan is costed for what the migrated job will run: the engine's unit (a layer) and
the reduce dtype the ds_config route gives it (``reduce_dtype_from_ds``: fp32 unless the
config names the compute dtype).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from amsp_ext import schema
from amsp_ext.choices import PRECISIONS
from amsp_ext.engine_config import EngineConfig, engine_default
from amsp_ext.cli.planner_flags import add_gpu_memory, add_memory_reserve, add_missing_mesh, add_profile
from amsp_ext.planner.defaults import DEFAULT_OPTIMIZER, DEFAULT_SEQ_LEN
from amsp_ext.planner.specs import STEP_SHAPE_FIELDS, StepShape

HELP = "convert a DeepSpeed ds_config.json to AMSP: plan it, compare old vs new, write the amsp block"

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default
_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd-momentum", "lion": "lion"}
_STATUS_WORDS = {"superseded": "replaced by AMSP", "ignored": "no effect under AMSP",
                 "unsupported": "NOT honoured by AMSP"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="DS_CONFIG", help="the DeepSpeed config JSON to migrate")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="where to write the migrated config (default: <DS_CONFIG stem>.amsp.json)")
    # not required by argparse: a ds_config whose amsp block has the old shape is upgraded
    # without one (run); any other needs a model, checked there
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="a preset (llama-7b ... llama-65b) or a built-in model "
                                       "(tiny-llama, small-llama)")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    c = p.add_argument_group("target cluster")
    c.add_argument("--nodes", type=int, default=1, help="N (default 1)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="R (default 8)")
    add_gpu_memory(c)
    add_memory_reserve(c)
    # written into the amsp block as they are: the engine's own flags (schema.py)
    schema.add_arguments(c, EngineConfig, only=("nodes_per_leaf",))
    add_profile(c)
    add_missing_mesh(c)
    t = p.add_argument_group("training (what the ds_config does not say)")
    # the step's shape (StepShape's flags); not given: the seq_len default (given, it must fit the
    # model), and the ds_config's train_micro_batch_size_per_gpu / gradient_accumulation_steps (the
    # flags are needed where those are 'auto')
    schema.add_arguments(t, StepShape, unset=STEP_SHAPE_FIELDS)
    t.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="needed when bf16/fp16.enabled is 'auto'")
    schema.add_arguments(t, EngineConfig, only=("recompute",))
    p.add_argument("--plan", default=None,
                   help="write this plan instead of the planner's choice (factors, a baseline "
                        "name, or 'auto' to plan again at start-up on the real cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _err(msg: str) -> None:
    print(f"amsp migrate: warning: {msg}", file=sys.stderr)


def _auto_value(cfg: dict, key: str, flag_value, flag: str) -> Any:
    v = cfg.get(key)
    if v == "auto":
        if flag_value is None:
            raise ValueError(f"{key} is 'auto' (the launcher fills it): give {flag}")
        return flag_value
    return flag_value if (v is None and flag_value is not None) else v


def old_layout(cfg: dict[str, Any]) -> tuple[str, int | None, int | None, str]:
    """``(baseline key, mics size, hpz size, label)`` of the config's ZeRO setting."""
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # True == 1 in Python
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    mics = zero.get("mics_shard_size", -1)
    hpz = zero.get("zero_hpz_partition_size", 1)
    for name, v in (("mics_shard_size", mics), ("zero_hpz_partition_size", hpz)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"zero_optimization.{name} must be an integer, got {v!r}")
    if stage == 3 and mics > 0:
        return "mics", mics, None, f"MiCS (shard group {mics})"
    if stage == 3 and hpz > 1:
        return "zero++", None, hpz, f"ZeRO++ (hpZ {hpz})"
    if (mics > 0 or hpz > 1) and stage != 3:
        _err(f"zero_optimization: mics_shard_size / zero_hpz_partition_size need stage 3; read as "
             f"ZeRO-{stage}")
    return ("ddp" if stage == 0 else f"zero{stage}"), None, None, (
        "DDP (ZeRO stage 0)" if stage == 0 else f"ZeRO-{stage}")


def _amsp_job(args, job: "_Job", world: int):
    """``(batch, Job)``: the ds_config's batch and the job AMSP runs for it (amsp_ext/job.py),
    with the AMSP plan's bucket ([Note: the two jobs])."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.integrations.settings import reduce_dtype_from_ds, resolve_batch
    from amsp_ext.job import Job
    from amsp_ext.planner.auto import AutoPlanConfig

    cfg, precision = job.cfg, job.precision

    batch_cfg = dict(cfg)
    batch_cfg["train_micro_batch_size_per_gpu"] = _auto_value(
        cfg, "train_micro_batch_size_per_gpu", args.micro_batch_size, "--micro-batch-size")
    batch_cfg["gradient_accumulation_steps"] = _auto_value(
        cfg, "gradient_accumulation_steps", args.num_micro_batches, "--micro-batches")
    if batch_cfg.get("train_batch_size") == "auto":
        batch_cfg.pop("train_batch_size")
    batch = resolve_batch(batch_cfg, world)
    opt_type = str((cfg.get("optimizer") or {}).get("type", DEFAULT_OPTIMIZER)).lower()
    optimizer = _OPTIMIZERS.get(opt_type)
    if optimizer is None:
        _err(f"optimizer.type {opt_type!r}: memory is estimated as for AdamW")
        optimizer = DEFAULT_OPTIMIZER
    auto = AutoPlanConfig(seq_len=args.seq_len, micro_batch_size=batch.micro_batch_size,
                          num_micro_batches=batch.gradient_accumulation_steps, profile=args.profile,
                          missing=args.missing_mesh, optimizer=optimizer,
                          gpu_memory_bytes=job.cluster.gpu_memory_bytes,
                          memory_reserve_bytes=job.reserve_bytes)
    engine = EngineConfig(gpus_per_node=args.gpus_per_node, nodes_per_leaf=args.nodes_per_leaf,
                          precision=precision, reduce_dtype=reduce_dtype_from_ds(cfg, precision),
                          grad_bucket_bytes=job.new_bucket, recompute=bool(args.recompute), auto=auto)
    return batch, Job(model=job.spec, num_nodes=args.nodes, engine=engine,
                      plan=args.plan if args.plan is not None else "auto")  # [Note: the two jobs]


def _precision(args, cfg: dict[str, Any]) -> str:
    from amsp_ext.integrations.settings import PrecisionSettings

    fixed = json.loads(json.dumps(cfg))
    for block in ("bf16", "fp16"):
        b = fixed.get(block)
        if isinstance(b, dict) and b.get("enabled") == "auto":
            if args.precision is None:
                _err(f"{block}.enabled is 'auto': planned as bf16 (give --precision to choose)")
            b["enabled"] = (args.precision or "bf16") == block
    prec = PrecisionSettings.from_ds(fixed).precision
    return args.precision or prec


def _column(c, plan_text: str, note: str = "") -> dict[str, Any]:
    m = c.memory
    return {"factors": plan_text, "note": note, "t_comm_s": c.comm.as_dict(),
            "memory_bytes": {"params": m.params, "grads": m.grads, "optim": m.optim,
                             "model_states": m.model_states, "activations": m.activations,
                             "tmp": m.tmp, "total": m.total},
            "fits": c.feasible}


@dataclasses.dataclass(kw_only=True)
class _Job:
    """What ``build`` reads and plans, step by step: the ds_config, the model and cluster, and
    the old layout's and the AMSP plan's problems, each with its own bucket ([Note: the two
    bucket sizes])."""

    cfg: dict[str, Any]
    spec: Any = None
    cluster: Any = None
    reserve_bytes: int = 0
    precision: str | None = None
    explicit_bucket: int | None = None
    old_bucket: int = 0
    new_bucket: int = 0
    seq_len_assumed: bool = False  # --seq-len not given: planned for the default
    batch: Any = None
    amsp: Any = None  # the job AMSP runs (amsp_ext/job.py Job)
    prob_old: Any = None
    prob_new: Any = None


def build(args) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(migrated ds_config, report)``."""
    job = _read_inputs(args)
    _read_cluster(args, job)
    job.precision = _precision(args, job.cfg)
    _set_buckets(job)
    key, mics, hpz, label = old_layout(job.cfg)
    _make_problems(args, job)
    old = next(b for b in _baselines(job.prob_old, mics, hpz) if b.key == key)
    chosen, new_note, write_plan = _choose_plan(args, job)
    out, rewrites = _migrated_config(job.cfg, _amsp_block(args, job, write_plan))
    report = _report(args, job, label=label, old=old, hpz=hpz, chosen=chosen, new_note=new_note,
                     write_plan=write_plan, rewrites=rewrites)
    return out, report


def _read_inputs(args) -> _Job:
    """Flags and the ds_config checked (one-line errors) before anything is planned."""
    from amsp_ext.integrations.settings import check_optimizer_block, gradient_clipping, load_ds_config

    for flag, name in (("nodes", "--nodes"), ("gpus_per_node", "--gpus-per-node"), ("seq_len", "--seq-len"),
                       ("micro_batch_size", "--micro-batch-size"), ("num_micro_batches", "--micro-batches"),
                       ("nodes_per_leaf", "--nodes-per-leaf")):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v}")
    cfg = load_ds_config(args.config)
    check_optimizer_block(cfg)
    gradient_clipping(cfg)  # the value the written config keeps, refused now if AMSP would refuse it
    out_path = Path(args.output) if args.output else Path(args.config).with_suffix(".amsp.json")
    if not out_path.parent.is_dir():  # refuse before planning, not after
        raise ValueError(f"-o/--output: directory {out_path.parent} does not exist")
    return _Job(cfg=cfg)


def _read_cluster(args, job: _Job) -> None:
    """The model, its sequence length, the target cluster and the memory reserve."""
    from amsp_ext.planner.specs import ClusterSpec, parse_size
    from amsp_ext.common.models import model_spec

    job.spec = model_spec(args.model, args.model_config)
    if args.seq_len is None:  # the planner's estimate only; amsp.seq_len can be changed later
        args.seq_len, job.seq_len_assumed = DEFAULT_SEQ_LEN, True
    else:
        job.spec.check_seq_len(args.seq_len)
    job.cluster = ClusterSpec(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              gpu_memory_bytes=parse_size(args.gpu_memory, field="--gpu-memory"),
                              nodes_per_leaf=args.nodes_per_leaf)
    job.reserve_bytes = parse_size(args.memory_reserve, field="--memory-reserve", allow_zero=True)


def _set_buckets(job: _Job) -> None:
    """The old layout's bucket and the AMSP plan's ([Note: the two bucket sizes])."""
    from amsp_ext.integrations.settings import ds_bucket_bytes

    elem = 4 if job.precision == "fp32" else 2
    job.explicit_bucket = ds_bucket_bytes(job.cfg, job.precision)
    job.old_bucket = job.explicit_bucket or DEEPSPEED_BUCKET_ELEMENTS * elem
    job.new_bucket = job.explicit_bucket or engine_default("grad_bucket_bytes")


def _make_problems(args, job: _Job) -> None:
    """The batch and the planner problems of both layouts ([Note: the two bucket sizes],
    [Note: the two jobs])."""
    from amsp_ext.integrations.settings import named_reduce_dtype
    from amsp_ext.job import problem

    world = args.nodes * args.gpus_per_node
    job.batch, job.amsp = _amsp_job(args, job, world)
    # once: _amsp_job may warn; DeepSpeed's own job ([Note: the two jobs])
    old_engine = dataclasses.replace(job.amsp.engine, grad_bucket_bytes=job.old_bucket, granularity="module",
                                     reduce_dtype=named_reduce_dtype(job.cfg, job.precision) or job.precision)
    job.prob_new = problem(job.amsp)
    job.prob_old = problem(dataclasses.replace(job.amsp, engine=old_engine))


def _baselines(problem, mics: int | None, hpz: int | None):
    from amsp_ext.planner.baselines import baselines

    return baselines(problem, mics_size=mics, hpz_size=hpz)


def _choose_plan(args, job: _Job):
    """``(costed candidate, note, plan text to write)``: the planner's choice, or ``--plan``."""
    from amsp_ext.job import resolve
    from amsp_ext.planner.search import evaluate

    chosen = evaluate(job.prob_new, resolve(job.amsp).plan)
    if job.amsp.plan_is_auto:
        return chosen, "the planner's choice", args.plan if args.plan is not None else str(chosen.plan)
    return chosen, f"--plan {args.plan}", args.plan


def _amsp_block(args, job: _Job, write_plan: str) -> dict[str, Any]:
    """The ``"amsp"`` block to write; refused here if it would not load."""
    from amsp_ext.integrations.settings import AMSPSettings

    overlap = (job.cfg.get("zero_optimization") or {}).get("overlap_comm")
    block: dict[str, Any] = {
        "enabled": True, "plan": write_plan, "seq_len": args.seq_len,
        "gpus_per_node": args.gpus_per_node, "nodes_per_leaf": args.nodes_per_leaf,
        "gpu_memory": args.gpu_memory, "profile": args.profile, "missing_mesh": args.missing_mesh,
        "recompute": bool(args.recompute),
    }
    if isinstance(overlap, bool):
        block["overlap"] = {"allreduce": overlap}
    if job.explicit_bucket:
        block["grad_bucket_bytes"] = job.new_bucket
    AMSPSettings.from_dict(block)  # what we write must load
    return block


def _migrated_config(cfg: dict[str, Any], block: dict[str, Any]) -> tuple[dict[str, Any], list]:
    """The ds_config with the keys frameworks would act on removed, and the block; the removals."""
    from amsp_ext.integrations import ds_keys

    if "amsp" in cfg:
        _err("the config already has an 'amsp' block; it is replaced")
    stripped, rewrites = ds_keys.strip_unhonoured(cfg)
    out = {k: v for k, v in stripped.items() if k != "amsp"}
    out["amsp"] = block
    return out, rewrites


def _report(args, job: _Job, *, label: str, old, hpz: int | None, chosen, new_note: str,
            write_plan: str, rewrites: list) -> dict[str, Any]:
    """The report: the old layout beside the AMSP plan, and every key not mapped."""
    from amsp_ext.integrations import ds_keys

    cfg, batch = job.cfg, job.batch
    old_text = str(old.plan) + (f" + hpZ {hpz}" if old.key == "zero++" else "")
    unmapped = [{"key": k, "status": s, "note": n}
                for k, s, n in ds_keys.walk(cfg) if s != "mapped" and k != "amsp"]
    report = {
        "input": str(args.config),
        "model": {"name": job.spec.name, "num_params": job.spec.num_params},
        "cluster": {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                    "gpu_memory_bytes": job.cluster.gpu_memory_bytes,
                    "memory_limit_bytes": job.prob_new.memory_limit},
        "training": {"seq_len": args.seq_len, "seq_len_assumed": job.seq_len_assumed,
                     "micro_batch_size": batch.micro_batch_size,
                     "gradient_accumulation_steps": batch.gradient_accumulation_steps,
                     "train_batch_size": batch.train_batch_size, "precision": job.precision,
                     "gradient_clipping": cfg.get("gradient_clipping", 0.0),
                     "optimizer": job.amsp.engine.auto.optimizer},
        "profile": args.profile,
        "old": {"layout": label, **_column(old.candidate, old_text, old.note),
                "bucket_bytes": job.old_bucket},
        "new": {"layout": "AMSP", **_column(chosen, str(chosen.plan), new_note),
                "bucket_bytes": job.new_bucket, "written_plan": write_plan},
        "unmapped": unmapped,
        "rewritten": [{"key": k, "action": a} for k, a in rewrites],
    }
    a, b = report["old"]["t_comm_s"]["total"], report["new"]["t_comm_s"]["total"]
    report["comm_ratio"] = (a / b) if b > 0 else None
    return report


def _gib(b: float) -> str:
    if b < 2**30:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 2**30:.2f} GiB" if b < 10 * 2**30 else f"{b / 2**30:.1f} GiB"


def _secs(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def format_report(r: dict[str, Any], output: str) -> str:
    o, n, tr, cl = r["old"], r["new"], r["training"], r["cluster"]
    lines = [
        f"amsp migrate {r['input']} -> {output}",
        f"  model {r['model']['name']} ({r['model']['num_params'] / 1e6:.1f}M parameters); "
        f"{cl['nodes']} node(s) x {cl['gpus_per_node']} GPUs, {_gib(cl['gpu_memory_bytes'])} each "
        f"({_gib(cl['memory_limit_bytes'])} usable); profile {r['profile']}",
        f"  seq {tr['seq_len']}, micro-batch {tr['micro_batch_size']} x "
        f"{tr['gradient_accumulation_steps']} accumulation step(s) x {cl['nodes'] * cl['gpus_per_node']} "
        f"ranks = {tr['train_batch_size']} sequences, {tr['precision']}, {tr['optimizer']}, "
        f"clipping {tr['gradient_clipping'] or 'off'}",
        "",
    ]
    w = 32
    rows = [
        ("", f"DeepSpeed now: {o['layout']}", f"AMSP: {n['note']}"),
        ("factors", o["factors"], n["factors"]),
        ("gradient bucket", _gib(o["bucket_bytes"]), _gib(n["bucket_bytes"])),
        ("Tp  (AllGather/ReduceScatter)", _secs(o["t_comm_s"]["t_p"]), _secs(n["t_comm_s"]["t_p"])),
        ("Tg  (AllReduce, micro-batches)", _secs(o["t_comm_s"]["t_g"]), _secs(n["t_comm_s"]["t_g"])),
        ("T0_os (AllReduce, last)", _secs(o["t_comm_s"]["t0_os"]), _secs(n["t_comm_s"]["t0_os"])),
        ("T1_os (Broadcast)", _secs(o["t_comm_s"]["t1_os"]), _secs(n["t_comm_s"]["t1_os"])),
        ("Tcomm per step", _secs(o["t_comm_s"]["total"]), _secs(n["t_comm_s"]["total"])),
        ("model states / GPU", _gib(o["memory_bytes"]["model_states"]), _gib(n["memory_bytes"]["model_states"])),
        ("activations / GPU", _gib(o["memory_bytes"]["activations"]), _gib(n["memory_bytes"]["activations"])),
        ("buffers / GPU", _gib(o["memory_bytes"]["tmp"]), _gib(n["memory_bytes"]["tmp"])),
        ("total / GPU", _gib(o["memory_bytes"]["total"]), _gib(n["memory_bytes"]["total"])),
        ("fits", "yes" if o["fits"] else "NO", "yes" if n["fits"] else "NO"),
    ]
    c1 = max(len(x[1]) for x in rows) + 2
    for name, a, b in rows:
        lines.append(f"  {name:<{w}}{a:<{c1}}{b}")
    if r["comm_ratio"] is not None:
        ratio = r["comm_ratio"]
        lines.append(f"  predicted communication: {ratio:.2f}x less with AMSP" if ratio >= 1
                     else f"  predicted communication: {1 / ratio:.2f}x more with AMSP")
    if o["note"]:
        lines.append(f"  ({o['layout']}: {o['note']})")
    lines.append(f"  written: amsp.plan = {n['written_plan']!r}, amsp.enabled = true; DeepSpeed's other "
                 f"keys are kept (set \"enabled\": false to run DeepSpeed)")
    for row in r["rewritten"]:
        lines.append(f"  {row['key']}: {row['action']}")
    if r["unmapped"]:
        lines.append(f"  {len(r['unmapped'])} key(s) not mapped: see the warnings above")
    return "\n".join(lines)


def _upgrade_in_place(args: argparse.Namespace) -> bool:
    """Without --model/--model-config, a ds_config whose ``amsp`` block has the old shape gets
    that block rewritten in the current shape, every other key as it was (integrations/
    settings.py [Note: renamed keys]); written to --output, else over DS_CONFIG. False: not
    such a file."""
    from amsp_ext.integrations.settings import AMSPSettings, upgrade_block

    if args.model is not None or args.model_config is not None:
        return False
    path = Path(args.config)
    cfg = json.loads(path.read_text())
    block = cfg.get("amsp") if isinstance(cfg, dict) else None
    moved = upgrade_block(block)[1] if isinstance(block, dict) else []
    if not moved:
        raise ValueError("one of --model or --model-config is required (without one, only a "
                         "ds_config whose amsp block has the old shape is upgraded)")
    cfg["amsp"] = upgrade_block(block)[0]
    AMSPSettings.from_dict(cfg["amsp"])  # what we write must load
    out = Path(args.output) if args.output else path
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    if args.json:
        print(json.dumps({"output": str(out), "moved": [{"from": a, "to": b} for a, b in moved]}))
    else:
        print(f"amsp migrate {path} -> {out}: the amsp block upgraded: "
              + ", ".join(f"{a} -> {b}" for a, b in moved))
    return True


def run(args: argparse.Namespace) -> int:
    if _upgrade_in_place(args):
        return 0
    out, report = build(args)
    for row in report["unmapped"]:
        _err(f"{row['key']}: {_STATUS_WORDS[row['status']]} - {row['note']}")
    if report["training"]["seq_len_assumed"]:  # said once the inputs are known good
        _err(f"--seq-len not given: planned for {DEFAULT_SEQ_LEN} tokens per sequence (the default); "
             "give your job's, its activations decide what fits")
    path = Path(args.output) if args.output else Path(args.config).with_suffix(".amsp.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    report["output"] = str(path)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report, str(path)))
    return 0
