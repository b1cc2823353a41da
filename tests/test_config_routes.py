"""One engine config for every route (amsp_ext/engine_config.py): the same settings given to
`amsp train`, a ds_config "amsp" block, the Accelerate route, `amsp compare` and `amsp plan`
resolve to the same EngineConfig (compared as JSON), and `--plan auto` plans with the engine's
reduce dtype on every route. Each engine setting is defined in one place."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

from amsp_ext import schema
from amsp_ext.engine_config import EngineConfig, engine_default, training_spec
from amsp_ext.planner.specs import STEP_SHAPE_FIELDS, StepShape, TrainingSpec

PKG = Path(__file__).resolve().parents[1] / "amsp_ext"
BATCH = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def _json(engine: EngineConfig) -> dict:
    d = schema.to_dict(engine)
    d.pop("auto"), d.pop("adaptive")  # the route's job shape, not an engine setting
    return d


def via_train(argv: list[str]) -> EngineConfig:
    from amsp_ext.cli import train as cli_train
    from amsp_ext.train.config import TrainConfig
    from amsp_ext.train.config import shard_config

    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    return shard_config(schema.from_namespace(TrainConfig, p.parse_args(argv)))


def _ds_engine(cfg: dict) -> EngineConfig:
    from amsp_ext.integrations.ds_initialize import _shard_config
    from amsp_ext.integrations.settings import AMSPSettings, PrecisionSettings, resolve_batch

    settings = AMSPSettings.from_dict(cfg["amsp"])
    return _shard_config(settings, cfg, PrecisionSettings.from_ds(cfg), resolve_batch(cfg, 4))


def via_ds_config(block: dict, ds: dict | None = None) -> EngineConfig:
    return _ds_engine({**BATCH, **(ds or {}), "amsp": {"enabled": True, "plan": "ddp", **block}})


def via_accelerate(block: dict, ds: dict | None = None) -> EngineConfig:
    from amsp_ext.integrations.accelerate import amsp_deepspeed_config

    cfg = amsp_deepspeed_config(amsp={"enabled": True, "plan": "ddp", **block},
                                deepspeed_config={**BATCH, **(ds or {})})
    return _ds_engine(cfg)


def via_plan(argv: list[str]) -> EngineConfig:
    from amsp_ext.cli import plan as cli_plan

    p = argparse.ArgumentParser()
    cli_plan.add_arguments(p)
    args = p.parse_args(["--model", "tiny-llama", "--nodes", "2", "--gpus-per-node", "2",
                         "--gpu-memory", "1GiB", "--seq-len", "64", "--micro-batches", "1", *argv])
    return schema.from_namespace(EngineConfig, args)


def via_compare(**spec) -> EngineConfig:
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.systems.amsp import engine_config

    return engine_config(RunSpec(**spec))


def test_defaults_agree_on_every_route(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = _json(EngineConfig())
    routes = {"train": via_train([]), "ds_config": via_ds_config({}),
              "accelerate": via_accelerate({}),
              # amsp plan's required --gpus-per-node (R = 2 here) is the engine's field
              "plan": dataclasses.replace(via_plan([]), gpus_per_node=None),
              "compare": via_compare(precision="fp32")}
    got = {name: _json(e) for name, e in routes.items()}
    assert got == {name: want for name in routes}, json.dumps(got, indent=1)
    # the defaults a DeepSpeed / FSDP user expects (README, engine_config [Note: one default])
    assert (want["timeout"], want["grad_bucket_bytes"], want["granularity"], want["reduce_dtype"]) == \
        (600.0, 25 * 2**20, "layer", "fp32")
    # the planner's spec of a job, not told otherwise, is the job the engine runs by default
    tr = TrainingSpec(seq_len=8, num_micro_batches=1)
    assert (tr.precision, tr.reduce_dtype, tr.bucket_bytes, tr.granularity, tr.recompute, tr.all_reduce) == \
        (want["precision"], want["reduce_dtype"], want["grad_bucket_bytes"], want["granularity"],
         want["recompute"], want["all_reduce"])
    from amsp_ext.integrations.settings import PrecisionSettings

    ds = PrecisionSettings()  # a ds_config without bf16/fp16 blocks
    assert (ds.precision, ds.reduce_dtype) == (want["precision"], want["reduce_dtype"])
    import inspect

    # the planner's own TrainingSpec without reduce_dtype plans the engine's gradients
    assert inspect.signature(TrainingSpec).parameters["reduce_dtype"].default == want["reduce_dtype"]


def test_the_same_settings_agree_on_every_route(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = EngineConfig(precision="bf16", reduce_dtype="bf16", grad_bucket_bytes=4 * 2**20,
                        granularity="module", recompute=True, nodes_per_leaf=1, timeout=30.0,
                        all_reduce="two_level")
    block = {"grad_bucket_bytes": "4MiB", "granularity": "module", "recompute": True,
             "nodes_per_leaf": 1, "timeout": 30, "all_reduce": "two_level"}
    ds = {"bf16": {"enabled": True}, "communication_data_type": "bf16"}
    flags = ["--precision", "bf16", "--reduce-dtype", "bf16", "--grad-bucket-bytes", "4MiB",
             "--granularity", "module", "--recompute", "--nodes-per-leaf", "1",
             "--all-reduce", "two_level"]
    routes = {"train": via_train([*flags, "--timeout", "30"]), "ds_config": via_ds_config(block, ds),
              "accelerate": via_accelerate(block, ds)}
    for name, engine in routes.items():
        assert _json(engine) == _json(want), name
    # amsp plan has the planner's part of it; amsp compare holds precision, reduce dtype and unit
    # fixed per row
    assert training_spec(via_plan(flags), StepShape()) == training_spec(want, StepShape())
    compare = via_compare(precision="bf16", reduce_dtype="bf16", amsp_granularity="module",
                          amsp_all_reduce="two_level")
    assert (compare.precision, compare.reduce_dtype, compare.granularity, compare.all_reduce) == \
        ("bf16", "bf16", "module", "two_level")


def test_ds_bucket_falls_back_to_reduce_bucket_size_then_the_engine_default():
    zero = {"zero_optimization": {"reduce_bucket_size": 1000}}
    assert via_ds_config({}, zero).grad_bucket_bytes == 4000  # elements x fp32 bytes
    assert via_ds_config({"grad_bucket_bytes": 512}, zero).grad_bucket_bytes == 512
    assert via_ds_config({}).grad_bucket_bytes == engine_default("grad_bucket_bytes")


def test_plan_auto_on_the_launcher_plans_with_the_engine_reduce_dtype(monkeypatch):
    """`amsp train --plan auto --precision bf16` once planned with 2-byte gradients (the launcher
    passed no reduce_dtype) while the ranks reduce and hold fp32 gradients."""
    from amsp_ext.cli import train as cli_train
    from amsp_ext.planner import auto
    from amsp_ext.train.config import TrainConfig

    seen = {}

    def fake_resolve_auto(model, config, training, cluster, *, plan=None, **kw):
        seen.update(vars(training))
        return auto.Planned(plan="ddp", all_reduce=auto.AllReduceChoice(mode="flat"))

    monkeypatch.setattr(auto, "resolve_auto", fake_resolve_auto)
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    config = schema.from_namespace(TrainConfig, p.parse_args(
        ["--plan", "auto", "--profile", "paper-a800", "--precision", "bf16", "--gpu-memory", "1GiB"]))
    resolved = cli_train._resolve_before_launch(config, gpus_per_node=2, num_nodes=2)
    assert (str(resolved.plan), resolved.all_reduce.mode) == ("ddp", "flat")
    assert seen["reduce_dtype"] == "fp32" and seen["precision"] == "bf16"
    e = config.engine
    assert (seen["bucket_bytes"], seen["granularity"], seen["recompute"]) == \
        (e.grad_bucket_bytes, e.granularity, e.recompute)


def test_compare_plans_auto_with_the_rows_engine(monkeypatch):
    from amsp_ext.compare import harness
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.planner import auto

    seen = {}

    def fake_resolve_auto(model, config, training, cluster, *, plan=None, **kw):
        seen.update(vars(training))
        return auto.Planned(plan="ddp", all_reduce=auto.AllReduceChoice(mode="flat"))

    monkeypatch.setattr(auto, "resolve_auto", fake_resolve_auto)
    spec = RunSpec(precision="bf16")
    planner = harness.PlannerInputs(profile="paper-a800")
    harness._resolve_planned(spec, spec.amsp_plan, num_nodes=2, gpus_per_node=2, planner=planner)
    # what the AMSP rows run with, by the comparison's rule: the --reduce-dtype every row sends
    # (default fp32, the engine's default; compare/config.py [Note: one wire dtype for every
    # system]), the engine's unit and bucket
    assert (seen["precision"], seen["reduce_dtype"], seen["granularity"], seen["bucket_bytes"]) == \
        ("bf16", "fp32", "layer", 25 * 2**20)


def _defined_defaults() -> dict[str, list[str]]:
    """Where a class field named like an EngineConfig field gets a default in amsp_ext (None, i.e.
    "not given", does not count)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"auto", "adaptive", "overlap", "fp16"}
    found: dict[str, list[str]] = {n: [] for n in names}
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                            and item.target.id in names and item.value is not None
                            and not (isinstance(item.value, ast.Constant) and item.value.value is None)):
                        found[item.target.id].append(f"{path.relative_to(PKG)}:{node.name}")
    return found


