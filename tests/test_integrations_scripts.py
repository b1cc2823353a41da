"""Unmodified third-party-style scripts on every route, 2 gloo ranks, no environment variable:
the ds_config's ``amsp.enabled`` alone decides, configs come from ``amsp config`` (absolute
paths; every launch runs from a scratch directory, not the repository).

- Accelerate: tests/scripts/run_clm_no_trainer.py (transformers' run_clm_no_trainer style: its
  own checkpointing, eval and ``unwrap_model(model).save_pretrained``), launched with
  ``accelerate launch --config_file <amsp config accelerate>``;
- HF Trainer: tests/scripts/run_clm.py (run_clm style: ``trainer.save_model``, eval metrics,
  ``resume_from_checkpoint``) under torchrun with ``--deepspeed <amsp config deepspeed>``;
- DeepSpeed: tests/scripts/ds_train.py (``deepspeed.initialize(args=..., training_data=...)``,
  epochs over DeepSpeed's loader, ``save_checkpoint`` / ``load_checkpoint``, ``save_16bit_model``).

Each route runs twice: under ``p=2x1,g=2x1,os=2x1`` (parameters sharded) from scratch, with a
checkpoint at step 3; then a resume from that checkpoint (the Accelerate and Trainer resumes
under plan ``auto``, so across plans). Checked per route: the plan line, the loss falls, the
saved model reloads (``from_pretrained`` / ``load_state_dict``) and reproduces the script's eval
loss in this process (an independent single-process reference), and the resume continues the
same losses. Then ``"enabled": false`` on each route runs DeepSpeed itself, and Accelerate
forced into its CPU mode stops with one line.

[Note: tolerances]
fp32 throughout. A saved model's eval loss against the script's: 1e-5 relative (one process vs
two ranks gathering per-block losses; observed ~1e-7). Resumed losses: the DeepSpeed route under
the same plan is exact; across plans (p=2x1 -> the planner's plan) 1e-5 relative, the order in
which gradients are summed (observed ~1e-7).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from clm_assets import reference_eval_loss
from dist_utils import REPO, run_script, script_env

# Slow tier (conftest.py [Note: test tiers]): the default tier reaches the same routes through
# test_integrations_frameworks.py (Accelerate, HF Trainer) and test_integrations_deepspeed.py.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = REPO / "tests" / "scripts"
SHARDED = "p=2x1,g=2x1,os=2x1"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("scripts")


@pytest.fixture(scope="module")
def env(root):
    return script_env(root / "site")


@pytest.fixture(scope="module")
def assets(root):
    import clm_assets

    return clm_assets.build(root / "assets")


def amsp_config(*argv) -> None:
    from amsp_ext.cli.main import main

    assert main(["config", *map(str, argv)]) == 0


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def plan_lines(proc) -> list[str]:
    return [l for l in (proc.stdout + proc.stderr).splitlines() if l.startswith("[amsp] plan ")]


# -- Accelerate: run_clm_no_trainer style ---------------------------------------------------------

def _clm_no_trainer(env, root, assets, yaml, out, *extra):
    return run_script([*ACCELERATE, "--config_file", str(yaml), str(SCRIPTS / "run_clm_no_trainer.py"),
                       "--config_name", assets["config"], "--tokenizer_name", assets["tokenizer"],
                       "--train_file", assets["train"], "--validation_file", assets["valid"],
                       "--output_dir", str(out), "--max_train_steps", "6", *extra], env, root)


def _clm_no_trainer_log(proc) -> tuple[dict[int, float], float]:
    text = proc.stdout + proc.stderr
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+): loss (\S+)", text)}
    return losses, float(re.findall(r"eval_loss: (\S+)", text)[-1])


@pytest.fixture(scope="module")
def accelerate_runs(env, root, assets):
    amsp_config("accelerate", "--num-processes", "2", "--plan", SHARDED, "-o", root / "acc" / "sharded.yaml")
    amsp_config("accelerate", "--num-processes", "2", "--seq-len", "32", "-o", root / "acc" / "auto.yaml")
    a = _clm_no_trainer(env, root, assets, root / "acc" / "sharded.yaml", root / "acc" / "A",
                        "--checkpointing_steps", "3")
    b = _clm_no_trainer(env, root, assets, root / "acc" / "auto.yaml", root / "acc" / "B",
                        "--resume_from_checkpoint", str(root / "acc" / "A" / "step_3"))
    return a, b


def test_accelerate_script_on_a_sharded_plan_saves_a_loadable_model(accelerate_runs, root, assets):
    proc, _ = accelerate_runs
    lines = plan_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(f"[amsp] plan {SHARDED} on 1 node(s) x 2 rank(s) on CPU"), lines
    assert "GPU" not in lines[0]
    losses, eval_loss = _clm_no_trainer_log(proc)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1], losses
    out = root / "acc" / "A"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert rel(reference_eval_loss(str(out), assets["valid"], assets["tokenizer"]), eval_loss) <= 1e-5
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == pytest.approx(eval_loss, rel=1e-6)
    # Accelerate's save_state wrote the engine's checkpoint in DeepSpeed's layout
    assert (out / "step_3" / "latest").read_text() == "pytorch_model"
    assert (out / "step_3" / "pytorch_model" / "amsp.json").is_file()


def test_accelerate_script_resumes_under_the_planners_plan(accelerate_runs, root, assets):
    a, b = accelerate_runs
    lines = plan_lines(b)
    assert len(lines) == 1 and "(planner)" in lines[0], lines
    first, eval_a = _clm_no_trainer_log(a)
    resumed, eval_b = _clm_no_trainer_log(b)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert rel(resumed[step], first[step]) <= 1e-5, (step, resumed, first)
    assert rel(eval_b, eval_a) <= 1e-5
    assert rel(reference_eval_loss(str(root / "acc" / "B"), assets["valid"], assets["tokenizer"]), eval_b) <= 1e-5


# -- HF Trainer: run_clm style --------------------------------------------------------------------

def _run_clm(env, root, assets, ds_config, out, *extra):
    return run_script([*TORCHRUN, str(SCRIPTS / "run_clm.py"),
                       "--config_name", assets["config"], "--tokenizer_name", assets["tokenizer"],
                       "--train_file", assets["train"], "--validation_file", assets["valid"],
                       "--do_train", "--do_eval", "--output_dir", str(out), "--deepspeed", str(ds_config),
                       "--max_steps", "6", "--logging_steps", "1", "--per_device_train_batch_size", "1",
                       "--per_device_eval_batch_size", "1", "--gradient_accumulation_steps", "2",
                       "--learning_rate", "3e-3", "--warmup_steps", "1", "--weight_decay", "0.1",
                       "--report_to", "none", "--seed", "0", "--disable_tqdm", "true", *extra], env, root)


def _trainer_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.fixture(scope="module")
def trainer_runs(env, root, assets):
    amsp_config("deepspeed", "--plan", SHARDED, "-o", root / "hf" / "sharded.json")
    amsp_config("deepspeed", "--seq-len", "32", "-o", root / "hf" / "auto.json")
    a = _run_clm(env, root, assets, root / "hf" / "sharded.json", root / "hf" / "A", "--save_steps", "3")
    b = _run_clm(env, root, assets, root / "hf" / "auto.json", root / "hf" / "B", "--save_steps", "3",
                 "--resume_from_checkpoint", str(root / "hf" / "A" / "checkpoint-3"))
    return a, b


def test_trainer_script_on_a_sharded_plan_saves_a_loadable_model(trainer_runs, root, assets):
    proc, _ = trainer_runs
    lines = plan_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(f"[amsp] plan {SHARDED} on 1 node(s) x 2 rank(s) on CPU"), lines
    out = root / "hf" / "A"
    losses = _trainer_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1], losses
    eval_loss = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert rel(reference_eval_loss(str(out), assets["valid"], assets["tokenizer"]), eval_loss) <= 1e-5
    ckpt = out / "checkpoint-3"  # the engine's checkpoint in DeepSpeed's layout, and the weights
    assert (ckpt / "latest").read_text() == "global_step3" and (ckpt / "global_step3" / "amsp.json").is_file()
    assert (ckpt / "model.safetensors").is_file()


def test_trainer_script_resumes_under_the_planners_plan(trainer_runs, root, assets):
    _, proc = trainer_runs
    lines = plan_lines(proc)
    assert len(lines) == 1 and "(planner)" in lines[0], lines
    first, resumed = _trainer_losses(root / "hf" / "A"), _trainer_losses(root / "hf" / "B")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # steps 1-3 come from the checkpoint's history
    for step in (4, 5, 6):
        assert rel(resumed[step], first[step]) <= 1e-5, (step, resumed, first)
    out = root / "hf" / "B"
    eval_loss = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert rel(reference_eval_loss(str(out), assets["valid"], assets["tokenizer"]), eval_loss) <= 1e-5


# -- DeepSpeed: a DeepSpeedExamples-style script ---------------------------------------------------

def _ds_config(root: Path, name: str, *argv) -> Path:
    path = root / "ds" / name
    amsp_config("deepspeed", "--micro-batch-size", "1", "--grad-accum", "2", "--precision", "fp32",
                "--gradient-clipping", "1.0", *argv, "-o", path)
    cfg = json.loads(path.read_text())  # a plain DeepSpeed script has no optimizer of its own
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}}
    path.write_text(json.dumps(cfg))
    return path


def _ds_train(env, root, assets, cfg, *extra):
    return run_script([*TORCHRUN, str(SCRIPTS / "ds_train.py"), "--deepspeed", "--deepspeed_config", str(cfg),
                       "--config_name", assets["config"], "--tokenizer_name", assets["tokenizer"],
                       "--train_file", assets["train"], *extra], env, root)


def _tagged(proc, tag: str) -> list[dict]:
    return [json.loads(l[len(tag) + 1:]) for l in proc.stdout.splitlines() if l.startswith(tag + " ")]


@pytest.fixture(scope="module")
def deepspeed_runs(env, root, assets):
    cfg = _ds_config(root, "sharded.json", "--plan", SHARDED)
    ck = root / "ds" / "ckpt"
    a = _ds_train(env, root, assets, cfg, "--save_dir", ck, "--save_at", "3", "--output_dir", root / "ds" / "A")
    b = _ds_train(env, root, assets, cfg, "--load_dir", ck, "--output_dir", root / "ds" / "B")
    return a, b


def test_deepspeed_script_runs_amsp_with_its_own_loader(deepspeed_runs):
    """deepspeed.initialize(training_data=) under AMSP: a new shuffle every epoch (set_epoch),
    each epoch every sample once across the ranks, the loss falls."""
    proc, _ = deepspeed_runs
    lines = plan_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(f"[amsp] plan {SHARDED} on 1 node(s) x 2 rank(s) on CPU"), lines
    assert {e["engine"] for e in _tagged(proc, "ENGINE")} == {"AMSPDeepSpeedEngine"}
    steps = _tagged(proc, "STEP")
    assert [s["step"] for s in steps] == list(range(1, 9)) and steps[-1]["loss"] < steps[0]["loss"]
    order = {}
    for e in (0, 1):
        per_rank = [sum((s["samples"][r] for s in steps if s["epoch"] == e), []) for r in (0, 1)]
        assert sorted(per_rank[0] + per_rank[1]) == list(range(16)), per_rank
        order[e] = per_rank
    assert order[0] != order[1]  # set_epoch: another shuffle in epoch 1


def test_deepspeed_script_resumes_its_position_and_saves_16bit(deepspeed_runs, root):
    """The checkpoint at step 3 (mid epoch 0) restores the loader's position: the resumed run
    reads the same samples and gets the same losses, bit for bit (same plan), to the same final
    weights; save_16bit_model's file loads strictly into the model class."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    a, b = deepspeed_runs
    first, resumed = _tagged(a, "STEP"), _tagged(b, "STEP")
    assert resumed == first[3:]
    wa = torch.load(root / "ds" / "A" / "pytorch_model.bin")
    wb = torch.load(root / "ds" / "B" / "pytorch_model.bin")
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "ds" / "A"))
    model.load_state_dict(wa, strict=True)


