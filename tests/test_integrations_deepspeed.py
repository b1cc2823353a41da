"""The DeepSpeed route on 4 gloo ranks posing as 2 nodes x 2: a DeepSpeed-style script calling
``deepspeed.initialize`` with ``amsp.enabled`` trains like the same script on torch DDP (fp32),
``amsp migrate`` outputs for ZeRO-1, ZeRO-3, hpZ and MiCS configs train, and a checkpoint saved
in DeepSpeed's layout resumes bit-for-bit. One torchrun launch (tests/integrations_worker.py).

[Note: tolerances]
fp32 against DDP: losses and gradient norms within 1e-5 relative (observed <= 3e-7: the two
reduce gradients in different orders). bf16 against fp32 DDP: losses within 2e-3 relative over
3 steps (observed ~1e-4), i.e. the bf16 recipe, not a lost or doubled micro-batch (that shifts
the second step's loss by ~1e-2). Resuming under the same plan: exactly equal; under another
plan: 1e-5 (gradient summation order).
"""

from __future__ import annotations

import json

import pytest

from dist_utils import REPO, run_ranks
from test_adaptive_loop import SLOW_LINK, check_adaptive_switch

pytestmark = pytest.mark.distributed

LAB = ["--model", "tiny-llama", "--nodes", "2", "--gpus-per-node", "2", "--memory-reserve", "0GiB",
       "--seq-len", "32", "--profile", str(REPO / "configs" / "clusters" / "lab-2x2.profile.json")]
# two configs take the planner's choice (at a roomy and a tight memory budget), two a forced
# plan (--plan), so that parameter sharding runs whatever the planner's models say
MIGRATIONS = {"zero1": ["--gpu-memory", "1GiB"], "zero3": ["--gpu-memory", "3MiB"],
              "zeropp_hpz": ["--gpu-memory", "1GiB", "--plan", "p=2x2,g=2x2,os=2x2"],
              "mics": ["--gpu-memory", "1GiB", "--plan", "p=2x1,g=2x2,os=2x2"]}




@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from amsp_ext.cli.main import main

    out = tmp_path_factory.mktemp("migrated")
    paths = []
    for name, extra in MIGRATIONS.items():
        path = out / f"{name}.amsp.json"
        assert main(["migrate", str(REPO / "configs" / "deepspeed" / "before_migration" / f"{name}.json"),
                     *LAB, *extra, "-o", str(path), "--json"]) == 0
        paths.append(str(path))
    suites = "ds,migrated,checkpoint,adaptive"
    scratch = tmp_path_factory.mktemp("worker-tmp")  # the worker's mkdtemp folders land here
    proc = run_ranks(4, "tests.integrations_worker", suites, *paths, timeout=600,
                     env={"TMPDIR": str(scratch), **SLOW_LINK},  # SLOW_LINK: the adaptive case
                     preload="torch,amsp,deepspeed")
    assert not list(scratch.glob("amsp-*")), list(scratch.iterdir())  # the worker cleaned up
    res = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            res[r["case"]] = r
    return res


def test_routed_deepspeed_initialize_trains_like_ddp(results):
    r = results["routed:p=2x1,g=2x1,os=2x2"]
    assert r["engine"] == "AMSPDeepSpeedEngine" and r["optimizer"] == "AMSPOptimizer"
    assert r["plan"] == "p=2x1,g=2x1,os=2x2"
    assert r["num_losses"] == 10  # 5 steps x 2 micro-batches, per rank
    assert r["loss_max_rel_diff"] <= 1e-5 and r["norm_max_rel_diff"] <= 1e-5, r
    # DeepSpeed's counters: a step per boundary, micro_steps per step() call
    assert (r["global_steps"], r["micro_steps"], r["global_samples"]) == (5, 10, 40)
    assert r["batch"] == [8, 1, 2] and r["applied"] == [True] * 5 and r["overflow"] is False


