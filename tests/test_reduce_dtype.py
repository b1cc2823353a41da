"""reduce_dtype: config validation, the DeepSpeed mapping, and the bytes the planner charges
(hand-computed). The numerics are tested in test_engine_parity.py (bf16 with fp32 reduction
on every pre-filtered plan, 16-bit reduction in the extras launch)."""

from __future__ import annotations

import pytest

from amsp_ext.integrations.settings import ConfigError, PrecisionSettings, reduce_dtype_from_ds
from amsp_ext.planner.cost import comm_cost
from amsp_ext.planner.memory import memory_breakdown
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import parse_plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import SpecError, TrainingSpec, paper_job
from amsp_ext.runtime.config import ShardConfig
from planner_helpers import OPS, constant_profile


def test_shard_config_default_and_allowed_values():
    assert ShardConfig().reduce_dtype == "fp32"
    assert ShardConfig(precision="bf16").reduce_dtype == "fp32"  # see [Note: reduce_dtype defaults to fp32]
    ShardConfig(precision="bf16", reduce_dtype="bf16")
    ShardConfig(precision="fp16", reduce_dtype="fp16")
    for prec, bad in (("bf16", "fp16"), ("fp32", "bf16"), ("bf16", "float32")):
        with pytest.raises(ValueError, match=r"^config.reduce_dtype (\(with config.precision \w+\) )?must be one of fp32.*got") as e:
            ShardConfig(precision=prec, reduce_dtype=bad)
        assert "\n" not in str(e.value)
    assert (ShardConfig(precision="bf16").fingerprint()
            != ShardConfig(precision="bf16", reduce_dtype="bf16").fingerprint())


@pytest.mark.parametrize("cfg,want", [
    ({"bf16": {"enabled": True}}, "fp32"),  # absent: AMSP's default
    ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, "bf16"),
    ({"bf16": {"enabled": True}, "communication_data_type": "FP32"}, "fp32"),
    ({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}, "fp16"),
    ({"bf16": {"enabled": True}, "communication_data_type": "bf16",
      "data_types": {"grad_accum_dtype": "bf16"}}, "bf16"),
    ({}, "fp32"),
])
def test_deepspeed_keys_map_to_reduce_dtype(cfg, want):
    assert PrecisionSettings.from_ds(cfg).reduce_dtype == want


@pytest.mark.parametrize("cfg,match", [
    ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, "communication_data_type must be one of fp32, bf16"),
    ({"communication_data_type": "bf16"}, "communication_data_type must be one of fp32 with fp32"),
    ({"bf16": {"enabled": True}, "communication_data_type": "bf16",
      "data_types": {"grad_accum_dtype": "fp32"}}, "differ"),
    ({"data_types": {"grad_accum": "fp32"}}, "data_types.grad_accum: unknown key"),
])
def test_deepspeed_reduce_dtype_errors_are_one_line(cfg, match):
    with pytest.raises(ConfigError, match=match) as e:
        reduce_dtype_from_ds(cfg, PrecisionSettings._from_ds_blocks(cfg).precision)
    assert "\n" not in str(e.value)


def test_planner_charges_four_bytes_per_gradient():
    """Hand-computed: tiny-llama has 125248 parameters; bf16 gradients reduced in fp32 take 4
    bytes each in model states (G*Phi/sg) and in the bucket count e_g*Phi/(U*sp) of Tg/T0_os;
    the parameter broadcast T1_os still moves 2-byte parameters."""
    from amsp_ext.common.models import llama_config_dict

    spec = ModelSpec.from_hf_config(llama_config_dict("tiny-llama"))
    phi = spec.num_params
    assert phi == 125248
    plan = parse_plan("p=1x1,g=2x1,os=2x2")  # sg = 2, sos = 4
    kw = dict(seq_len=32, micro_batch_size=1, num_micro_batches=2, precision="bf16", bucket_bytes=4096)
    b16, b32 = TrainingSpec(**kw, reduce_dtype="bf16"), TrainingSpec(**kw, reduce_dtype="fp32")
    # not given: the engine's fp32 reduction (EngineConfig's default); the paper's job reduces
    # in the compute dtype (specs.py [Note: the paper's job])
    assert TrainingSpec(**kw).grad_dtype == "fp32"
    assert paper_job(**kw).grad_dtype == "bf16"
    m16 = memory_breakdown(spec, plan, b16, gpus_per_node=2, num_nodes=2)
    m32 = memory_breakdown(spec, plan, b32, gpus_per_node=2, num_nodes=2)
    assert m16.grads == 2 * phi // 2 and m32.grads == 4 * phi // 2
    assert m32.params == m16.params == 2 * phi
    # a constant-bandwidth profile: with U fixed, a term's time is proportional to its buckets
    timer = CommTimer(constant_profile(2, 2, {op: 1.0 for op in OPS}), gpus_per_node=2)
    c16 = comm_cost(plan, spec, b16, timer, gpus_per_node=2, num_nodes=2, num_micro_batches=2)
    c32 = comm_cost(plan, spec, b32, timer, gpus_per_node=2, num_nodes=2, num_micro_batches=2)
    # Tg and T0_os: twice the buckets of the same size U -> exactly twice the time
    assert c32.t_g == pytest.approx(2 * c16.t_g) and c32.t0_os == pytest.approx(2 * c16.t0_os)
    assert c32.t1_os == c16.t1_os > 0 and c32.t_p == c16.t_p == 0
    with pytest.raises(SpecError, match="reduce_dtype must be one of fp32, bf16, got .fp16."):
        TrainingSpec(**{**kw, "precision": "bf16"}, reduce_dtype="fp16")