# -- "enabled": false runs DeepSpeed on every route; the CPU-mode stop ----------------------------

def _disabled(path: Path, out: Path) -> Path:
    cfg = json.loads(path.read_text())
    cfg["amsp"]["enabled"] = False  # plan "auto" stays: Accelerate must not try to fill it
    out.write_text(json.dumps(cfg))
    return out


def test_enabled_false_runs_deepspeed_on_every_route(env, root, assets):
    amsp_config("accelerate", "--num-processes", "2", "--seq-len", "32", "-o", root / "off" / "acc.yaml")
    _disabled(root / "off" / "acc.ds_config.json", root / "off" / "acc.ds_config.json")
    acc = run_script([*ACCELERATE, "--config_file", str(root / "off" / "acc.yaml"),
                      str(SCRIPTS / "accelerate_train.py"), "--steps", "2"], env, root)
    setup = _tagged(acc, "SETUP")[0]
    assert setup == {"distributed_type": "DistributedType.DEEPSPEED", "num_processes": 2,
                     "model_class": "DeepSpeedEngine"}, setup

    amsp_config("deepspeed", "--seq-len", "32", "-o", root / "off" / "hf.json")
    hf_cfg = _disabled(root / "off" / "hf.json", root / "off" / "hf.json")
    hf = run_script([*TORCHRUN, str(SCRIPTS / "hf_trainer_train.py"), "--deepspeed", str(hf_cfg),
                     "--output-dir", str(root / "off" / "hf"), "--steps", "2", "--save-steps", "0"], env, root)
    assert {d["engine"] for d in _tagged(hf, "DATA")} == {"DeepSpeedEngine"}
    assert {s["world_size"] for s in _tagged(hf, "SETUP")} == {2}

    ds_cfg = _disabled(_ds_config(root, "auto.json", "--seq-len", "32"), root / "off" / "ds.json")
    ds = _ds_train(env, root, assets, ds_cfg, "--epochs", "1")
    assert {e["engine"] for e in _tagged(ds, "ENGINE")} == {"DeepSpeedEngine"}
    assert len(_tagged(ds, "STEP")) == 4
    for proc in (acc, hf, ds):
        assert not plan_lines(proc)


def test_accelerate_forced_to_cpu_mode_stops_with_one_line(env, root):
    amsp_config("accelerate", "--num-processes", "2", "--plan", SHARDED, "-o", root / "cpu" / "amsp.yaml")
    proc = run_script([*ACCELERATE, "--config_file", str(root / "cpu" / "amsp.yaml"),
                       str(SCRIPTS / "accelerate_train.py")], {**env, "ACCELERATE_USE_CPU": "true"},
                      root, check=False, timeout=120)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if "[amsp] error:" in l]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=true puts Accelerate in CPU mode" in errors[0]
    assert "SETUP" not in proc.stdout  # no worker ran
