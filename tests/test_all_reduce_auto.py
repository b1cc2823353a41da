"""all_reduce="auto" (planner/auto.py [Note: all_reduce "auto"]): the mode each route runs is the
one the lab measured faster, decided before any rank starts (or, in the engine, before its first
collective), and refused in one line when the planner lacks what it needs."""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest

from amsp_ext import schema
from amsp_ext.planner.auto import AutoPlanConfig, auto_problem, choose_all_reduce, resolve_auto
from amsp_ext.planner.plan import PlanError, resolve_plan
from amsp_ext.planner.search import evaluate, make_problem
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
from amsp_ext.common.models import llama_config_dict

REPO = Path(__file__).resolve().parents[1]
LAB = REPO / "comparisons/results/tune_small-llama_cpu-2x2-lab_2026-12-01"
# amsp compare's job on the 2x2 lab (small-llama, seq 256, micro-batch 2, M = 4, fp32, layer
# units, 25 MiB buckets): the job the paired runs of two_level_allreduce_lab_2026-12-03.md timed
ENGINE = dict(precision="fp32", reduce_dtype="fp32", bucket_bytes=25 * 2**20, granularity="layer",
              recompute=False)


def _inputs(auto: AutoPlanConfig, nodes: int = 2, gpn: int = 2, **kw) -> tuple[TrainingSpec, ClusterSpec]:
    """The planner's typed inputs of the job: its step under the engine's settings, its world."""
    return (TrainingSpec(**vars(auto.shape()), **ENGINE, **kw),
            ClusterSpec(num_nodes=nodes, gpus_per_node=gpn, gpu_memory_bytes=8 * 2**30))


def _auto(link: str, **kw) -> AutoPlanConfig:
    return AutoPlanConfig(seq_len=256, micro_batch_size=2, num_micro_batches=4, missing="fit",
                          profile=str(LAB / f"profile-{link}.calibrated.json"), **kw)


def _plan(text: str):
    return resolve_plan(text, gpus_per_node=2, num_nodes=2)


@pytest.mark.parametrize("objective", ["comm", "step"])
def test_auto_runs_the_mode_the_lab_measured_faster(objective):
    """DDP's plan on the lab: two-level ran 0.915x the flat all-reduce's throughput at 1 Gbit
    (paired run D) and 1.11-1.17x at 100 Mbit (runs A, B, C, E); "auto" must pick accordingly,
    whichever objective chose the factors."""
    model = llama_config_dict("small-llama")
    got = {link: resolve_auto(model, a, *_inputs(a), plan=_plan("ddp"), all_reduce="auto").all_reduce
           for link in ("1gbit", "100mbit") for a in [_auto(link, objective=objective)]}
    assert got["1gbit"].mode == "flat" and got["100mbit"].mode == "two_level"
    assert got["1gbit"].step_s["two_level"] > got["1gbit"].step_s["flat"]
    assert "step model" in got["100mbit"].describe()


def test_eq1_alone_would_pick_the_mode_the_lab_measured_slower():
    """Why "auto" decides with the step model: Eq. 1 prices bytes only, and at 1 Gbit it has
    two-level cheaper, the opposite of the measurement."""
    model = llama_config_dict("small-llama")
    a = _auto("1gbit")
    comm = {m: evaluate(auto_problem(model, a, *_inputs(a, all_reduce=m)), _plan("ddp")).comm.total
            for m in ("flat", "two_level")}
    assert comm["two_level"] < comm["flat"]


def test_auto_plan_searches_the_factors_under_each_mode():
    model = llama_config_dict("small-llama")
    a = _auto("100mbit")
    planned = resolve_auto(model, a, *_inputs(a), all_reduce="auto")
    # Eq. 1 picks MiCS's factors under flat and os=2x1 under two-level; the step model prices
    # the second pair lower
    assert planned.all_reduce.plans == {"flat": "p=2x1,g=2x1,os=2x1", "two_level": "p=1x1,g=1x1,os=2x1"}
    assert (str(planned.plan), planned.all_reduce.mode) == ("p=1x1,g=1x1,os=2x1", "two_level")
    flat = resolve_auto(model, a, *_inputs(a), all_reduce="flat")
    assert (str(flat.plan), flat.all_reduce.mode, dict(flat.all_reduce.step_s)) == \
        ("p=2x1,g=2x1,os=2x1", "flat", {})


