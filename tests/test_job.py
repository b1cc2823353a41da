"""amsp_ext/job.py: one job, resolved once ([Note: one job, resolved once]).

- what resolving needs (nothing, the cluster's profile, the memory) by hand for each request;
- every route builds the same Job from its own surface and resolves it to the same plan and
  all-reduce mode: ``amsp train``'s launcher and its ranks (shard()'s preflight), the AMSP row
  of ``amsp compare``, a ds_config block (the DeepSpeed / Accelerate / Trainer routes), the dry
  run; and the plan is the planner's own best (``plan_for``, an independent search);
- a launcher's ResolvedJob goes to the ranks as JSON and back, keeps its request (adaptive may
  replace only a plan asked as "auto"), and is refused for another job.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest

from amsp_ext import schema
from amsp_ext.common.models import llama_config_dict
from amsp_ext.engine_config import EngineConfig
from amsp_ext.job import Job, ResolvedJob, needs, resolve
from amsp_ext.planner.auto import AutoPlanConfig
from amsp_ext.planner.plan import PlanError

LAB = Path(__file__).resolve().parents[1] / "comparisons/results/tune_small-llama_cpu-2x2-lab_2026-12-01"
PROFILE = str(LAB / "profile-100mbit.calibrated.json")
MEMORY = 8 * 2**30
SHAPE = dict(seq_len=256, micro_batch_size=2, num_micro_batches=4)


def _job(plan="auto", *, all_reduce="flat", profile=PROFILE, memory=MEMORY, auto=True, adaptive=None):
    a = AutoPlanConfig(**SHAPE, profile=profile, missing="fit", gpu_memory_bytes=memory) if auto else None
    return Job(model=llama_config_dict("small-llama"), num_nodes=2, plan=plan,
               engine=EngineConfig(gpus_per_node=2, all_reduce=all_reduce, auto=a, adaptive=adaptive))


def test_what_resolving_needs_by_request():
    assert needs(_job("ddp")) == frozenset()  # explicit plan, flat: no planner
    assert needs(_job("mics:2", all_reduce="auto")) == frozenset()  # no two-level group to price
    assert needs(_job("ddp", all_reduce="auto")) == frozenset()  # priced, with all it needs
    assert needs(_job(profile="cluster", memory=None)) == {"profile", "memory"}
    assert needs(_job(" AUTO ", memory=None)) == {"memory"}  # any case, spaces allowed
    with pytest.raises(PlanError, match=r"plan 'auto' needs config.auto=AutoPlanConfig"):
        needs(_job(auto=False))
    with pytest.raises(PlanError, match=r"resolving needs the cluster's profile"):
        resolve(_job(profile="cluster"))
    with pytest.raises(PlanError, match=r"plan p=3x1,g=3x1,os=3x1 does not fit 2 node\(s\) x 2 GPU\(s\)"):
        resolve(_job("p=3x1,g=3x1,os=3x1"))


def test_auto_is_the_planners_best_plan():
    """The resolved plan is the planner's own search over the same problem (planner/search.py
    plan_for, which builds its problem without the job module)."""
    from amsp_ext.planner.search import plan_for
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

    got = resolve(_job())
    want = plan_for(llama_config_dict("small-llama"), ClusterSpec(num_nodes=2, gpus_per_node=2, gpu_memory_bytes=MEMORY),
                    TrainingSpec(**SHAPE), PROFILE, missing="fit")
    assert got.plan == want and got.all_reduce.mode == "flat"


def _train_route(argv):
    from amsp_ext.cli import train as cli_train
    from amsp_ext.train.config import TrainConfig, train_job

    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    config = schema.from_namespace(TrainConfig, p.parse_args(
        ["--model", "small-llama", "--seq-len", "256", "--micro-batch-size", "2", "--micro-batches", "4",
         "--gpu-memory", "8GiB", "--profile", PROFILE, *argv]))
    return config, train_job(config, num_nodes=2, gpus_per_node=2)


@pytest.mark.parametrize("plan,all_reduce", [("auto", "flat"), ("auto", "auto"), ("ddp", "auto")])
def test_every_route_resolves_the_same_job_to_the_same_choice(plan, all_reduce):
    from amsp_ext.cli import train as cli_train
    from amsp_ext.compare.config import RunSpec
    from amsp_ext.compare.harness import PlannerInputs, amsp_job
    from amsp_ext.integrations.ds_initialize import _shard_config
    from amsp_ext.integrations.settings import AMSPSettings, PrecisionSettings, resolve_batch
    from amsp_ext.runtime.preflight import job_of
    from amsp_ext.topology.groups import World
    from amsp_ext.tools.dryrun import DryRunSpec
    from amsp_ext.tools.dryrun import job_of as dryrun_job

    config, train_job = _train_route(["--plan", plan, "--all-reduce", all_reduce])
    launcher = cli_train._resolve_before_launch(config, gpus_per_node=2, num_nodes=2)
    hf = types.SimpleNamespace(config=types.SimpleNamespace(to_dict=lambda: llama_config_dict("small-llama")))
    world = World.with_leaves(num_nodes=2, gpus_per_node=2, nodes_per_leaf=None)
    ranks = resolve(job_of(hf, plan, train_job.engine, world))
    spec = RunSpec(model="small-llama", **SHAPE, precision="fp32", amsp_plan=plan, amsp_all_reduce=all_reduce)
    compare = resolve(amsp_job(spec, plan, num_nodes=2, gpus_per_node=2,
                               planner=PlannerInputs(profile=PROFILE, gpu_memory_bytes=MEMORY, missing="fit")))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "amsp": {"enabled": True, "plan": plan, "all_reduce": all_reduce, "seq_len": 256, "gpus_per_node": 2,
                    "gpu_memory": "8GiB", "profile": PROFILE, "missing_mesh": "fit"}}
    settings = AMSPSettings.from_dict(cfg["amsp"])
    ds_config = _shard_config(settings, cfg, PrecisionSettings.from_ds(cfg), resolve_batch(cfg, 4))
    ds = resolve(job_of(hf, settings.plan, ds_config, world))
    dry = resolve(dryrun_job(DryRunSpec(model="small-llama", num_nodes=2, gpus_per_node=2, gpu_memory_bytes=MEMORY,
                                        plan=plan, seq_len=256, micro_batch_size=2, num_micro_batches=4,
                                        engine=EngineConfig(all_reduce=all_reduce), profile=PROFILE,
                                        missing_mesh="fit")))
    choices = {route: (str(r.plan), r.all_reduce.mode) for route, r in
               (("train launcher", launcher), ("train ranks", ranks), ("compare", compare),
                ("ds_config", ds), ("dry run", dry))}
    assert len(set(choices.values())) == 1, choices


def test_the_launchers_decision_reaches_the_ranks_with_its_request():
    """The adaptive check reads the request: a plan the launcher resolved from "auto" may still
    be replaced (before, the ranks saw the factors and refused --no-adaptive-allow-replan)."""
    from amsp_ext.cli import train as cli_train
    from amsp_ext.planner.adaptive import check_replannable

    config, job = _train_route(["--plan", "auto", "--adaptive", "--no-adaptive-allow-replan"])
    launcher = cli_train._resolve_before_launch(config, gpus_per_node=2, num_nodes=2)
    doc = json.loads(json.dumps(launcher.to_dict()))
    back = ResolvedJob.from_dict(doc, job)
    assert back.plan == launcher.plan and back.all_reduce == launcher.all_reduce and back.job.plan == "auto"
    check_replannable(back.job.plan, back.engine.adaptive)  # passes: the request was "auto"
    with pytest.raises(ValueError, match="allow_replan"):
        check_replannable(str(back.plan), back.engine.adaptive)  # what the ranks used to check
    other = _train_route(["--plan", "ddp"])[1]
    with pytest.raises(PlanError, match=r"the launcher resolved plan 'auto', this rank's job asks for 'ddp'"):
        ResolvedJob.from_dict(doc, other)


def test_the_buckets_close_where_the_link_says():
    """planner/buckets.py [Note: where a bucket closes, from the link]: a resolved job carries
    where its buckets close, from its profile's all-reduce on the plan's replica group, to the
    engine's config and through JSON to the ranks; a given size wins; no profile, no size."""
    from amsp_ext.planner.buckets import link_close_bytes
    from amsp_ext.planner.profile import CommTimer, load_profile

    def on_ddp_replica(mode):  # the 2 x 2 replica group, the all-reduce run as ``mode`` runs it
        timer = CommTimer(load_profile(PROFILE), 2, "fit", all_reduce=mode)
        return link_close_bytes(lambda v: timer.time("allreduce", v, 2, 2), 25 * 2**20)

    assert (on_ddp_replica("flat"), on_ddp_replica("two_level")) == (64 * 2**10, 128 * 2**10)
    for job in (_job("ddp"), _job("ddp", all_reduce="auto"), _job()):  # unpriced, priced, auto
        got = resolve(job)
        if str(got.plan) == "p=1x1,g=1x1,os=1x1":
            assert got.bucket_close_bytes == on_ddp_replica(got.all_reduce.mode), got
        assert got.bucket_close_bytes is not None and got.engine.grad_bucket_close_bytes == got.bucket_close_bytes
        back = ResolvedJob.from_dict(json.loads(json.dumps(got.to_dict())), job)
        assert back.bucket_close_bytes == got.bucket_close_bytes
    given = Job(model=llama_config_dict("small-llama"), num_nodes=2, plan="ddp",
                engine=EngineConfig(gpus_per_node=2, grad_bucket_close_bytes=12345,
                                    auto=AutoPlanConfig(**SHAPE, profile=PROFILE, missing="fit")))
    assert resolve(given).engine.grad_bucket_close_bytes == 12345
    assert resolve(_job("ddp", auto=False)).engine.grad_bucket_close_bytes is None  # the default
    bad = {**resolve(_job("ddp")).to_dict(), "bucket_close_bytes": 0}
    with pytest.raises(PlanError, match="bucket_close_bytes must be an integer >= 1 or null, got 0"):
        ResolvedJob.from_dict(bad, _job("ddp"))