def test_each_engine_setting_is_defined_once():
    """The class fields named like an engine setting: only EngineConfig's (the planner's own
    specs name theirs differently, e.g. TrainingSpec.bucket_bytes, and get them through
    training_spec)."""
    allowed_elsewhere = {
        # the planner's input spec (torch- and schema-free; training_spec fills it)
        ("precision", "planner/specs.py:TrainingSpec"), ("granularity", "planner/specs.py:TrainingSpec"),
        ("recompute", "planner/specs.py:TrainingSpec"), ("reduce_dtype", "planner/specs.py:TrainingSpec"),
        ("all_reduce", "planner/specs.py:TrainingSpec"),
        # the timer prices an all-reduce the way the engine runs it (training_spec fills it)
        ("all_reduce", "planner/profile.py:CommTimer"),
        ("nodes_per_leaf", "planner/specs.py:ClusterSpec"), ("gpus_per_node", "planner/specs.py:ClusterSpec"),
        # the comparison's settings shared by every system (not only the AMSP rows)
        ("precision", "compare/config.py:RunSpec"), ("gpus_per_node", "compare/config.py:RunSpec"),
        # the wire dtype every system of the comparison reduces in; its default is read from
        # the engine's (engine_default), not restated
        ("reduce_dtype", "compare/config.py:RunSpec"),
        # the planner's TP degree of the job it prices (torch-free; the engine's T reaches it as a
        # keyword) and `amsp simulate`'s TP rows (a degree or "auto", not a running job's T)
        ("tensor_parallel", "planner/search.py:Problem"), ("tensor_parallel", "planner/simulate.py:SimSettings"),
        ("tensor_parallel", "cli/simulate.py:SimulateOptions"),
        # `amsp simulate`'s grid and the lab's shape: their own job, not an engine setting
        ("precision", "planner/simulate.py:SimSettings"), ("gpus_per_node", "planner/simulate.py:SimSettings"),
        ("nodes_per_leaf", "cluster/lab.py:LabSpec"),
        # the simulated world's shape of `amsp dryrun` (its engine settings are an EngineConfig)
        ("gpus_per_node", "tools/dryrun.py:DryRunSpec"),
        # the target cluster `amsp plan` / `amsp dryrun` plan for and `amsp simulate`'s grid
        # (a required shape; the engine's R is the launched world's), as _CLUSTER_R says
        ("gpus_per_node", "cli/planner_flags.py:World"), ("gpus_per_node", "cli/simulate.py:SimulateOptions"),
        # `amsp profile`: the profiled world's leaf size, and its collective timeout, which reads
        # the engine's default (engine_config.DEFAULT_TIMEOUT_S)
        ("nodes_per_leaf", "cli/profile.py:ProfileFlags"), ("timeout", "cli/profile.py:ProfileFlags"),
        # DeepSpeed's precision blocks, translated to the engine's fields
        ("precision", "integrations/settings.py:PrecisionSettings"),
        ("reduce_dtype", "integrations/settings.py:PrecisionSettings"),
        # the world's shape the plan's groups are laid out on (plan_world fills it from the config)
        ("tensor_parallel", "topology/groups.py:World"),
    }
    extra = {n: [w for w in where if w != "engine_config.py:EngineConfig" and (n, w) not in allowed_elsewhere]
             for n, where in _defined_defaults().items()}
    assert not {n: w for n, w in extra.items() if w}, extra


