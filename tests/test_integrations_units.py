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
from pathlib import Path

import pytest
import torch

from amsp_ext.integrations.settings import (
    AMSPSettings, PrecisionSettings, amsp_enabled, gradient_clipping, resolve_batch,
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
    ({"enabled": True, "plan": "ddp", "cluster": {"gpus": 8}}, "amsp.cluster.gpus: unknown key"),
    ({"enabled": True, "plan": "ddp", "cluster": {"gpus_per_node": 0}}, "amsp.cluster.gpus_per_node must be an integer >= 1"),
    ({"enabled": True, "plan": "ddp", "cluster": {"gpu_memory": "80"}}, "amsp.cluster.gpu_memory needs"),
    ({"enabled": True, "plan": "ddp", "cluster": [8]}, "amsp.cluster must be an object"),
    ({"enabled": True, "plan": "ddp", "objective": "fast"}, "amsp.objective must be one of comm, step"),
    ({"enabled": True, "plan": "ddp", "missing_mesh": "guess"}, "amsp.missing_mesh must be one of error, fit"),
    ({"enabled": True, "plan": "ddp", "granularity": "tensor"}, "amsp.granularity must be one of module, layer"),
    ({"enabled": True, "plan": "ddp", "timeout": 0}, "amsp.timeout must be a number of seconds > 0"),
    ({"enabled": True, "plan": "ddp", "bucket": 5}, "amsp.bucket: unknown key; allowed: enabled, plan"),
    ({"enabled": True, "plan": "ddp", "bucket_size": "25XB"}, "amsp.bucket_size: unknown unit"),
    ({"enabled": True, "plan": "ddp", "recompute": "no"}, "amsp.recompute must be true or false"),
]


@pytest.mark.parametrize("block,message", BAD_BLOCKS)
def test_bad_amsp_block_is_one_line_naming_the_field(block, message):
    with pytest.raises(ValueError) as e:
        AMSPSettings.from_dict(block)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_amsp_block_forms():
    s = AMSPSettings.from_dict({"enabled": True, "plan": {"p": [2, 1], "os": [2, 2]},
                                "cluster": {"gpus_per_node": 2, "gpu_memory": "1GiB"},
                                "bucket_size": "4MiB", "overlap": {"broadcast": False}})
    assert s.plan == "p=2x1,os=2x2"
    assert s.cluster.gpu_memory_bytes == 2**30 and s.bucket_bytes == 4 * 2**20
    assert (s.overlap.allgather, s.overlap.allreduce, s.overlap.broadcast) == (True, True, False)
    assert AMSPSettings.from_dict(s.to_dict()) == s  # what migrate writes loads back
    assert AMSPSettings.from_dict({"enabled": False, "plan": "auto"}).plan == "auto"  # off: no seq_len needed
    assert amsp_enabled({"amsp": {"enabled": True}}) and not amsp_enabled({"amsp": {"enabled": "true"}})
    assert not amsp_enabled({})


def test_initialize_rejects_a_bad_config_before_any_collective():
    """torch.distributed is not initialised here: the config error must come first."""
    import torch.distributed as dist

    import amsp_ext
    from amsp_ext.models import build_llama

    assert not dist.is_initialized()
    model = build_llama("tiny-llama")
    for cfg, message in [
        ({"train_batch_size": 8, "amsp": {"enabled": True, "plan": "zero9"}}, "amsp.plan must be"),
        ({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": True},
          "amsp": {"enabled": True, "plan": "ddp"}}, "bf16.enabled and fp16.enabled are both true"),
        ({"train_batch_size": 8, "gradient_clipping": -1, "amsp": {"enabled": True, "plan": "ddp"}},
         "gradient_clipping must be a number >= 0"),
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
    ({"train_batch_size": 2}, "train_batch_size=2 must equal"),  # 2 // 4 = 0 per rank
])
def test_bad_batch_keys(cfg, message):
    with pytest.raises(ValueError, match=message):
        resolve_batch(cfg, 4)


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
    from amsp_ext.models import build_llama

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

    from patches import deepspeed_initialize as patch

    calls = []

    def original(**kw):
        calls.append(("deepspeed", kw["config"] if kw["config"] is not None else kw["args"].deepspeed_config))
        return "deepspeed-engine"

    monkeypatch.setattr(deepspeed, "initialize", original)
    assert patch.apply().startswith("applied")
    assert patch.apply() == "already applied"
    import amsp_ext.integrations.ds_initialize as amsp_init

    monkeypatch.setattr(amsp_init, "initialize", lambda **kw: ("amsp", kw["config"]["amsp"]["plan"]))
    off = {"train_batch_size": 8, "amsp": {"enabled": False, "plan": "zero3"}}
    on = {"train_batch_size": 8, "amsp": {"enabled": True, "plan": "zero3"}}
    assert deepspeed.initialize(model=None, config=off) == "deepspeed-engine"
    assert deepspeed.initialize(model=None, config={"train_batch_size": 8}) == "deepspeed-engine"
    assert deepspeed.initialize(model=None, config=on, dist_init_required=False) == ("amsp", "zero3")
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

    from patches import accelerate_amsp_block

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

    from patches import accelerate_amsp_block

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

def test_startup_reason(monkeypatch, tmp_path):
    from amsp_ext.integrations import startup

    for k in ("AMSP_PATCH_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(k, raising=False)
    assert startup.reason() is None
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    on.write_text(json.dumps({"amsp": {"enabled": True}}))
    off.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(on))
    assert startup.reason() is None  # not a DeepSpeed-type launch
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert "has amsp.enabled" in startup.reason()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(off))
    assert startup.reason() is None
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "missing.json"))
    assert startup.reason() is None
    monkeypatch.setenv("AMSP_PATCH_DEEPSPEED", "1")
    assert startup.reason() == "AMSP_PATCH_DEEPSPEED=1"


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


def _run_pth_line(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AMSP_PATCH_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")}
    env.update(env_extra, PYTHONPATH=str(REPO))
    code = ("import sys; exec(open(sys.argv[1]).read()); import json; "
            "s = sys.modules.get('amsp_ext.integrations.startup'); "
            "print(json.dumps({'imported_amsp': 'amsp_ext' in sys.modules, "
            "'active': getattr(s, '_active', None), 'torch': 'torch' in sys.modules}))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "amsp_ext" / "integrations" / "amsp_ext_startup.pth")],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_startup_pth_costs_nothing_unless_asked():
    assert _run_pth_line({}) == {"imported_amsp": False, "active": None, "torch": False}
    got = _run_pth_line({"AMSP_PATCH_DEEPSPEED": "1"})
    assert got == {"imported_amsp": True, "active": "AMSP_PATCH_DEEPSPEED=1", "torch": False}


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
    from amsp_ext.models import llama_config_dict

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
    assert block.enabled and block.plan == str(best.plan) and block.cluster.gpus_per_node == 2
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
