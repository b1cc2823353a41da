"""The integrations without launching ranks: the amsp block and its one-line errors, DeepSpeed's
batch/precision/optimizer rules, the key table, the deepspeed.initialize routing, the start-up
hook and its packaging, and ``amsp migrate`` (expected values are hand-computed or DeepSpeed's)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from amsp_ext.integrations.settings import (
    OLD_KEYS_UNTIL, AMSPSettings, PrecisionSettings, amsp_enabled, gradient_clipping, resolve_batch,
    upgrade_block,
)

REPO = Path(__file__).resolve().parents[1]


# -- the amsp block ---------------------------------------------------------------------------------

BAD_BLOCKS = [
    ({}, "amsp.enabled is required"),
    ({"enabled": "yes"}, "amsp.enabled must be true or false"),
    ({"enabled": True, "plan": "zero4"}, "amsp.plan must be 'auto', a baseline name"),
    ({"enabled": True, "plan": "p=2x1,os=2x"}, "amsp.plan: cannot read"),
    ({"enabled": True, "plan": "mics"}, "amsp.plan: 'mics' needs a shard group size"),
    ({"enabled": True, "plan": {"p": [2], "os": [2, 1]}}, "amsp.plan.p must be [s0, s1]"),
    ({"enabled": True, "plan": {"p": [1, 1]}}, "amsp.plan.os is required"),
    ({"enabled": True, "plan": 3}, "amsp.plan must be 'auto'"),
    ({"enabled": True, "plan": "auto"}, "amsp.seq_len is required when amsp.plan is 'auto'"),
    ({"enabled": True, "plan": "ddp", "seq_len": 0}, "amsp.seq_len must be an integer >= 1"),
    ({"enabled": True, "plan": "ddp", "overlap": {"broadcast": 1}}, "amsp.overlap.broadcast must be true or false"),
    ({"enabled": True, "plan": "ddp", "overlap": {"bc": True}}, "amsp.overlap.bc: unknown key; allowed: allgather, allreduce, broadcast"),
    ({"enabled": True, "plan": "ddp", "cluster": {"gpus": 8}}, "amsp.cluster.gpus: unknown key; allowed: gpus_per_node"),
    ({"enabled": True, "plan": "ddp", "cluster": 8}, "amsp.cluster must be an object"),
    ({"enabled": True, "plan": "ddp", "cluster": {"gpus_per_node": 8}, "gpus_per_node": 8},
     "amsp.cluster.gpus_per_node and amsp.gpus_per_node are the same setting"),
    ({"enabled": True, "plan": "ddp", "gpus_per_node": 0}, "amsp.gpus_per_node must be an integer >= 1"),
    ({"enabled": True, "plan": "ddp", "gpus_per_node": True}, "amsp.gpus_per_node must be an integer >= 1"),
    ({"enabled": True, "plan": "ddp", "gpu_memory": "80"}, "amsp.gpu_memory needs"),
    ({"enabled": True, "plan": "ddp", "precision": "bf16"}, "amsp.precision: set by DeepSpeed's own bf16.enabled"),
    ({"enabled": True, "plan": "ddp", "objective": "fast"}, "amsp.objective must be one of comm, step"),
    ({"enabled": True, "plan": "ddp", "missing_mesh": "guess"}, "amsp.missing_mesh must be one of error, fit"),
    ({"enabled": True, "plan": "ddp", "granularity": "tensor"}, "amsp.granularity must be one of module, layer"),
    ({"enabled": True, "plan": "ddp", "timeout": 0}, "amsp.timeout must be a number > 0"),
    ({"enabled": True, "plan": "ddp", "bucket": 5}, "amsp.bucket: unknown key; allowed: enabled, plan"),
    ({"enabled": True, "plan": "ddp", "grad_bucket_bytes": "25XB"}, "amsp.grad_bucket_bytes: unknown unit"),
    ({"enabled": True, "plan": "ddp", "recompute": "no"}, "amsp.recompute must be true or false"),
]


@pytest.mark.parametrize("block,message", BAD_BLOCKS)
def test_bad_amsp_block_is_one_line_naming_the_field(block, message):
    with pytest.raises(ValueError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        AMSPSettings.from_dict(block)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


# the block `amsp migrate` wrote before the engine had one config (integrations/settings.py
# [Note: renamed keys])
OLD_BLOCK = {"enabled": True, "plan": "zero3", "seq_len": 128,
             "cluster": {"gpus_per_node": 2, "nodes_per_leaf": None, "gpu_memory": "4GiB"},
             "profile": "paper-a800", "missing_mesh": "error", "recompute": True, "bucket_size": "1MiB"}


def test_an_old_amsp_block_loads_with_one_warning_line_naming_its_origin():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = AMSPSettings.from_dict(OLD_BLOCK, origin="ds_config /x/ds.json")
    lines = [str(w.message) for w in caught if w.category is FutureWarning]
    moved = (("cluster.gpus_per_node", "gpus_per_node"), ("cluster.nodes_per_leaf", "nodes_per_leaf"),
             ("cluster.gpu_memory", "gpu_memory"), ("bucket_size", "grad_bucket_bytes"))
    assert lines == [f"amsp_ext: ds_config /x/ds.json: {', '.join('amsp.' + a for a, _ in moved)} are "
                     f"deprecated, read as {', '.join('amsp.' + b for _, b in moved)} until amsp_ext "
                     f"{OLD_KEYS_UNTIL}; run `amsp migrate` to upgrade the file"]
    # attributed to this test (the first frame outside amsp_ext and the installed packages)
    assert caught[0].filename == __file__
    new, moved = upgrade_block(OLD_BLOCK)
    assert "cluster" not in new and "bucket_size" not in new and len(moved) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current shape loads without one
        assert AMSPSettings.from_dict(new) == old
    assert (old.engine.gpus_per_node, old.engine.nodes_per_leaf, old.gpu_memory_bytes) == (2, None, 4 * 2**30)
    assert old.engine.grad_bucket_bytes == 2**20 and old.bucket_bytes == 2**20 and old.engine.recompute


def test_amsp_migrate_upgrades_an_old_block_in_place(tmp_path, capsys):
    from amsp_ext.cli.main import main

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "amsp": OLD_BLOCK}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    assert main(["migrate", str(path)]) == 0
    assert "amsp.cluster.gpus_per_node -> amsp.gpus_per_node" in capsys.readouterr().out
    upgraded = json.loads(path.read_text())
    assert upgraded["amsp"] == upgrade_block(OLD_BLOCK)[0]
    assert {k: v for k, v in upgraded.items() if k != "amsp"} == {k: v for k, v in cfg.items() if k != "amsp"}
    assert main(["migrate", str(path)]) == 2  # nothing old left: a plain migration needs a model
    assert "one of --model or --model-config is required" in capsys.readouterr().err


def test_amsp_block_forms():
    s = AMSPSettings.from_dict({"enabled": True, "plan": {"p": [2, 1], "os": [2, 2]},
                                "gpus_per_node": 2, "gpu_memory": "1GiB",
                                "grad_bucket_bytes": "4MiB", "overlap": {"broadcast": False}})
    assert s.plan == "p=2x1,os=2x2"
    assert s.gpu_memory_bytes == 2**30 and s.bucket_bytes == 4 * 2**20
    e = s.engine
    assert (e.overlap.allgather, e.overlap.allreduce, e.overlap.broadcast) == (True, True, False)
    assert AMSPSettings.from_dict(s.to_dict()) == s  # what migrate writes loads back
    assert AMSPSettings.from_dict({"enabled": False, "plan": "auto"}).plan == "auto"  # off: no seq_len needed
    assert amsp_enabled({"amsp": {"enabled": True}}) and not amsp_enabled({"amsp": {"enabled": False}})
    assert not amsp_enabled({"train_batch_size": 8}) and not amsp_enabled({"amsp": None})
    # anything but an explicit false asks for AMSP: the validation then names the field
    assert amsp_enabled({"amsp": {"enabled": "true"}}) and amsp_enabled({"amsp": {"plan": "ddp"}})
    assert not amsp_enabled({})


def test_initialize_rejects_a_bad_config_before_any_collective():
    """torch.distributed is not initialised here: the config error must come first."""
    import torch.distributed as dist

    import amsp_ext
    from amsp_ext.common.models import build_llama

    assert not dist.is_initialized()
    model = build_llama("tiny-llama")
    for cfg, message in [
        ({"train_batch_size": 8, "amsp": {"enabled": True, "plan": "zero9"}}, "amsp.plan must be"),
        ({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": True},
          "amsp": {"enabled": True, "plan": "ddp"}}, "bf16.enabled and fp16.enabled are both true"),
        ({"train_batch_size": 8, "gradient_clipping": -1, "amsp": {"enabled": True, "plan": "ddp"}},
         "gradient_clipping must be a finite number >= 0"),
        ({"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {}},
          "amsp": {"enabled": True, "plan": "ddp"}}, "optimizer.type 'OneBitLamb'"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            amsp_ext.initialize(model=model, config=cfg)
    assert not dist.is_initialized()


def test_megatron_style_mpu_must_be_data_parallel_only():
    from amsp_ext.integrations.ds_initialize import _check_mpu

    class MPU:
        def __init__(self, tp, pp):
            self.tp, self.pp = tp, pp

        def get_tensor_model_parallel_world_size(self):
            return self.tp

        def get_pipeline_model_parallel_world_size(self):
            return self.pp

    _check_mpu(None)
    _check_mpu(MPU(1, 1))
    with pytest.raises(ValueError, match="mpu: AMSP runs data parallelism only; this job has "
                                         "tensor_model_parallel size 2, pipeline_model_parallel size 4"):
        _check_mpu(MPU(2, 4))


# -- DeepSpeed's own keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,world,expected", [
    # DeepSpeedConfig._set_batch_related_parameters, case by case (hand-computed)
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4, (32, 2, 4)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, (32, 2, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, (24, 2, 3)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),
])
def test_batch_keys_follow_deepspeed(cfg, world, expected):
    b = resolve_batch(cfg, world)
    assert (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("cfg,message", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     "train_batch_size=30 must equal train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=4 x world size 4"),
    ({"gradient_accumulation_steps": 4}, "train_batch_size or train_micro_batch_size_per_gpu must be given"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu is 'auto'"),
    ({"train_batch_size": 0}, "train_batch_size must be an integer >= 1"),
    ({"train_batch_size": 2}, r"train_batch_size=2 is not a multiple of world size=4 = 4"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},  # 32 // 4 // 16 would be 0
     r"train_batch_size=32 is not a multiple of train_micro_batch_size_per_gpu=4 x world size=4 x"),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 5},
     r"train_batch_size=24 is not a multiple of gradient_accumulation_steps=5 x world size=4 = 20"),
])
def test_bad_batch_keys(cfg, message):
    world = 16 if cfg.get("train_micro_batch_size_per_gpu") == 4 else 4
    with pytest.raises(ValueError, match=message.replace("world size=4 x", f"world size={world}")) as e:
        resolve_batch(cfg, world)
    assert "=0" not in str(e.value)  # never an impossible derived value


def test_precision_and_clipping_keys():
    assert PrecisionSettings.from_ds({}).precision == "fp32"
    assert PrecisionSettings.from_ds({"bf16": {"enabled": True}}).precision == "bf16"
    f = PrecisionSettings.from_ds({"fp16": {"enabled": True, "initial_scale_power": 12,
                                            "loss_scale_window": 500, "min_loss_scale": 2,
                                            "hysteresis": 2}})
    assert (f.precision, f.initial_scale, f.growth_interval, f.min_scale) == ("fp16", 4096.0, 500, 2.0)
    assert any("hysteresis" in n for n in f.notes)  # honoured approximately: reported
    static = PrecisionSettings.from_ds({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 1}})
    assert static.initial_scale == 128.0 and any("static" in n for n in static.notes)
    with pytest.raises(ValueError, match="amp.enabled"):
        PrecisionSettings.from_ds({"amp": {"enabled": True}})
    with pytest.raises(ValueError, match="bf16.enabled is 'auto'"):
        PrecisionSettings.from_ds({"bf16": {"enabled": "auto"}})
    assert gradient_clipping({}) == 0.0 and gradient_clipping({"gradient_clipping": 1}) == 1.0


def _masters(model):
    """What AMSP hands the optimizer factory on one rank: fp32 copies carrying amsp_name."""
    out = []
    for n, p in model.named_parameters():
        m = torch.nn.Parameter(p.detach().clone())
        m.amsp_name = n
        out.append(m)
    return out


def test_optimizer_block_follows_deepspeed_names():
    from amsp_ext.integrations.optim import _from_block

    cls, params = _from_block({"type": "Adam", "params": {"lr": 1e-4}})
    assert cls is torch.optim.AdamW and params["weight_decay"] == 0.0  # FusedAdam default, AdamW mode
    cls, _ = _from_block({"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}})
    assert cls is torch.optim.Adam
    cls, _ = _from_block({"type": "AdamW", "params": {"adam_w_mode": False, "torch_adam": True}})
    assert cls is torch.optim.AdamW  # the AdamW name forces AdamW
    assert _from_block({"type": "SGD", "params": {"lr": 0.1}})[0] is torch.optim.SGD
    for block, message in [({"type": "Lamb"}, "DeepSpeed CUDA optimizer"),
                           ({"type": "Adam", "params": {"max_grad_norm": 1}}, "gradient_clipping"),
                           ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction"),
                           ({"type": "NoSuch"}, "neither a DeepSpeed optimizer"),
                           ({"type": "Adam", "params": {"lr": "auto"}}, "optimizer.params.lr is 'auto'")]:
        with pytest.raises(ValueError, match=message):
            _from_block(block)


def test_param_groups_survive_the_rebuild():
    from amsp_ext.integrations.optim import build_optimizer_factory
    from amsp_ext.common.models import build_llama

    model = build_llama("tiny-llama")
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    factory, _ = build_optimizer_factory(model, client_optimizer=None, model_parameters=groups, ds_config=cfg)
    masters = _masters(model)
    opt = factory(masters[3:])  # this rank owns a subset
    assert [len(g["params"]) for g in opt.param_groups] == [
        sum(m.dim() > 1 for m in masters[3:]), sum(m.dim() <= 1 for m in masters[3:])]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4]
    empty = factory([torch.nn.Parameter(torch.zeros(0))])  # owns nothing: same group count
    assert len(empty.param_groups) == 2

    # a client optimizer object becomes the inner optimizer; a scheduler bound to it still works
    client = torch.optim.AdamW(groups, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 0.5 ** s)
    factory, _ = build_optimizer_factory(model, client_optimizer=client, model_parameters=None, ds_config={})
    inner = factory(masters)
    assert inner is client and inner.param_groups[0]["params"][0] is masters[[m.dim() > 1 for m in masters].index(True)]
    client.step()
    sched.step()
    assert inner.param_groups[1]["lr"] == pytest.approx(0.5 * 5e-4)


def test_key_table():
    from amsp_ext.integrations import ds_keys

    cfg = {"train_batch_size": 8, "steps_per_print": 10, "tensor_parallel": {"autotp_size": 1},
           "pipeline": {"stages": 2}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                            "offload_param": {"device": "none"},
                                                            "contiguous_gradients": True, "mystery": 1},
           "fp16": {"enabled": True, "hysteresis": 2}}
    got = {k: s for k, s, _ in ds_keys.walk(cfg)}
    assert got == {"train_batch_size": "mapped", "steps_per_print": "ignored", "tensor_parallel": "ignored",
                   "pipeline": "unsupported", "zero_optimization.stage": "mapped",
                   "zero_optimization.offload_optimizer": "unsupported",
                   "zero_optimization.offload_param": "ignored",
                   "zero_optimization.contiguous_gradients": "superseded",
                   "zero_optimization.mystery": "unsupported", "fp16.enabled": "mapped",
                   "fp16.hysteresis": "superseded"}


# -- routing ---------------------------------------------------------------------------------------

def test_deepspeed_initialize_is_routed_only_when_amsp_is_enabled(monkeypatch, tmp_path):
    import deepspeed

    from amsp_ext.integrations.patches import deepspeed_initialize as patch

    calls = []

    def original(**kw):
        calls.append(("deepspeed", kw["config"] if kw["config"] is not None else kw["args"].deepspeed_config))
        return "deepspeed-engine"

    monkeypatch.setattr(deepspeed, "initialize", original)
    assert patch.apply().startswith("applied")
    assert patch.apply() == "already applied"
    import amsp_ext.integrations.ds_initialize as amsp_init

    # the config as given reaches AMSP (a path stays a path: AMSP reads it and names it)
    monkeypatch.setattr(amsp_init, "initialize", lambda **kw: (
        "amsp", amsp_init.resolve_config(kw["args"], kw["config"], kw["config_params"])["amsp"]["plan"]))
    off = {"train_batch_size": 8, "amsp": {"enabled": False, "plan": "zero3"}}
    on = {"train_batch_size": 8, "amsp": {"enabled": True, "plan": "zero3"}}
    assert deepspeed.initialize(model=None, config=off) == "deepspeed-engine"
    assert deepspeed.initialize(model=None, config={"train_batch_size": 8}) == "deepspeed-engine"
    assert deepspeed.initialize(model=None, config=on, dist_init_required=False) == ("amsp", "zero3")
    # a misspelt switch asks for AMSP (whose validation then names the field), never DeepSpeed
    misspelt = {"train_batch_size": 8, "amsp": {"enabled": "yes", "plan": "zero3"}}
    assert deepspeed.initialize(model=None, config=misspelt, dist_init_required=False) == ("amsp", "zero3")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(on))
    args = types.SimpleNamespace(deepspeed_config=str(path), local_rank=0)
    assert deepspeed.initialize(args=args, model=None, dist_init_required=False) == ("amsp", "zero3")
    assert deepspeed.initialize(model=None, config_params=str(path), dist_init_required=False) == ("amsp", "zero3")
    assert len(calls) == 2
    patch.restore()
    assert deepspeed.initialize is original


def test_accelerate_leaves_the_amsp_block_alone():
    from accelerate.utils import DeepSpeedPlugin

    from amsp_ext.integrations.patches import accelerate_amsp_block

    accelerate_amsp_block.apply()
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0}, "amsp": {"enabled": True, "plan": "auto", "seq_len": 16}}
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)
    plugin.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=2)
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
    assert plugin.deepspeed_config["amsp"]["plan"] == "auto"


def test_zero3_keys_next_to_an_enabled_amsp_block_do_not_turn_on_zero_init():
    """A migrated config keeps ``stage: 3``; with amsp.enabled transformers must not build the
    model inside deepspeed.zero.Init (is_deepspeed_zero3_enabled), with enabled false it must."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    from amsp_ext.integrations.patches import accelerate_amsp_block

    accelerate_amsp_block.apply()
    zero3 = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    on = HfDeepSpeedConfig({**zero3, "amsp": {"enabled": True, "plan": "ddp"}})
    off = HfDeepSpeedConfig({**zero3, "amsp": {"enabled": False, "plan": "ddp"}})
    assert (on.is_zero3(), on.is_offload()) == (False, False)
    assert (off.is_zero3(), off.is_offload()) == (True, True)
    assert on.config["zero_optimization"]["stage"] == 3  # the keys stay for DeepSpeed
    unpatched = HfDeepSpeedConfig.set_stage_and_offload.__wrapped__
    probe = HfDeepSpeedConfig({**zero3, "amsp": {"enabled": True}})
    unpatched(probe)
    assert probe.is_zero3()  # what the patch prevents