# the step's shape (planner/specs.py [Note: a step's shape, declared once]) and an older name of
# its M; a field of that name with a default anywhere but StepShape is a second declaration
_SHAPE_NAMES = (*STEP_SHAPE_FIELDS, "micro_batches")


def _shape_declarations(sources: dict[str, str]) -> list[str]:
    """``where:Class.field`` of every class field named like the step's shape that has a
    default other than None (None: "not given here", a surface asking for it by name)."""
    found = []
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                found += [f"{where}:{node.name}.{item.target.id}" for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                          and item.target.id in _SHAPE_NAMES and item.value is not None
                          and not (isinstance(item.value, ast.Constant) and item.value.value is None)]
    return found


def test_the_step_shape_is_declared_once():
    """seq_len, micro_batch_size and M: one declaration (StepShape), one default each, read by
    every surface (train, compare, plan, dryrun, simulate, config, migrate, the ds_config, the
    planner's specs). A planted second declaration is found."""
    sources = {str(p.relative_to(PKG)): p.read_text() for p in sorted(PKG.rglob("*.py"))}
    assert _shape_declarations(sources) == [f"planner/specs.py:StepShape.{n}" for n in STEP_SHAPE_FIELDS]
    planted = "class Flags:\n    seq_len: int = option(2048, minimum=1)\n    micro_batches: int | None = None\n"
    assert _shape_declarations({"cli/x.py": planted}) == ["cli/x.py:Flags.seq_len"]
    # and each surface's default is that one: no flag, key or field gives another
    # (`amsp compare` fills its shape from its named presets, --quick and the full table;
    # `amsp simulate` and `amsp migrate` from the paper's job and the ds_config when not given;
    # `amsp config` asks for --seq-len with --plan auto, it writes it into the ds_config)
    from amsp_ext.cli.main import build_parser

    shape = StepShape()
    for command in ("train", "plan", "dryrun", "config deepspeed"):
        sub = build_parser()
        for word in command.split():
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
        # (`amsp config`'s --micro-batch-size is the ds_config's key, 'auto' unless given)
        names = ("seq_len",) if command.startswith("config") else STEP_SHAPE_FIELDS
        defaults = {a.dest: a.default for a in sub._actions if a.dest in names}
        want = {n: None if command.startswith("config") else getattr(shape, n) for n in names}
        assert defaults == want, (command, defaults)


