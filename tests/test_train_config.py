"""TrainConfig: the `amsp train` flags are generated from it, it travels to the ranks as JSON, and
the worker's ShardConfig and optimizer follow from it. Bad values: one line naming the flag."""

import argparse
import dataclasses
import json

import pytest
import torch

from amsp_ext import choices, schema
from amsp_ext.cli import main as cli_main
from amsp_ext.cli import train as cli_train
from amsp_ext.train.config import TrainConfig


def parse(argv):
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    return schema.from_namespace(TrainConfig, p.parse_args(argv))


def test_no_flags_is_the_dataclass_default():
    assert parse([]) == TrainConfig()


@pytest.mark.parametrize("argv", [
    [],
    ["--model", "small-llama", "--plan", "auto", "--seed", "3", "--gpus-per-node", "2",
     "--nodes-per-leaf", "1", "--profile", "configs/clusters/lab-2x2.profile.json",
     "--gpu-memory", "4MiB", "--memory-reserve", "0B", "--objective", "step", "--steps", "7", "--micro-batches", "3",
     "--micro-batch-size", "1", "--seq-len", "1024", "--lr", "1e-4", "--warmup-steps", "0",
     "--clip", "0", "--weight-decay", "0.01", "--beta1", "0.8", "--beta2", "0.999",
     "--precision", "bf16", "--grad-bucket-bytes", "256KiB", "--granularity", "module", "--recompute",
     "--no-overlap-allgather", "--no-overlap-broadcast", "--timeout", "30", "--json"],
])
def test_argv_to_config_to_json_and_back(argv):
    config = parse(argv)
    text = schema.to_json(config)
    assert schema.from_json(TrainConfig, text) == config
    assert json.loads(text) == schema.to_dict(config)
    if argv:  # every flag above moved its field off the default (hand-written values)
        d = schema.to_dict(config)
        assert d["batch"] == {"steps": 7, "num_micro_batches": 3, "micro_batch_size": 1, "seq_len": 1024}
        assert d["engine"]["overlap"] == {"allgather": False, "allreduce": True, "broadcast": False}
        assert d["engine"]["grad_bucket_bytes"] == 256 * 1024
        assert d["engine"]["recompute"] is True and d["output"]["json"] is True
        assert d["optim"]["beta2"] == 0.999 and d["planner"]["gpu_memory"] == "4MiB"
        assert config.planner.gpu_memory_bytes == 4 * 2**20 and config.planner.memory_reserve_bytes == 0


