"""Malformed input, one table across the entry points: the `amsp` subcommands (in-process, as the
console script runs them; `amsp train` refuses before it starts any rank), the config dataclasses, the ds_config (`amsp` block and DeepSpeed's
keys), `amsp_ext.shard` and checkpoints. Every case must fail with ONE line that names what is
wrong (the field, the file, or the allowed values), and the CLI with exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dist_utils import REPO

ZERO1 = json.loads((REPO / "configs/deepspeed/before_migration/zero1.json").read_text())
PLAN = ["plan", "--model", "llama-7b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
        "--seq-len", "2048", "--global-batch-size", "64"]
MIGRATE = ["--model", "tiny-llama", "--gpus-per-node", "2"]
TRAIN = ["train", "--steps", "2"]


def _files(tmp: Path) -> dict[str, Path]:
    """The malformed files the cases refer to as {name}."""
    profile = (REPO / "configs/clusters/lab-2x2.profile.json").read_text()
    out = {"truncated_profile": profile[: len(profile) // 3], "list_json": "[1, 2]", "not_json": "{'a': 1",
           "binary": "\x00\x01\x02"}
    for name, patch in {
        "ds_ok": {},
        "ds_neg_bucket": {"zero_optimization": {"stage": 1, "reduce_bucket_size": -5}},
        "ds_str_bucket": {"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}},
        "ds_stage7": {"zero_optimization": {"stage": 7}},
        "ds_zero_list": {"zero_optimization": [1]},
        "ds_mbs0": {"train_micro_batch_size_per_gpu": 0},
        "ds_gas_auto": {"gradient_accumulation_steps": "auto"},
        "ds_lr_fast": {"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}},
        "ds_lr_nan": {"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}},
        "ds_lr_negative": {"optimizer": {"type": "AdamW", "params": {"lr": -1.0}}},
        "ds_betas_short": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9]}}},
        "ds_opt_unknown_param": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "speed": 3}}},
        "ds_opt_unknown_type": {"optimizer": {"type": "Turbo", "params": {}}},
        "ds_opt_cuda_only": {"optimizer": {"type": "OneBitAdam", "params": {}}},
        "ds_bf16_yes": {"bf16": {"enabled": "yes"}},
        "ds_bf16_and_fp16": {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
        "ds_fp16_power": {"fp16": {"enabled": True, "initial_scale_power": 99}},
        "ds_tbs_mismatch": {"train_batch_size": 7},
        "ds_mics_str": {"zero_optimization": {"stage": 3, "mics_shard_size": "x"}},
    }.items():
        out[name] = json.dumps({**ZERO1, **patch}, allow_nan=True)
    for name, patch in {"ds_stage_true": {"zero_optimization": {"stage": True}},
                        "ds_bucket_1e30": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1e30}},
                        "ds_clip_negative": {"gradient_clipping": -1},
                        "ds_lr_minus_one": {"optimizer": {"type": "AdamW", "params": {"lr": -1}}}}.items():
        out[name] = json.dumps({**ZERO1, **patch})
    from amsp_ext.common.models import llama_config_dict

    tiny = llama_config_dict("tiny-llama")
    for name, patch in {"hf_heads_indivisible": {"hidden_size": 100, "num_attention_heads": 3},
                        "hf_heads_0": {"num_attention_heads": 0},
                        "hf_layers_negative": {"num_hidden_layers": -3},
                        "hf_short_positions": {"max_position_embeddings": 16}}.items():
        out[name] = json.dumps({**tiny, **patch})
    out["a_file"] = "not a folder"
    paths = {}
    for name, text in out.items():
        paths[name] = tmp / f"{name}.json"
        paths[name].write_text(text)
    (tmp / "ckpt_nometa").mkdir()
    (tmp / "ckpt_nometa" / ".metadata").write_bytes(b"x")
    for name, meta in {"ckpt_badjson": "{\"format\": ", "ckpt_list": "[]",
                       "ckpt_format": json.dumps({"format": "other/9"}),
                       "ckpt_checksum": json.dumps({"format": "amsp-checkpoint/3", "files": {}, "checksum": "0" * 64})}.items():
        (tmp / name).mkdir()
        (tmp / name / ".metadata").write_bytes(b"x")
        (tmp / name / "amsp.json").write_text(meta)
        paths[name] = tmp / name
    paths["ckpt_nometa"] = tmp / "ckpt_nometa"
    paths["no_dir"] = tmp / "no" / "such" / "dir"
    return paths


# (case id, entry point, input, what the one line must contain)
CLI = [
    ("plan:nodes-0", PLAN + ["--nodes", "0"], "nodes"),
    ("plan:gpus-negative", PLAN + ["--gpus-per-node", "-1"], "gpus"),
    ("plan:nodes-not-int", PLAN + ["--nodes", "abc"], "argument --nodes: invalid int value: 'abc'"),
    ("plan:memory-no-unit", PLAN + ["--gpu-memory", "80"], "--gpu-memory needs a number and a unit"),
    ("plan:memory-below-reserve", PLAN + ["--gpu-memory", "1MiB"], "memory reserve must be >= 0 and below the GPU memory"),
    ("plan:reserve-negative", PLAN + ["--memory-reserve", "-1GiB"], "--memory-reserve"),
    ("plan:seq-len-0", PLAN + ["--seq-len", "0"], "--seq-len must be an integer >= 1"),
    ("plan:micro-batch-0", PLAN + ["--micro-batch-size", "0"], "--micro-batch-size must be an integer >= 1"),
    ("plan:batch-indivisible", PLAN[:-1] + ["3"], "global"),
    ("plan:unknown-model", ["plan", "--model", "llama-1b"] + PLAN[3:], "llama-7b"),
    ("plan:nodes-1e9", PLAN + ["--nodes", "1000000000"], "global_batch_size=64 must be a multiple"),
    ("plan:mics-3", PLAN + ["--mics-size", "3"], "group size 3 must divide gpus_per_node=8"),
    ("plan:hf-heads-indivisible", ["plan", "--model-config", "{hf_heads_indivisible}"] + PLAN[3:],
     "config.json hidden_size=100 must be a multiple of num_attention_heads=3"),
    ("plan:hf-heads-0", ["plan", "--model-config", "{hf_heads_0}"] + PLAN[3:],
     "config.json num_attention_heads must be an integer >= 1, got 0"),
    ("plan:hf-layers-negative", ["plan", "--model-config", "{hf_layers_negative}"] + PLAN[3:],
     "config.json num_hidden_layers must be an integer >= 1, got -3"),
    ("plan:hf-short-positions", ["plan", "--model-config", "{hf_short_positions}"] + PLAN[3:],
     "--seq-len must be <= 16"),
    ("train:seed-2^70", TRAIN + ["--seed", str(2**70)], "--seed must be a number < "),
    ("train:profile-missing", TRAIN + ["--profile", "{no_dir}.json"], "cannot read"),
    ("train:micro-batch-1e9", TRAIN + ["--micro-batch-size", "1000000000"], "does not fit: the planner's memory model needs"),
    ("train:save-dir-a-file", TRAIN + ["--save-dir", "{a_file}"], "--save-dir"),
    ("train:save-dir-proc", TRAIN + ["--save-dir", "/proc/amsp-no-such"], "--save-dir /proc/amsp-no-such: cannot write there"),
    ("migrate:stage-true", ["migrate", "{ds_stage_true}"] + MIGRATE, "zero_optimization.stage must be 0, 1, 2 or 3, got True"),
    ("migrate:bucket-1e30", ["migrate", "{ds_bucket_1e30}"] + MIGRATE, "zero_optimization.reduce_bucket_size must be a number of elements in"),
    ("migrate:clip-negative", ["migrate", "{ds_clip_negative}"] + MIGRATE, "gradient_clipping must be a finite number >= 0"),
    ("migrate:lr-negative", ["migrate", "{ds_lr_minus_one}"] + MIGRATE, "optimizer.params.lr must be > 0, got -1"),
    ("simulate:models-empty-name", ["simulate", "--models", "llama-7b,,"], "--models must be comma-separated names"),
    ("tune:plans-empty", ["tune", "--plans", ";"], "--plans ';' names no plan"),
    ("tune:out-a-file", ["tune", "--out", "{a_file}"], "is a file"),
    ("tune:calibrate-out-no-folder", ["tune", "--calibrate-out", "{no_dir}/cal.json"], "does not exist"),
    ("tune:all-reduce-auto", ["tune", "--all-reduce", "auto"], "--all-reduce must be flat or two_level for amsp tune"),
    ("plan:unknown-profile", PLAN + ["--profile", "nosuch-profile"], "nosuch-profile"),
    ("plan:truncated-profile", PLAN + ["--profile", "{truncated_profile}"], "not valid JSON"),
    ("plan:profile-not-object", PLAN + ["--profile", "{list_json}"], "list_json.json"),
    ("plan:profile-binary", PLAN + ["--profile", "{binary}"], "binary.json"),
    ("plan:peak-nan", PLAN + ["--peak-tflops", "nan"], "--peak-tflops must be a positive number, got nan"),
    ("plan:peak-negative", PLAN + ["--peak-tflops", "-5"], "--peak-tflops must be a positive number, got -5.0"),
    ("plan:efficiency-2", PLAN + ["--efficiency", "2"], "efficiency must be in (0, 1]"),
    ("plan:bucket-0", PLAN + ["--grad-bucket-bytes", "0B"], "--grad-bucket-bytes"),
    ("plan:precision-fp8", PLAN + ["--precision", "fp8"], "invalid choice: 'fp8' (choose from"),
    ("plan:model-config-missing", ["plan", "--model-config", "{no_dir}"] + PLAN[3:], "no/such/dir"),
    ("plan:model-config-not-object", ["plan", "--model-config", "{list_json}"] + PLAN[3:], "list_json.json"),
    ("plan:nothing-fits", ["plan", "--model", "llama-65b", "--nodes", "1", "--gpus-per-node", "2",
                           "--gpu-memory", "8GiB", "--seq-len", "2048", "--global-batch-size", "8"], "fit"),
    ("migrate:not-an-object", ["migrate", "{list_json}"] + MIGRATE, "must be a JSON object"),
    ("migrate:not-json", ["migrate", "{not_json}"] + MIGRATE, "not valid JSON"),
    ("migrate:missing-file", ["migrate", "{no_dir}"] + MIGRATE, "no such file"),
    ("migrate:output-dir-missing", ["migrate", "{ds_ok}"] + MIGRATE + ["-o", "{no_dir}/x.json"],
     "-o/--output: directory"),
    ("migrate:negative-bucket", ["migrate", "{ds_neg_bucket}"] + MIGRATE,
     "zero_optimization.reduce_bucket_size must be a number of elements in 1..1e+12 or 'auto', got -5"),
    ("migrate:string-bucket", ["migrate", "{ds_str_bucket}"] + MIGRATE, "reduce_bucket_size"),
    ("migrate:stage-7", ["migrate", "{ds_stage7}"] + MIGRATE, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ("migrate:zero-not-object", ["migrate", "{ds_zero_list}"] + MIGRATE, "zero_optimization must be an object"),
    ("migrate:micro-batch-0", ["migrate", "{ds_mbs0}"] + MIGRATE, "train_micro_batch_size_per_gpu must be an integer >= 1"),
    ("migrate:gas-auto", ["migrate", "{ds_gas_auto}"] + MIGRATE, "--micro-batches"),
    ("migrate:lr-fast", ["migrate", "{ds_lr_fast}"] + MIGRATE, "optimizer.params.lr must be a finite number, got 'fast'"),
    ("migrate:lr-nan", ["migrate", "{ds_lr_nan}"] + MIGRATE, "optimizer.params.lr must be a finite number, got nan"),
    ("migrate:bf16-yes", ["migrate", "{ds_bf16_yes}"] + MIGRATE, "bf16.enabled must be true or false"),
    ("migrate:bf16-and-fp16", ["migrate", "{ds_bf16_and_fp16}"] + MIGRATE, "both true"),
    ("migrate:fp16-scale-power", ["migrate", "{ds_fp16_power}"] + MIGRATE, "fp16.initial_scale_power"),
    ("migrate:batch-mismatch", ["migrate", "{ds_tbs_mismatch}"] + MIGRATE, "train_batch_size=7"),
    ("migrate:mics-not-int", ["migrate", "{ds_mics_str}"] + MIGRATE, "zero_optimization.mics_shard_size must be an integer"),
    ("migrate:plan-garbage", ["migrate", "{ds_ok}"] + MIGRATE + ["--plan", "p=3"], "plan"),
    ("migrate:plan-too-big", ["migrate", "{ds_ok}"] + MIGRATE + ["--plan", "p=16x1,g=16x1,os=16x1"], "R=2"),
    ("migrate:memory-float", ["migrate", "{ds_ok}"] + MIGRATE + ["--gpu-memory", "1e-9"], "--gpu-memory"),
    ("migrate:nodes-0", ["migrate", "{ds_ok}"] + MIGRATE + ["--nodes", "0"], "--nodes must be an integer >= 1"),
    ("migrate:truncated-profile", ["migrate", "{ds_ok}"] + MIGRATE + ["--profile", "{truncated_profile}"],
     "not valid JSON"),
    ("migrate:no-model", ["migrate", "{ds_ok}", "--gpus-per-node", "2"], "--model"),
    ("amsp:unknown-command", ["trian"], "invalid choice: 'trian'"),
    # found by comparisons/hostile_inputs.py: refused before the first system runs
    ("compare:systems-empty", ["compare", "--systems", ""], "--systems '' names no system"),
    ("compare:plan-garbage", ["compare", "--amsp-plan", "p=2"], "--amsp-plan: cannot read 'p=2'"),
    ("compare:plan-unknown-name", ["compare", "--amsp-plan", "zero9"], "--amsp-plan must be 'auto', a baseline name"),
    ("compare:profile-unknown", ["compare", "--profile", "nosuch"], "got 'nosuch'"),
    ("compare:timeout-nan", ["compare", "--timeout", "nan"], "--timeout must be a number > 0, got nan"),
    ("compare:ddp-buckets-3", ["compare", "--ddp-buckets", "1,3"],
     "--ddp-buckets must be comma-separated bucket_cap_mb sizes from 1, 5, 25, got '1,3'"),
    ("compare:out-a-file", ["compare", "--out", "{a_file}"], "is a file, not a folder"),
    ("dryrun:out-a-file", ["dryrun", "--model", "tiny-llama", "--nodes", "1", "--gpus-per-node", "2", "--seq-len",
                           "32", "--out", "{a_file}"], "is a file, not a folder"),
    ("checkpoint:convert-untrusted", ["checkpoint", "convert", "{ckpt_format}", "{no_dir}"], "--trust"),
    ("train:adaptive-band-empty", TRAIN + ["--adaptive", "--adaptive-band-low", "1.2"],
     "--adaptive-band-low and --adaptive-band-high must satisfy low < 1 < high"),
    ("train:adaptive-band-below-1", TRAIN + ["--adaptive", "--adaptive-band-high", "0.9"],
     "--adaptive-band-low and --adaptive-band-high must satisfy low < 1 < high"),
    ("train:adaptive-window-0", TRAIN + ["--adaptive", "--adaptive-window", "0"],
     "--adaptive-window must be an integer >= 1, got 0"),
    ("train:adaptive-no-replan-explicit-plan", TRAIN + ["--adaptive", "--no-adaptive-allow-replan",
                                                        "--plan", "zero1"],
     "--adaptive with --no-adaptive-allow-replan on --plan zero1 leaves adaptive nothing it may change"),
    ("train:bucket-1e-9", TRAIN + ["--grad-bucket-bytes", "1e-9"], "--grad-bucket-bytes needs a number and a unit"),
    ("train:bucket-1e308", TRAIN + ["--grad-bucket-bytes", "100000000000GiB"], "--grad-bucket-bytes must be at most 8 EiB"),
    ("train:timeout-1e308", TRAIN + ["--timeout", "1e308"], "--timeout must be a number > 0 and < 3.1536e+07"),
    ("train:timeout-negative", TRAIN + ["--timeout", "-5"], "--timeout"),
    ("train:lr-nan", TRAIN + ["--lr", "nan"], "--lr"),
    ("train:clip-nan", TRAIN + ["--clip", "nan"], "--clip"),
    ("train:max-bad-steps-negative", TRAIN + ["--max-bad-steps", "-1"], "--max-bad-steps"),
    ("train:steps-0", TRAIN + ["--steps", "0"], "--steps"),
    ("train:keep-0", TRAIN + ["--save-dir", "{no_dir}", "--keep", "0"], "--keep"),
    ("train:save-every-no-dir", TRAIN + ["--save-every", "2"], "--save-every needs --save-dir"),
    ("train:resume-auto-no-dir", TRAIN + ["--resume", "auto"], "--resume auto needs --save-dir"),
    ("train:restarts-no-save-every", TRAIN + ["--max-restarts", "1", "--save-dir", "{no_dir}"],
     "--max-restarts needs --save-dir and --save-every"),
    ("train:resume-missing", TRAIN + ["--resume", "{no_dir}"], "does not exist"),
    ("train:resume-damaged", TRAIN + ["--resume", "{ckpt_checksum}"], "file amsp.json is damaged (checksum mismatch)"),
    ("train:resume-not-a-checkpoint", TRAIN + ["--resume", "{ckpt_nometa}"], "is not a complete amsp checkpoint"),
    ("train:plan-too-big", TRAIN + ["--plan", "p=4x1,g=4x1,os=4x1"], "s0_os=4 > R=2"),
    ("train:plan-garbage", TRAIN + ["--plan", "p=2"], "plan"),
    ("train:gpus-do-not-divide", TRAIN + ["--nproc-per-node", "3", "--gpus-per-node", "2"], "must divide"),
    ("train:seq-len-too-long", TRAIN + ["--seq-len", "100000"], "--seq-len must be <="),
    ("train:model-unknown", TRAIN + ["--model", "gpt-5"], "invalid choice: 'gpt-5'"),
    ("train:auto-memory-no-unit", TRAIN + ["--plan", "auto", "--gpu-memory", "10"], "--gpu-memory needs a number and a unit"),
    ("train:auto-nothing-fits", TRAIN + ["--plan", "auto", "--profile", "paper-a800", "--gpu-memory", "1KiB",
                                         "--memory-reserve", "0B"], "fit"),
    ("train:auto-truncated-profile", TRAIN + ["--plan", "auto", "--gpu-memory", "4MiB", "--profile", "{truncated_profile}"],
     "not valid JSON"),
    ("train:auto-unknown-profile", TRAIN + ["--plan", "auto", "--gpu-memory", "4MiB", "--profile", "nosuch"], "nosuch"),
]


def _shard(model=None, plan="ddp", factory=None, config=None):
    import torch

    from amsp_ext.runtime.shard import shard

    if model is None:
        model = torch.nn.Linear(2, 2)
    return shard(model, plan, factory or (lambda p: torch.optim.SGD(p, lr=0.1)), config=config)


def _empty_module():
    import torch

    return torch.nn.ReLU()


def _cfg(**kw):
    from amsp_ext.runtime.config import ShardConfig

    return ShardConfig(**kw)


def _amsp_block(block):
    from amsp_ext.integrations.settings import AMSPSettings

    return AMSPSettings.from_dict(block)


def _ds(cfg, what):
    from amsp_ext.integrations import settings

    return getattr(settings, what)(cfg)


def _opt_block(block):
    from amsp_ext.integrations.optim import _from_block

    return _from_block(block)


def _verify(path):
    from amsp_ext.runtime.state.checkpoint import verify_checkpoint

    return verify_checkpoint(path)


def _fp16(**kw):
    from amsp_ext.runtime.config import FP16Config

    return FP16Config(**kw)


def _auto(**kw):
    from amsp_ext.runtime.config import AutoPlanConfig

    return AutoPlanConfig(**kw)


def _adaptive(**kw):
    from amsp_ext.runtime.config import AdaptiveConfig

    return AdaptiveConfig(**kw)


def _overlap(**kw):
    from amsp_ext.runtime.config import OverlapConfig

    return OverlapConfig(**kw)


PY = [
    ("ShardConfig:precision", lambda f: _cfg(precision="fp8"), "config.precision must be one of fp32, bf16, fp16, got 'fp8'"),
    ("ShardConfig:bucket-0", lambda f: _cfg(grad_bucket_bytes=0), "config.grad_bucket_bytes must be an integer >= 1"),
    ("ShardConfig:bucket-float", lambda f: _cfg(grad_bucket_bytes=1e-9), "config.grad_bucket_bytes"),
    ("ShardConfig:timeout-negative", lambda f: _cfg(timeout=-5), "config.timeout must be a number > 0"),
    ("ShardConfig:timeout-nan", lambda f: _cfg(timeout=math.nan), "config.timeout"),
    ("ShardConfig:timeout-inf", lambda f: _cfg(timeout=math.inf), "config.timeout"),
    ("ShardConfig:granularity", lambda f: _cfg(granularity="block"), "config.granularity must be one of module, layer"),
    ("ShardConfig:ownership", lambda f: _cfg(ownership="random"), "config.ownership must be one of greedy, blocks"),
    ("ShardConfig:init-weights", lambda f: _cfg(init_weights="seed"), "config.init_weights must be one of broadcast, check"),
    ("ShardConfig:gpus-0", lambda f: _cfg(gpus_per_node=0), "config.gpus_per_node must be an integer >= 1"),
    ("ShardConfig:overlap-dict", lambda f: _cfg(overlap={"allgather": False}), "config.overlap must be an OverlapConfig"),
    ("ShardConfig:recompute-str", lambda f: _cfg(recompute="yes"), "config.recompute must be true or false"),
    ("FP16Config:min-scale-0", lambda f: _fp16(min_scale=0), "fp16.min_scale must be a number > 0"),
    ("FP16Config:backoff-1.5", lambda f: _fp16(backoff_factor=1.5), "fp16.backoff_factor must be a number > 0 and < 1"),
    ("AutoPlanConfig:seq-len-0", lambda f: _auto(seq_len=0), "auto.seq_len must be an integer >= 1"),
    ("OverlapConfig:str", lambda f: _overlap(allgather="no"), "overlap.allgather must be true or false"),
    ("amsp-block:list", lambda f: _amsp_block([1]), "amsp must be an object, got list"),
    ("amsp-block:no-enabled", lambda f: _amsp_block({"plan": "zero3"}), "amsp.enabled is required"),
    ("amsp-block:unknown-key", lambda f: _amsp_block({"enabled": True, "plam": "x"}), "amsp.plam: unknown key"),
    ("amsp-block:plan-garbage", lambda f: _amsp_block({"enabled": True, "plan": "p=2x"}), "amsp.plan"),
    ("amsp-block:plan-factor-0", lambda f: _amsp_block({"enabled": True, "plan": {"p": [0, 1], "os": [1, 1]}}),
     "amsp.plan.p must be [s0, s1]"),
    ("amsp-block:timeout-negative", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "timeout": -1}),
     "amsp.timeout must be a number > 0"),
    ("amsp-block:bucket-tiny", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "grad_bucket_bytes": "1e-9"}),
     "amsp.grad_bucket_bytes"),
    ("amsp-block:cluster-gpus-0", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "gpus_per_node": 0}),
     "amsp.gpus_per_node must be an integer >= 1"),
    ("amsp-block:overlap-str", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "overlap": {"allreduce": "no"}}),
     "amsp.overlap.allreduce must be true or false"),
    ("amsp-block:auto-no-seq-len", lambda f: _amsp_block({"enabled": True, "plan": "auto"}), "amsp.seq_len is required"),
    ("amsp-block:max-bad-steps", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "max_bad_steps": -1}),
     "amsp.max_bad_steps must be an integer >= 0"),
    ("ShardConfig:max-bad-steps", lambda f: _cfg(max_bad_steps=1.5), "config.max_bad_steps must be an integer >= 0"),
    ("amsp-block:missing-mesh", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "missing_mesh": "guess"}),
     "amsp.missing_mesh must be one of error, fit"),
    ("AdaptiveConfig:band-empty", lambda f: _adaptive(band=(1.0, 1.0)),
     "adaptive.band must be two numbers (low, high) with 0 < low < 1 < high"),
    ("AdaptiveConfig:window-0", lambda f: _adaptive(window=0), "adaptive.window (steps) must be an integer >= 1, got 0"),
    ("AdaptiveConfig:hysteresis-negative", lambda f: _adaptive(hysteresis=-0.1), "adaptive.hysteresis must be a number >= 0"),
    ("ShardConfig:adaptive-dict", lambda f: _cfg(adaptive={"window": 3}), "config.adaptive must be an AdaptiveConfig or None"),
    ("shard:adaptive-no-replan", lambda f: _shard(plan="zero1", config=_cfg(
        adaptive=_adaptive(allow_replan=False), auto=_auto(seq_len=16, micro_batch_size=1, num_micro_batches=1))),
     "config.adaptive.allow_replan: false with plan zero1"),
    ("ShardConfig:adaptive-without-auto", lambda f: _cfg(adaptive=_adaptive()),
     "config.adaptive needs config.auto=AutoPlanConfig(seq_len=..."),
    ("AdaptiveConfig:horizon-0", lambda f: _adaptive(horizon_steps=0),
     "adaptive.horizon_steps must be an integer >= 1, got 0"),
    ("amsp-block:adaptive-no-seq-len", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "adaptive": {}}),
     "amsp.seq_len is required with amsp.adaptive"),
    ("amsp-block:adaptive-band-empty", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "adaptive": {"band": [2, 3]}}),
     "amsp.adaptive.band must be two numbers (low, high) with 0 < low < 1 < high"),
    ("amsp-block:adaptive-window-0", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "adaptive": {"window": 0}}),
     "amsp.adaptive.window (steps) must be an integer >= 1, got 0"),
    ("amsp-block:adaptive-no-replan", lambda f: _amsp_block({"enabled": True, "plan": "p=1x1,g=1x1,os=2x1",
                                                            "adaptive": {"allow_replan": False}}),
     "amsp.adaptive.allow_replan: false with plan p=1x1,g=1x1,os=2x1"),
    ("amsp-block:adaptive-unknown-key", lambda f: _amsp_block({"enabled": True, "plan": "ddp", "adaptive": {"windw": 3}}),
     "amsp.adaptive.windw is not an adaptive setting (allowed: band, window"),
    ("ds:clipping-negative", lambda f: _ds({"gradient_clipping": -1}, "gradient_clipping"), "gradient_clipping must be a finite number >= 0"),
    ("ds:config-list", lambda f: _ds(str(f["list_json"]), "load_ds_config"), "must be a JSON object"),
    ("ds:config-int", lambda f: _ds(3, "load_ds_config"), "ds_config must be a dict, a path or a JSON string"),
    ("ds:optimizer-lr-fast", lambda f: _opt_block({"type": "AdamW", "params": {"lr": "fast"}}),
     "optimizer.params.lr must be a finite number, got 'fast'"),
    ("ds:optimizer-lr-nan", lambda f: _opt_block({"type": "AdamW", "params": {"lr": math.nan}}), "optimizer.params.lr"),
    ("ds:optimizer-lr-negative", lambda f: _opt_block({"type": "AdamW", "params": {"lr": -1.0}}),
     "AdamW refuses them: Invalid learning rate"),
    ("ds:optimizer-betas-short", lambda f: _opt_block({"type": "Adam", "params": {"betas": [0.9]}}),
     "optimizer.params.betas must be a list of 2 numbers"),
    ("ds:optimizer-unknown-param", lambda f: _opt_block({"type": "AdamW", "params": {"speed": 3}}),
     "optimizer.params.speed: AdamW takes no such argument"),
    ("ds:optimizer-unknown-type", lambda f: _opt_block({"type": "Turbo"}), "optimizer.type 'Turbo'"),
    ("ds:optimizer-cuda-only", lambda f: _opt_block({"type": "OneBitAdam"}), "DeepSpeed CUDA optimizer"),
    ("ds:optimizer-momentum-str", lambda f: _opt_block({"type": "SGD", "params": {"lr": 0.1, "momentum": "high"}}),
     "optimizer.params.momentum must be a finite number"),
    ("shard:model-not-module", lambda f: _shard(model="llama"), "model must be a torch.nn.Module, got str"),
    ("shard:model-without-parameters", lambda f: _shard(model=_empty_module()), "has no parameters"),
    ("ShardConfig:bucket-bool", lambda f: _cfg(grad_bucket_bytes=True), "config.grad_bucket_bytes must be an integer >= 1"),
    ("ShardConfig:nodes-per-leaf-bool", lambda f: _cfg(nodes_per_leaf=True), "config.nodes_per_leaf must be an integer >= 1"),
    ("FP16Config:growth-interval-str", lambda f: _fp16(growth_interval="x"), "fp16.growth_interval must be an integer >= 1"),
    ("FP16Config:growth-interval-1.5", lambda f: _fp16(growth_interval=1.5), "fp16.growth_interval must be an integer >= 1"),
    ("FP16Config:initial-scale-inf", lambda f: _fp16(initial_scale=math.inf), "fp16.initial_scale must be a number > 0"),
    ("shard:factory-not-callable", lambda f: _shard(factory=3), "optimizer_factory must be a callable"),
    ("shard:factory-is-optimizer", lambda f: _shard(factory=_sgd()), "optimizer_factory must be a callable"),
    ("shard:plan-int", lambda f: _shard(plan=3), "plan must be a Plan, a string"),
    ("shard:config-dict", lambda f: _shard(config={"precision": "bf16"}), "config must be a ShardConfig, got dict"),
    ("checkpoint:missing", lambda f: _verify(f["no_dir"]), "does not exist"),
    ("checkpoint:no-amsp-json", lambda f: _verify(f["ckpt_nometa"]), "is not a complete amsp checkpoint"),
    ("checkpoint:amsp-json-truncated", lambda f: _verify(f["ckpt_badjson"]), "file amsp.json is damaged (not valid JSON"),
    ("checkpoint:amsp-json-list", lambda f: _verify(f["ckpt_list"]), "file amsp.json is damaged (not a JSON object)"),
    ("checkpoint:other-format", lambda f: _verify(f["ckpt_format"]), "has format 'other/9', expected 'amsp-checkpoint/3'"),
    ("checkpoint:checksum", lambda f: _verify(f["ckpt_checksum"]), "file amsp.json is damaged (checksum mismatch)"),
]


def _sgd():
    import torch

    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _fill(argv, files):
    return [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(tmp_path_factory.mktemp("bad"))


CASES = [(c, "cli", argv, want) for c, argv, want in CLI] + [(c, "py", fn, want) for c, fn, want in PY]


def test_the_table_is_big_enough():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case,kind,what,want", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_gets_one_line(case, kind, what, want, files, capsys):
    if kind == "cli":
        from amsp_ext.cli.main import main

        try:
            rc = main(_fill(what, files))
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (rc, err)
        msg = lines[0]
        assert msg.startswith(f"amsp{' ' + what[0] if what[0] in ('plan', 'migrate', 'train') else ''}"), msg
    else:
        with pytest.raises(ValueError) as e:
            what(files)
        msg = str(e.value)
        assert "\n" not in msg, msg
    assert want in msg, msg