# [which configs each `amsp` command builds] A hand-written flag of a command that has the
# same name as a field's generated flag of a config the command builds would be a second
# definition of that setting (its default and help could drift): the command generates it
# (schema.add_arguments) instead. The exceptions are flags with the same name that are not that
# field, each with why.
CLI_CONFIGS = {
    "train.py": ("TrainConfig",), "tune.py": ("TuneConfig",), "compare.py": ("RunSpec",),
    "plan.py": ("EngineConfig",), "dryrun.py": ("EngineConfig",),
    "migrate.py": ("EngineConfig",), "config.py": ("EngineConfig",),  # they write amsp blocks
}
_CLUSTER_R = ("the target cluster's GPUs per node the planner plans for (a required shape, default "
              "8), not the engine's logical R of the launched world (default: the world)")
# (`amsp plan` and `amsp dryrun` generate their --gpus-per-node from cli/planner_flags.py World,
# the same target cluster)
NOT_THE_FIELD = {
    ("migrate.py", "--gpus-per-node"): _CLUSTER_R,
    ("migrate.py", "--precision"): "which of the ds_config's bf16/fp16 blocks an 'auto' means; "
                                   "the engine's precision comes from DeepSpeed's keys",
    ("config.py", "--precision"): "DeepSpeed's bf16/fp16 blocks of the written ds_config ('auto' "
                                  "included); the engine's precision comes from those keys",
}


def _config_classes() -> dict[str, type]:
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.train.config import TrainConfig
    from amsp_ext.tune.spec import TuneConfig

    return {"TrainConfig": TrainConfig, "EngineConfig": EngineConfig, "TuneConfig": TuneConfig,
            "RunSpec": RunSpec}


def _hand_written_flags(path: Path) -> list[str]:
    """The ``--flags`` of every ``add_argument(...)`` call in ``path`` (not schema's)."""
    flags = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            flags += [a.value for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
    return flags


def test_no_hand_written_flag_duplicates_a_config_field():
    classes = _config_classes()
    generated = {name: {schema.flag_of(f): f"{owner.__name__}.{f.name}" for owner, f in schema.options(cls)}
                 for name, cls in classes.items()}
    assert {"--seq-len", "--micro-batches", "--trace", "--amsp-plan"} <= set(generated["RunSpec"])
    dup = []
    for module, names in CLI_CONFIGS.items():
        for flag in _hand_written_flags(PKG / "cli" / module):
            for name in names:
                if flag in generated[name] and (module, flag) not in NOT_THE_FIELD:
                    dup.append(f"cli/{module} {flag} (= {generated[name][flag]})")
    assert not dup, f"hand-written flags that duplicate a config field; generate them: {dup}"
    stale = [k for k in NOT_THE_FIELD if k[1] not in _hand_written_flags(PKG / "cli" / k[0])]
    assert not stale, f"exceptions for flags that are gone: {stale}"


def test_the_duplicate_check_sees_a_hand_written_copy(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def add_arguments(p):\n    p.add_argument('--seq-len', type=int)\n"
                   "    schema.add_arguments(p, RunSpec)\n")
    assert _hand_written_flags(src) == ["--seq-len"]
    flags = {schema.flag_of(f) for _, f in schema.options(_config_classes()["RunSpec"])}
    assert "--seq-len" in flags