# -- start-up hook -----------------------------------------------------------------------------------

def test_post_import_hook(tmp_path, monkeypatch):
    from amsp_ext.integrations.import_hooks import when_imported

    (tmp_path / "amsp_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("amsp_hook_probe", lambda m: seen.append(m.VALUE))
    assert seen == []  # nothing imported yet
    import amsp_hook_probe  # noqa: F401

    assert seen == [1]
    when_imported("amsp_hook_probe", lambda m: seen.append(2))  # already imported: at once
    assert seen == [1, 2]


def _run_pth_line(env_extra: dict, then: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMSP_", "ACCELERATE_"))}
    env.update(env_extra, PYTHONPATH=str(REPO))
    code = ("import sys; exec(open(sys.argv[1]).read()); import json; " + then +
            "s = sys.modules.get('amsp_ext.integrations.startup'); "
            "print(json.dumps({'active': getattr(s, '_active', None), 'torch': 'torch' in sys.modules, "
            "'finders': [type(f).__name__ for f in sys.meta_path], "
            "'watched': sorted(getattr(sys.modules.get('amsp_ext.integrations.import_hooks'), '_callbacks', {}))}))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "amsp_ext" / "integrations" / "amsp_ext_startup.pth")],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_startup_pth_needs_no_environment_variable_and_stays_light():
    """Every interpreter gets the import hooks for deepspeed, accelerate, transformers'
    modeling_utils and peft's tuners (no AMSP_* / ACCELERATE_* variable set), without importing torch;
    AMSP_STARTUP=0 switches the hook off.
    (That importing them applies the routing end to end: test_integrations_scripts.)"""
    got = _run_pth_line({})
    assert got["active"] is True and got["torch"] is False and "_Finder" in got["finders"], got
    assert got["watched"] == ["accelerate", "deepspeed", "peft.tuners.tuners_utils",
                              "transformers.modeling_utils", "transformers.trainer", "trl.distributed",
                              "trl.models.utils", "trl.trainer.callbacks"], got
    off = _run_pth_line({"AMSP_STARTUP": "0"})
    assert off["active"] is None and "_Finder" not in off["finders"], off


def test_setup_installs_the_startup_pth(tmp_path):
    """setup.py's build_py puts amsp_ext_startup.pth at the root of a wheel and, in an editable
    build, into the directory editable_wheel zips (install_lib)."""
    from setuptools import Distribution

    ns = runpy.run_path(str(REPO / "setup.py"), run_name="amsp_setup")
    for editable in (False, True):
        dist = Distribution({"name": "amsp_ext_probe", "packages": []})
        dist.script_name = str(REPO / "setup.py")
        cmd = ns["build_py_with_pth"](dist)
        cmd.build_lib = str(tmp_path / "lib")
        cmd.editable_mode = editable
        install = dist.get_command_obj("install")
        install.install_lib = str(tmp_path / "unpacked")
        cmd.ensure_finalized()
        cmd.run()
        where = tmp_path / ("unpacked" if editable else "lib") / "amsp_ext_startup.pth"
        assert where.read_text() == (REPO / "amsp_ext" / "integrations" / "amsp_ext_startup.pth").read_text()
        if not editable:
            assert str(where) in cmd.get_outputs()
    assert "amsp_ext_startup.pth" in (REPO / "MANIFEST.in").read_text()  # the sdist carries it


# -- amsp migrate ----------------------------------------------------------------------------------

BEFORE = REPO / "configs" / "deepspeed" / "before_migration"
LAB = ["--model", "tiny-llama", "--nodes", "2", "--gpus-per-node", "2", "--memory-reserve", "0GiB",
       "--seq-len", "32", "--profile", str(REPO / "configs" / "clusters" / "lab-2x2.profile.json")]


def migrate(capsys, *argv):
    from amsp_ext.cli.main import main

    code = main(["migrate", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("name,old_layout,old_factors", [
    ("zero1", "ZeRO-1", "p=1x1,g=1x1,os=2x2"),
    ("zero3", "ZeRO-3", "p=2x2,g=2x2,os=2x2"),
    ("zeropp_hpz", "ZeRO++ (hpZ 2)", "p=2x2,g=2x2,os=2x2 + hpZ 2"),
    ("mics", "MiCS (shard group 2)", "p=2x1,g=2x1,os=2x1"),
])
def test_migrate_reads_the_old_layout_and_plans(capsys, tmp_path, name, old_layout, old_factors):
    from amsp_ext.integrations import ds_keys
    from amsp_ext.planner.search import make_problem, search
    from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
    from amsp_ext.planner.model_spec import ModelSpec
    from amsp_ext.common.models import llama_config_dict

    out = tmp_path / f"{name}.amsp.json"
    code, text, err = migrate(capsys, BEFORE / f"{name}.json", *LAB, "--gpu-memory", "6MiB", "-o", out, "--json")
    assert code == 0, err
    report = json.loads(text)
    assert report["old"]["layout"] == old_layout and report["old"]["factors"] == old_factors
    # the planned column is the planner's choice for this job (an independent call)
    src = json.loads((BEFORE / f"{name}.json").read_text())
    problem = make_problem(
        ModelSpec.from_hf_config(llama_config_dict("tiny-llama")),
        ClusterSpec(num_nodes=2, gpus_per_node=2, gpu_memory_bytes=6 * 2**20),
        TrainingSpec(seq_len=32, micro_batch_size=1, num_micro_batches=2, precision="fp32",
                     bucket_bytes=src["zero_optimization"]["reduce_bucket_size"] * 4),
        str(REPO / "configs" / "clusters" / "lab-2x2.profile.json"), memory_reserve_bytes=0)
    best = search(problem).best
    assert report["new"]["factors"] == str(best.plan)
    assert report["new"]["t_comm_s"]["total"] == pytest.approx(best.comm.total)
    assert report["new"]["memory_bytes"]["total"] == best.memory.total
    written = json.loads(out.read_text())
    block = AMSPSettings.from_dict(written["amsp"])
    assert block.enabled and block.plan == str(best.plan) and block.engine.gpus_per_node == 2
    assert block.bucket_bytes == src["zero_optimization"]["reduce_bucket_size"] * 4
    assert {k: v for k, v in written.items() if k != "amsp"} == src  # DeepSpeed's keys are kept
    # never silent: one warning line per key it does not map
    unmapped = [k for k, s, _ in ds_keys.walk(src) if s != "mapped"]
    assert unmapped and [l for l in err.splitlines() if "warning:" in l] == [
        l for l in err.splitlines() if any(f"warning: {k}:" in l for k in unmapped)]
    assert len([l for l in err.splitlines() if "warning:" in l]) == len(unmapped)


def test_migrate_text_and_errors(capsys, tmp_path):
    code, text, err = migrate(capsys, BEFORE / "zero3.json", *LAB, "--gpu-memory", "1GiB",
                              "--plan", "p=2x1,g=2x2,os=2x2", "-o", tmp_path / "o.json")
    assert code == 0
    for needle in ("DeepSpeed now: ZeRO-3", "AMSP: --plan p=2x1,g=2x2,os=2x2", "Tcomm per step",
                   "total / GPU", "predicted communication"):
        assert needle in text, text
    assert json.loads((tmp_path / "o.json").read_text())["amsp"]["plan"] == "p=2x1,g=2x2,os=2x2"
    cfg = tmp_path / "auto.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 5}}))
    for argv, message in [
        ((tmp_path / "nope.json", *LAB), "no such file"),
        ((cfg, *LAB), "zero_optimization.stage must be 0, 1, 2 or 3"),
        ((BEFORE / "zero1.json", *LAB, "--plan", "p=3x1,os=2x2"), "dependency"),
        ((BEFORE / "zero1.json", *LAB, "--nodes", "0"), "--nodes must be an integer >= 1"),
    ]:
        code, _, err = migrate(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}))
    code, _, err = migrate(capsys, cfg, *LAB)
    assert code == 2 and "give --micro-batch-size" in err


def test_migrate_stays_torch_free(tmp_path):
    code = ("import sys; from amsp_ext.cli.main import main; "
            f"rc = main(['migrate', {str(BEFORE / 'zero3.json')!r}, '--model', 'llama-7b', "
            f"'-o', {str(tmp_path / 'o.json')!r}]); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert "TORCH False 0" in out.stdout


def test_migrate_removes_what_frameworks_would_act_on_and_lists_it(capsys, tmp_path):
    """Offload blocks (the Trainer would build DeepSpeed's CPU Adam) and the hybrid engine are
    taken out of the written config, each listed; a disabled offload block stays; ZeRO-3's
    stage is kept and its zero.Init row listed."""
    src = json.loads((BEFORE / "zero3.json").read_text())
    src["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    src["zero_optimization"]["offload_param"] = {"device": "none"}
    src["hybrid_engine"] = {"enabled": True, "max_out_tokens": 512}
    cfg = tmp_path / "offload.json"
    cfg.write_text(json.dumps(src))
    out = tmp_path / "o.json"
    code, text, err = migrate(capsys, cfg, *LAB, "--gpu-memory", "1GiB", "-o", out, "--json")
    assert code == 0, err
    report = json.loads(text)
    assert [r["key"] for r in report["rewritten"]] == [
        "zero_optimization.offload_optimizer", "hybrid_engine", "zero_optimization.stage"]
    written = json.loads(out.read_text())
    assert "offload_optimizer" not in written["zero_optimization"] and "hybrid_engine" not in written
    assert written["zero_optimization"]["offload_param"] == {"device": "none"}  # disabled: kept
    assert written["zero_optimization"]["stage"] == 3
    expected = json.loads(json.dumps(src))
    del expected["zero_optimization"]["offload_optimizer"], expected["hybrid_engine"]
    assert {k: v for k, v in written.items() if k != "amsp"} == expected
    code, text, _ = migrate(capsys, cfg, *LAB, "--gpu-memory", "1GiB", "-o", out)
    assert "zero_optimization.offload_optimizer: removed:" in text and "hybrid_engine: removed:" in text


def test_migrate_batch_that_does_not_divide_is_one_line_without_a_derived_zero(capsys, tmp_path):
    cfg = tmp_path / "b.json"
    cfg.write_text(json.dumps({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 1}}))
    code, _, err = migrate(capsys, cfg, *LAB)  # 4 ranks: 2 // 1 // 4 would be 0 steps
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "train_batch_size=2 is not a multiple of train_micro_batch_size_per_gpu=1 x world size=4" in err
    assert "=0" not in err


# -- amsp config ----------------------------------------------------------------------------------

def test_amsp_config_accelerate_writes_a_ready_pair(capsys, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    from amsp_ext.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["config", "accelerate", "--num-processes", "4", "--num-machines", "2",
                 "--plan", "p=2x1,g=2x1,os=2x2", "-o", "sub/amsp.yaml"]) == 0
    out = capsys.readouterr().out
    yaml = tmp_path / "sub" / "amsp.yaml"
    loaded = load_config_from_file(str(yaml))  # Accelerate's own reader accepts it
    assert str(loaded.distributed_type) == "DistributedType.DEEPSPEED"
    assert (loaded.num_processes, loaded.num_machines, loaded.use_cpu) == (4, 2, False)
    ds_path = Path(loaded.deepspeed_config["deepspeed_config_file"])
    assert ds_path.is_absolute() and ds_path == tmp_path / "sub" / "amsp.ds_config.json"
    cfg = json.loads(ds_path.read_text())
    settings = AMSPSettings.from_dict(cfg["amsp"])
    assert settings.enabled and settings.plan == "p=2x1,g=2x1,os=2x2"
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["zero_optimization"] == {"stage": 0}
    assert f"accelerate launch --config_file {yaml}" in out


def test_amsp_config_deepspeed_and_its_errors(capsys, tmp_path):
    from amsp_ext.cli.main import main

    path = tmp_path / "ds.json"
    assert main(["config", "deepspeed", "--seq-len", "512", "--micro-batch-size", "2",
                 "--grad-accum", "4", "--precision", "bf16", "--gradient-clipping", "1.0",
                 "-o", str(path)]) == 0
    cfg = json.loads(path.read_text())
    assert AMSPSettings.from_dict(cfg["amsp"]).seq_len == 512 and cfg["amsp"]["plan"] == "auto"
    b = resolve_batch(cfg, 8)  # numbers: a plain DeepSpeed script can run it
    assert (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps) == (64, 2, 4)
    assert PrecisionSettings.from_ds(cfg).precision == "bf16" and gradient_clipping(cfg) == 1.0
    capsys.readouterr()
    for argv, message in [(["--plan", "p=3x1"], "amsp.plan: both 'p=' and 'os=' are required"),
                          (["--seq-len", "0"], "--seq-len must be an integer >= 1"),
                          ([], "--seq-len is required with --plan auto"),
                          (["--seq-len", "8", "--gradient-clipping", "x"], "--gradient-clipping must be 'auto' or a number")]:
        assert main(["config", "deepspeed", *argv, "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.json").exists()  # nothing written on error


# -- never a silent fallback ----------------------------------------------------------------------

def _launch_args(path, **kw):
    return types.SimpleNamespace(deepspeed_config_file=str(path), config_file="amsp.yaml",
                                 cpu=kw.get("cpu", False), use_cpu=kw.get("use_cpu", False))


def test_accelerate_launch_checks_the_ds_config_before_any_worker(tmp_path, monkeypatch):
    from amsp_ext.integrations.patches.accelerate_amsp_guard import check_launch

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    on = tmp_path / "on.json"
    on.write_text(json.dumps({"amsp": {"enabled": True, "plan": "ddp"}}))
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"amsp": {"enabled": False, "plan": "auto"}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"amsp": {"enabled": True, "plan": "zero4"}}))
    misspelt = tmp_path / "misspelt.json"
    misspelt.write_text(json.dumps({"amsp": {"enabled": "true", "plan": "ddp"}}))
    check_launch(_launch_args(on))  # nothing to say
    check_launch(_launch_args(off, cpu=True))  # AMSP not asked for: Accelerate decides
    cases = [(_launch_args(tmp_path / "nope.json"), "deepspeed_config_file"),
             (_launch_args("rel/nope.json"), "a relative path is read from the current directory"),
             (_launch_args(bad), "amsp.plan must be 'auto', a baseline name"),
             (_launch_args(misspelt), "amsp.enabled must be true or false, got 'true'"),
             (_launch_args(on, use_cpu=True), "cpu=True (use_cpu / --cpu) puts Accelerate in CPU mode")]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            check_launch(args)
        text = str(e.value.code)
        assert text.startswith("[amsp] error: ") and message in text and "\n" not in text, text
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(SystemExit, match="ACCELERATE_USE_CPU=true puts Accelerate in CPU mode"):
        check_launch(_launch_args(on))


def test_accelerator_state_without_deepspeed_stops_when_amsp_is_asked_for(monkeypatch):
    """In a worker (any launcher): ACCELERATE_USE_CPU makes AcceleratorState drop the DeepSpeed
    plugin; with amsp.enabled that is one line and SystemExit, with enabled false nothing."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, TorchDynamoPlugin

    from amsp_ext.integrations.patching import patch_accelerate

    patch_accelerate()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.delenv("RANK", raising=False)
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 0}}
    try:
        for enabled in (False, True):
            AcceleratorState._reset_state(reset_partial_state=True)
            plugin = DeepSpeedPlugin(hf_ds_config={**cfg, "amsp": {"enabled": enabled, "plan": "ddp"}})
            if not enabled:
                state = AcceleratorState(deepspeed_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
                assert str(state.distributed_type) != "DistributedType.DEEPSPEED"
                continue
            with pytest.raises(SystemExit) as e:
                AcceleratorState(deepspeed_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
            text = str(e.value.code)
            assert text.startswith("[amsp] error: the ds_config has amsp.enabled, but ACCELERATE_USE_CPU=true")
            assert "\n" not in text
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_unwrap_model_of_the_amsp_engine_is_the_users_model():
    import accelerate.accelerator
    import accelerate.utils

    from amsp_ext.integrations.engine import AMSPDeepSpeedEngine
    from amsp_ext.integrations.patching import patch_accelerate

    patch_accelerate()
    engine = AMSPDeepSpeedEngine.__new__(AMSPDeepSpeedEngine)  # no process group needed here
    torch.nn.Module.__init__(engine)
    engine.module = torch.nn.Linear(2, 2)
    for fn in (accelerate.utils.extract_model_from_parallel,
               accelerate.accelerator.extract_model_from_parallel):
        assert fn(engine) is engine.module
    plain = torch.nn.Linear(2, 2)
    assert accelerate.utils.extract_model_from_parallel(plain) is plain


# -- the training_data loader ---------------------------------------------------------------------

def test_training_data_loader_epochs_and_position():
    """set_epoch every epoch (another order, same on every rank); the saved position resumes
    the same batches; under another world size it resumes at the same sample position."""
    from amsp_ext.integrations.dataloader import AMSPDataLoader

    data = list(range(16))

    def loaders(world, bs=1):
        return [AMSPDataLoader(data, batch_size=bs, rank=r, world_size=world) for r in range(world)]

    ref = loaders(2)
    epochs = [[[int(x) for b in l for x in b] for l in ref] for _ in range(3)]
    for e in epochs:
        assert sorted(e[0] + e[1]) == data  # each epoch: every sample once over the ranks
    assert epochs[0] != epochs[1] != epochs[2]
    # DeepSpeed's own sampler setup: epoch 0's order is DistributedSampler(seed 0, epoch 0)
    from torch.utils.data import DistributedSampler

    assert epochs[0][1] == list(DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0))

    # stop after 3 batches of epoch 1, save, restore into fresh loaders: the rest is identical
    run = loaders(2)
    for l in run:
        list(l)  # epoch 0
    its = [iter(l) for l in run]
    for it in its:
        for _ in range(3):
            next(it)
    states = [l.state_dict() for l in run]
    assert states[0] == {"epoch": 1, "batches": 3, "batch_size": 1, "world_size": 2, "started": True}
    fresh = loaders(2)
    for l, st in zip(fresh, states):
        l.load_state_dict(st)
    assert [[int(x) for b in l for x in b] for l in fresh] == [e[3:] for e in epochs[1]]
    assert [[int(x) for b in l for x in b] for l in fresh] == epochs[2]  # then epoch 2

    # another world: 3 batches x 1 x 2 ranks = 6 samples consumed; 4 ranks x batch 1 -> not whole
    four = loaders(4)
    with pytest.warns(UserWarning, match="resumes at sample 4"):
        four[0].load_state_dict(states[0])
    assert four[0].state_dict()["batches"] == 1



@pytest.mark.distributed
@pytest.mark.parametrize("route", ["deepspeed",  # the slow tier runs the Trainer's route too
                                   pytest.param("trainer", marks=pytest.mark.slow)])
def test_an_old_block_warns_the_user_once_under_plain_python(route, tmp_path):
    """Under plain ``python`` (Python's default warning filters) an old-shape block loaded through
    deepspeed.initialize or the HF Trainer prints one warning line naming where the config came
    from and every moved key ([Note: renamed keys])."""
    import json
    import socket
    import sys

    from dist_utils import run_script, script_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto" if route == "trainer" else 1,
           "gradient_accumulation_steps": "auto" if route == "trainer" else 1,
           "amsp": {"enabled": True, "plan": "ddp", "cluster": {"gpus_per_node": 1}, "bucket_size": "1MiB",
                    "log_plan": False}}
    if route == "deepspeed":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    env = {**script_env(tmp_path / "site"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("PYTHONWARNINGS", None)
    script = REPO / "tests" / "scripts" / "old_amsp_block.py"
    proc = run_script([sys.executable, str(script), str(path), "--route", route], env, tmp_path, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if "amsp_ext:" in l and "deprecated" in l]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "FutureWarning" in lines[0]
    assert "amsp.cluster.gpus_per_node, amsp.bucket_size are deprecated" in lines[0], lines[0]
    origin = (f"ds_config {path.resolve()}" if route == "deepspeed"
              else f"the ds_config dict transformers passed to deepspeed.initialize from {script}")
    assert origin in lines[0], lines[0]
    assert lines[0].startswith(str(script)), lines[0]  # attributed to the user's line