def test_every_option_is_a_flag_with_help_and_names_are_unique():
    flags = [schema.flag_of(f) for _, f in schema.options(TrainConfig)]
    assert len(flags) == len(set(flags))
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    text = p.format_help()
    for flag in flags:
        assert flag in text
    # the flags the README and the tests use
    for flag in ("--plan", "--gpu-memory", "--memory-reserve", "--micro-batches", "--overlap-allgather",
                 "--grad-bucket-bytes", "--granularity", "--recompute", "--precision", "--json"):
        assert flag in flags


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--micro-batches", "0"], "--micro-batches must be an integer >= 1, got 0"),
    (["--micro-batch-size", "-1"], "--micro-batch-size must be an integer >= 1, got -1"),
    (["--seq-len", "513"], "--seq-len must be <= 512 for tiny-llama, got 513"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0, got -1"),
    (["--lr", "0"], "--lr must be a number > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be a number > 0, got nan"),
    (["--clip", "-1"], "--clip must be a number >= 0, got -1.0"),
    (["--beta2", "1"], "--beta2 must be a number >= 0 and < 1, got 1.0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a number >= 0, got -0.1"),
    (["--grad-bucket-bytes", "0"], "--grad-bucket-bytes must be an integer >= 1, got 0"),
    (["--grad-bucket-bytes", "1e308"], "--grad-bucket-bytes needs a number and a unit"),
    (["--grad-bucket-bytes", "100000000000GiB"], "--grad-bucket-bytes must be at most 8 EiB"),
    (["--timeout", "0"], "--timeout must be a number > 0 and < 3.1536e+07, got 0.0"),
    (["--timeout", "1e308"], "--timeout must be a number > 0 and < 3.1536e+07, got 1e+308"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1, got 0"),
    (["--gpu-memory", "4"], "--gpu-memory needs a number and a unit"),
    (["--memory-reserve=-1B"], "--memory-reserve must be >= 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
])
def test_a_bad_value_is_one_line_naming_the_flag(argv, message, capsys):
    assert cli_main.main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("amsp train: error: " + message), err


def test_choices_are_refused_by_the_parser_with_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        cli_main.main(["train", "--precision", "fp8"])
    assert "--precision: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')" in capsys.readouterr().err


def test_json_with_an_unknown_or_bad_key_is_refused():
    good = schema.to_dict(TrainConfig())
    with pytest.raises(ValueError, match=r"^config\.engine\.no_such: unknown key; allowed: gpus_per_node"):
        schema.from_dict(TrainConfig, {**good, "engine": {**good["engine"], "no_such": 1}})
    with pytest.raises(ValueError, match=r"^config\.engine\.precision must be one of fp32, bf16, fp16, got 'fp8'"):
        schema.from_dict(TrainConfig, {**good, "engine": {**good["engine"], "precision": "fp8"}})
    with pytest.raises(ValueError, match=r"^config\.batch\.steps must be an integer >= 1, got True"):
        schema.from_dict(TrainConfig, {"batch": {"steps": True}})
    # a JSON number without a fraction is still a float option
    assert schema.from_dict(TrainConfig, {"optim": {"lr": 1}}).optim.lr == 1.0


def test_worker_config_and_optimizer_follow_the_fields():
    from amsp_ext.runtime.config import compute_dtype
    from amsp_ext.train.config import shard_config
    from amsp_ext.train.loop import optimizer_factory

    config = parse(["--precision", "bf16", "--grad-bucket-bytes", "512KiB", "--granularity", "layer",
                    "--recompute", "--no-overlap-broadcast", "--timeout", "12",
                    "--gpus-per-node", "2", "--gpu-memory", "4MiB", "--memory-reserve", "0B",
                    "--objective", "step",
                    "--seq-len", "64", "--micro-batches", "3", "--micro-batch-size", "1",
                    "--weight-decay", "0.05", "--beta1", "0.8", "--beta2", "0.99", "--lr", "0.01"])
    sc = shard_config(config)
    assert (sc.precision, sc.grad_bucket_bytes, sc.granularity, sc.recompute, sc.timeout) == \
        ("bf16", 524288, "layer", True, 12.0)
    assert (sc.overlap.allgather, sc.overlap.allreduce, sc.overlap.broadcast) == (True, True, False)
    assert sc.gpus_per_node == 2 and compute_dtype(sc) == torch.bfloat16
    assert (sc.auto.seq_len, sc.auto.num_micro_batches, sc.auto.micro_batch_size) == (64, 3, 1)
    assert (sc.auto.gpu_memory_bytes, sc.auto.memory_reserve_bytes) == (4 * 2**20, 0)
    assert (sc.auto.objective, sc.auto.missing) == ("step", "fit")
    opt = optimizer_factory(config)([torch.nn.Parameter(torch.zeros(2))])
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.99), 0.05)


def test_overlap_switches_are_the_shared_op_names():
    from amsp_ext.runtime.config import OverlapConfig

    assert tuple(f.name for f in dataclasses.fields(OverlapConfig)) == choices.OVERLAP_OPS


def test_every_sections_field_is_an_option_or_a_section():
    def walk(cls):
        for f in dataclasses.fields(cls):
            t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if t is not None and dataclasses.is_dataclass(t):
                yield from walk(t)
            else:
                yield cls, f
    from amsp_ext.engine_config import EngineConfig

    # the two sub-configs every route fills from its own job shape (train: --seq-len ...), and
    # the meta-init seed, which amsp train fills from its --seed
    filled = {(EngineConfig, "auto"), (EngineConfig, "adaptive"), (EngineConfig, "init_seed")}
    for cls, f in walk(TrainConfig):
        if (cls, f.name) in filled:
            continue
        assert (cls, f) in schema.options(TrainConfig), f"{cls.__name__}.{f.name} is not an option()"
