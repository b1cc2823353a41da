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


@pytest.fixture(autouse=True)
def _no_engine_yet(monkeypatch):
    """[Note: which from_pretrained loads on meta] rule 1 reads whether this process built an
    engine; an in-process test before these may have."""
    from amsp_ext.runtime.engine import Engine

    monkeypatch.setattr(Engine, "built", 0)


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


# -- [Note: which from_pretrained loads on meta] ---------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A model folder, one with tied embeddings, and a LoRA adapter (non-zero B) for the first."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pending")
    plain = _save(root / "plain")
    tied = root / "tied"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tied)
    base = AutoModelForCausalLM.from_pretrained(plain)
    torch.manual_seed(5)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    peft_model.save_pretrained(root / "adapter")
    return {"plain": plain, "tied": tied, "adapter": root / "adapter"}


def _load(folder, pending=True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert all(p.is_meta for p in model.parameters()) == pending
    return model


IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 64, 2]])


def _same_weights(model, ref):
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("use", ["forward", "generate", "to", "cuda_like_float", "state_dict",
                                 "save_pretrained", "tie_weights"])
def test_a_model_left_on_meta_is_filled_at_its_first_use(folders, use, tmp_path):
    """Every use of a model loaded on meta and never sharded behaves as on the loaded model."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    folder = folders["tied" if use == "tie_weights" else "plain"]
    ref = AutoModelForCausalLM.from_pretrained(folder)  # no AMSP config alive yet
    keep = HfDeepSpeedConfig(_ds_config(True))
    from amsp_ext.integrations.patches import transformers_meta_load

    transformers_meta_load.apply()
    model = _load(folder)
    if use == "forward":
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    elif use == "generate":
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    elif use == "to":
        assert model.to("cpu") is model
    elif use == "cuda_like_float":
        model.float()
    elif use == "state_dict":
        _same_weights(model, ref)
    elif use == "save_pretrained":
        from safetensors.torch import load_file

        model.save_pretrained(tmp_path / "out")
        files = {}
        for f in (tmp_path / "out").glob("*.safetensors"):
            files.update(load_file(str(f)))
        want = ref.state_dict()
        for k, v in files.items():
            assert torch.equal(v, want[k]), k
    elif use == "tie_weights":
        model.tie_weights()
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # after the use the model is an ordinary loaded one: named_parameters() reads real values
    assert type(model) is type(ref)
    for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert n == rn and not p.is_meta and torch.equal(p, rp), n
    del keep
    gc.collect()


@pytest.mark.parametrize("how", ["get_peft_model", "PeftModel.from_pretrained"])
def test_peft_on_a_model_left_on_meta_wraps_the_loaded_weights(folders, how):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from amsp_ext.integrations.patches import peft_meta_load, transformers_meta_load

    def wrap(base):
        torch.manual_seed(6)
        if how == "get_peft_model":
            return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        return PeftModel.from_pretrained(base, folders["adapter"])

    ref = wrap(AutoModelForCausalLM.from_pretrained(folders["plain"]))
    keep = HfDeepSpeedConfig(_ds_config(True))
    transformers_meta_load.apply()
    peft_meta_load.apply()
    got = wrap(_load(folders["plain"]))
    assert not any(p.is_meta for p in got.parameters())
    assert torch.equal(got(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    del keep
    gc.collect()


def test_once_an_engine_exists_from_pretrained_loads_whole(folders, monkeypatch):
    """Rule 1: reloads after training (an engine was built in this process) are ordinary loads;
    ``initialize`` adopts a pending model without filling it."""
    from transformers.integrations import HfDeepSpeedConfig

    from amsp_ext.integrations.patches import transformers_meta_load
    from amsp_ext.runtime.engine import Engine

    transformers_meta_load.apply()
    keep = HfDeepSpeedConfig(_ds_config(True))
    pending = _load(folders["plain"])
    assert transformers_meta_load.adopt(pending) == str(folders["plain"].resolve())
    assert all(p.is_meta for p in pending.parameters())  # taken as it is: each rank reads its share
    pending.state_dict()  # no longer a use that fills: the engine owns it now
    assert all(p.is_meta for p in pending.parameters())
    monkeypatch.setattr(Engine, "built", 1)
    _load(folders["plain"], pending=False)
    del keep
    gc.collect()