@pytest.mark.parametrize("plan, shape", [("mics:2", (2, 2)), ("ddp", (1, 4)), ("ddp", (4, 1))])
def test_no_group_with_several_ranks_on_several_nodes_runs_flat_unpriced(plan, shape):
    """MiCS's replica group has one rank per node; one node, or one rank per node, has no
    two-level group at all. Nothing is priced, so a profile that lacks the meshes is no error."""
    nodes, gpn = shape
    auto = AutoPlanConfig(seq_len=256, micro_batch_size=2, num_micro_batches=4, missing="error",
                          profile=str(LAB / "profile-1gbit.calibrated.json"))
    planned = resolve_auto(llama_config_dict("small-llama"), auto, *_inputs(auto, nodes, gpn),
                           plan=resolve_plan(plan, gpus_per_node=gpn, num_nodes=nodes), all_reduce="auto")
    assert planned.all_reduce.mode == "flat" and not planned.all_reduce.step_s
    assert "several ranks on each of several nodes" in planned.all_reduce.why


def test_two_level_must_win_by_more_than_the_tie_tolerance():
    model = llama_config_dict("small-llama")
    cluster = ClusterSpec(num_nodes=2, gpus_per_node=2, gpu_memory_bytes=8 * 2**30)

    def problems(tolerance):
        return {m: make_problem(model, cluster,
                                TrainingSpec(seq_len=256, micro_batch_size=2, num_micro_batches=4,
                                             precision="fp32", granularity="layer",
                                             bucket_bytes=25 * 2**20, all_reduce=m),
                                LAB / "profile-100mbit.calibrated.json", missing="fit",
                                tie_tolerance=tolerance)
                for m in ("flat", "two_level")}

    plans = dict.fromkeys(("flat", "two_level"), _plan("ddp"))
    close = choose_all_reduce(problems(0.01), plans)
    gain = 1 - close.step_s["two_level"] / close.step_s["flat"]  # 8 % by the model
    assert close.mode == "two_level" and 0.01 < gain < 0.5
    assert choose_all_reduce(problems(0.5), plans).mode == "flat"


class _HFModel:
    def __init__(self):
        self.config = types.SimpleNamespace(to_dict=lambda: llama_config_dict("small-llama"))