def test_consolidated_state_dict_is_the_trained_model(results):
    r = results["state_dict"]
    assert r["max_abs_diff_vs_ddp"] <= 1e-5 and r["num_keys"] == 21
    assert r["z3_keys_per_rank"] == [21, 0, 0, 0]  # DeepSpeed's: rank 0 only
    # engine.module (parameters sharded: p=2x1) saves like the user's model, every way
    assert set(r["saves"]) == {"module.state_dict", "engine.state_dict", "save_pretrained",
                               "save_pretrained+state_dict", "save_16bit_model"}
    assert all(v == 0.0 for v in r["saves"].values()), r["saves"]


def test_scheduler_block_and_adam_name(results):
    r = results["scheduler:WarmupDecayLR"]
    assert r["scheduler"] == "WarmupDecayLR"
    assert r["lr_max_abs_diff"] == 0.0 and len(set(r["lrs"])) > 1  # the schedule moved
    assert r["loss_max_rel_diff"] <= 1e-5 and r["norm_max_rel_diff"] <= 1e-5, r


def test_boundary_api_and_client_optimizer(results):
    r = results["boundary-api+client-optimizer"]
    assert r["same_optimizer_object"] and r["client_lr"] == 1e-3
    assert r["loss_max_rel_diff"] <= 1e-5 and r["norm_max_rel_diff"] <= 1e-5, r


def test_bf16_block(results):
    r = results["bf16"]
    assert r["param_dtype"] == "torch.bfloat16" and r["bf16_enabled"]
    assert r["master_dtype"] in ("torch.float32", None)
    assert r["loss_max_rel_diff"] <= 2e-3, r


def test_fp16_overflow_is_skipped_the_deepspeed_way(results):
    r = results["fp16-overflow"]
    assert r["param_dtype"] == "torch.float16"
    t = r["trace"]
    assert [x["overflow"] for x in t] == [False, True, False]
    assert [x["applied"] for x in t] == [True, False, True]
    assert [x["scale"] for x in t] == [1024.0, 512.0, 512.0]  # initial_scale_power 10, backoff 0.5
    assert [x["global_steps"] for x in t] == [1, 2, 3] and t[-1]["skipped"] == 1
    assert t[1]["lr"] == t[0]["lr"] < t[2]["lr"]  # WarmupLR does not step on the skipped step


def test_training_data_becomes_a_sharded_loader(results):
    r = results["dataloader"]
    assert r["per_rank"] == [4, 4, 4, 4] and r["disjoint_cover"] and r["batch_size"] == 1


@pytest.mark.parametrize("name", list(MIGRATIONS))
def test_migrated_configs_train(results, name):
    r = results[f"migrated:{name}.amsp.json"]
    assert r["plan"] == r["written_plan"]
    assert r["loss_max_rel_diff"] <= 1e-5 and r["norm_max_rel_diff"] <= 1e-5, r


def test_migrated_configs_cover_several_plans(results):
    plans = {results[f"migrated:{n}.amsp.json"]["plan"] for n in MIGRATIONS}
    assert len(plans) >= 3, plans


@pytest.mark.parametrize("plan,tol", [("p=2x1,g=2x1,os=2x2", 0.0), ("p=1x1,g=2x2,os=2x2", 1e-5)])
def test_checkpoint_save_load_continue(results, plan, tol):
    r = results[f"resume:{plan}"]
    assert r["tag"] == "global_step3" and r["latest"] == "global_step3"
    assert r["client_state"] == {"epoch": 7} and r["global_steps"] == 5
    assert r["loss_max_rel_diff"] <= tol and r["norm_max_rel_diff"] <= tol, r
    assert r["lr_max_abs_diff"] == 0.0  # the WarmupLR state came back


def test_checkpoint_with_a_flipped_byte_is_refused(results):
    r = results["damaged"]
    assert len(r["errors"]) == 4 and len(set(r["errors"])) == 1, r  # the same line on every rank
    err = r["errors"][0]
    assert err.startswith("CheckpointError: ") and "file shard-00002-model-00001-of-00001.safetensors is damaged" in err and "\n" not in err, r
    assert r["listing"] == ["global_step3", "latest"]  # published whole: no staging directory left


def test_ds_config_adaptive_switches_by_itself_and_trains_like_ddp(results):
    # a DeepSpeed script with ds_config amsp.adaptive (integrations_worker.suite_adaptive): the
    # checks of the own-loop case, tests/test_adaptive_loop.py
    check_adaptive_switch(results["adaptive"])
