"""The Hugging Face routes load like ZeRO-3 (integrations/patches/transformers_meta_load.py):
under a ds_config with ``amsp.enabled``, ``from_pretrained`` builds on meta and names its folder,
and each rank reads its share at ``deepspeed.initialize`` / ``prepare``."""

from __future__ import annotations

import gc
import json
import sys

import pytest
import torch

from dist_utils import REPO, run_script, script_env


def _save(folder, hidden=64, layers=2, inter=176):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="200KB")
    return folder


def _ds_config(enabled):
    return {"amsp": {"enabled": enabled, "plan": "zero3"}, "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1}


def test_from_pretrained_builds_on_meta_only_under_an_amsp_config(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from amsp_ext.integrations.patches import transformers_meta_load

    transformers_meta_load.apply()
    folder = _save(tmp_path / "m")
    keep = HfDeepSpeedConfig(_ds_config(True))  # active while referenced (transformers' weak ref)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert all(p.is_meta for p in model.parameters())
    assert model._amsp_init_from == str(folder.resolve())
    del keep
    gc.collect()
    for cfg in (None, _ds_config(False)):
        keep = HfDeepSpeedConfig(cfg) if cfg is not None else None
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert not any(p.is_meta for p in model.parameters()) and not hasattr(model, "_amsp_init_from")
        files = {}
        for f in folder.glob("*.safetensors"):
            files.update(load_file(str(f)))
        assert torch.equal(model.state_dict()["lm_head.weight"], files["lm_head.weight"])
        del keep
        gc.collect()


def _setup_lines(proc):
    return [json.loads(l[6:]) for l in proc.stdout.splitlines() if l.startswith("SETUP ")]


def _logs(proc):
    return [json.loads(l[4:]) for l in proc.stdout.splitlines() if l.startswith("LOG ")]


@pytest.mark.distributed
@pytest.mark.slow  # conftest.py [Note: test tiers]; the default tier has the patch in-process above and
# shard(init_from=...) on 4 ranks in test_meta_init.py
def test_hf_trainer_from_pretrained_reads_shares_and_trains_like_ddp(tmp_path):
    """2 ranks, a 26.4M-parameter Llama (105 MB in fp32) in 200 KB files: under AMSP each rank's
    from_pretrained holds no weight and its peak memory grows by less than half the model (the
    loading code's own imports and buffers), while the DDP run of the same script holds the
    whole model; the Trainer's losses are equal."""
    env = script_env(tmp_path / "site")
    folder = _save(tmp_path / "model", hidden=768, layers=4, inter=2048)
    model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    cfg = json.loads((REPO / "configs" / "hf_trainer" / "ds_config.json").read_text())
    cfg["amsp"].update(plan="zero3", gpus_per_node=2)
    cfg.pop("optimizer")
    cfg.pop("scheduler")
    (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "tests/scripts/hf_trainer_train.py", "--save-steps", "0", "--from-pretrained", str(folder)]
    amsp = run_script([*run, "--deepspeed", str(tmp_path / "ds_config.json"), "--output-dir",
                       str(tmp_path / "amsp")], env, REPO, timeout=600)
    setup = _setup_lines(amsp)
    assert len(setup) == 2 and all(s["loaded_on_meta"] for s in setup), setup
    for s in setup:
        assert s["loaded_param_bytes"] == 0 and s["load_peak_growth"] < model_bytes / 2, (s, model_bytes)
    ddp = run_script([*run, "--output-dir", str(tmp_path / "ddp")], {**env, "ACCELERATE_USE_CPU": "true"},
                     REPO, timeout=600)
    ref_setup = _setup_lines(ddp)
    assert not any(s["loaded_on_meta"] for s in ref_setup)
    # the reference holds every weight (transformers maps the files, so its RSS grows only as
    # pages are touched: the held bytes are the comparison, not its RSS)
    assert all(s["loaded_param_bytes"] >= model_bytes - 2**20 for s in ref_setup), (ref_setup, model_bytes)
    got, ref = _logs(amsp), _logs(ddp)
    assert [l["step"] for l in got] == [l["step"] for l in ref] == [1, 2, 3, 4]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