def test_engine_decides_the_mode_before_its_first_collective():
    """shard()'s job resolves before its first collective (runtime/preflight.py); it needs no
    process group when the job gives the profile and the memory."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.job import needs, resolve
    from amsp_ext.runtime.preflight import job_of
    from amsp_ext.topology.groups import World

    world = World.with_leaves(num_nodes=2, gpus_per_node=2, nodes_per_leaf=None)
    auto = _auto("100mbit", gpu_memory_bytes=8 * 2**30)
    config = EngineConfig(gpus_per_node=2, all_reduce="auto", auto=auto)

    def decided(plan, config):
        job = job_of(_HFModel(), plan, config, world)
        assert needs(job) == frozenset()
        r = resolve(job)
        return str(r.plan), r.engine.all_reduce

    assert decided("ddp", config) == ("p=1x1,g=1x1,os=1x1", "two_level")
    assert decided("auto", config) == ("p=1x1,g=1x1,os=2x1", "two_level")
    # MiCS's groups: flat, without the planner (no config.auto needed)
    assert decided("mics:2", EngineConfig(gpus_per_node=2, all_reduce="auto"))[1] == "flat"
    with pytest.raises(PlanError, match=r"config.all_reduce='auto' needs config.auto=AutoPlanConfig"):
        decided("ddp", EngineConfig(gpus_per_node=2, all_reduce="auto"))


def test_amsp_train_decides_on_the_launcher():
    from amsp_ext.cli import train as cli_train
    from amsp_ext.train.config import TrainConfig

    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)

    def decide(*flags):
        config = schema.from_namespace(TrainConfig, p.parse_args(
            ["--model", "small-llama", "--seq-len", "256", "--micro-batch-size", "2",
             "--micro-batches", "4", "--gpu-memory", "8GiB", *flags]))
        resolved = cli_train._resolve_before_launch(config, gpus_per_node=2, num_nodes=2)
        return str(resolved.job.plan), resolved.all_reduce.mode

    lab = str(LAB / "profile-{}.calibrated.json")
    assert decide("--plan", "ddp", "--all-reduce", "auto", "--profile", lab.format("100mbit")) == \
        ("ddp", "two_level")
    assert decide("--plan", "ddp", "--all-reduce", "auto", "--profile", lab.format("1gbit")) == \
        ("ddp", "flat")
    assert decide("--plan", "ddp", "--all-reduce", "two_level", "--profile", lab.format("1gbit")) == \
        ("ddp", "two_level")  # asked for: run as given


def test_compare_decides_each_amsp_row_on_the_launcher():
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.harness import PlannerInputs, _resolve_planned

    spec = RunSpec(model="small-llama", seq_len=256, micro_batch_size=2, num_micro_batches=4,
                   precision="fp32", amsp_plan="ddp", amsp_all_reduce="auto")
    planner = PlannerInputs(profile=str(LAB / "profile-100mbit.calibrated.json"), missing="fit")
    row, why, source = _resolve_planned(spec, "ddp", num_nodes=2, gpus_per_node=2, planner=planner)
    assert why is None and (row.amsp_plan, row.amsp_all_reduce) == ("ddp", "two_level")
    assert source.startswith("given: ddp; all-reduce two_level (auto; step model: flat ")
    mics, why, source = _resolve_planned(spec, "mics:2", num_nodes=2, gpus_per_node=2, planner=planner)
    assert why is None and mics.amsp_all_reduce == "flat" and "several nodes" in source


def test_amsp_plan_cli_reports_the_mode(capsys):
    from amsp_ext.cli.main import main

    args = ["plan", "--model", "small-llama", "--nodes", "2", "--gpus-per-node", "2",
            "--gpu-memory", "8GiB", "--profile", str(LAB / "profile-1gbit.calibrated.json"),
            "--missing-mesh", "fit", "--seq-len", "256", "--micro-batch-size", "2",
            "--micro-batches", "4", "--all-reduce", "auto"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all_reduce"]["mode"] == "flat" and set(report["all_reduce"]["step_s"]) == {"flat", "two_level"}
    assert main(args) == 0
    assert "all-reduce flat (auto; step model: flat " in capsys.readouterr().out


def test_ds_block_needs_seq_len_for_auto():
    from amsp_ext.integrations.settings import AMSPSettings, ConfigError

    with pytest.raises(ConfigError, match=r"amsp.seq_len is required when amsp.all_reduce is 'auto'"):
        AMSPSettings.from_dict({"enabled": True, "plan": "ddp", "all_reduce": "auto"})


@pytest.mark.distributed
@pytest.mark.slow  # conftest.py [Note: test tiers]; the default tier has the launcher's decision
# (test_amsp_train_decides_on_the_launcher) and a rank running a decided mode (the dry run below)
def test_amsp_train_runs_the_decided_mode_end_to_end():
    """4 ranks as 2 nodes x 2: the 100 Mbit profile makes DDP's plan two-level; the ranks run
    it (the summary reports the engine's mode) and the first loss is a single process's. The
    buckets close at 1 MiB (one bucket for tiny-llama): closed where this profile's link says
    (a bucket per unit, planner/buckets.py) the step model prices flat 0.193 s against
    two-level 0.191 s, a tie that runs flat, and this test is about the two-level path."""
    from test_train_cli import amsp, reference_first_loss

    proc = amsp("train", "--steps", "2", "--seq-len", "32", "--micro-batches", "2", "--micro-batch-size", "2",
                "--plan", "ddp", "--all-reduce", "auto", "--profile", str(LAB / "profile-100mbit.calibrated.json"),
                "--grad-bucket-close-bytes", "1MiB", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["plan_str"], out["all_reduce"]) == ("p=1x1,g=1x1,os=1x1", "two_level")
    assert out["loss"][0] == pytest.approx(reference_first_loss(num_sequences=16, seq_len=32), rel=1e-5)


@pytest.mark.distributed
def test_dry_run_decides_on_the_launcher_and_the_rank_runs_it():
    """`amsp dryrun` hands its rank processes a decided mode: two-level's in-node levels issue
    collectives under the 100 Mbit profile, the flat group under the 1 Gbit one."""
    from amsp_ext.engine_config import EngineConfig
    from amsp_ext.tools.dryrun import DryRunSpec, dry_run_many

    specs = [DryRunSpec(model="tiny-llama", num_nodes=2, gpus_per_node=2, plan="ddp", seq_len=32,
                        steps=1, ranks=(0,), profile=str(LAB / f"profile-{link}.calibrated.json"),
                        missing_mesh="fit", engine=EngineConfig(all_reduce="auto"))
             for link in ("100mbit", "1gbit")]
    groups = [{c["group"] for c in r["ranks"][0]["collectives"] if c["kind"] != "broadcast"}
              for r in dry_run_many(specs)]
    assert "param_replica_local" in groups[0] and "param_replica_node" in groups[0]
    assert "param_replica" in groups[1] and not any(g.startswith("param_replica_") for g in groups[1])
