"""ClusterSpec / TrainingSpec validation and the memory-size parser."""

import pytest

from amsp_ext.planner.specs import ClusterSpec, SpecError, TrainingSpec, parse_size


@pytest.mark.parametrize("text,value", [
    ("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("81920MiB", 80 * 2**30), ("1.5TB", 1.5e12),
    ("512 kib", 512 * 1024), ("100B", 100),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text,match", [
    ("80", "needs a number and a unit"), (80, "needs a unit"), ("80GiBs", "unknown unit"),
    ("-5GiB", "must be positive"), ("0GB", "must be positive"), ("GiB", "needs a number"),
])
def test_parse_size_refuses(text, match):
    with pytest.raises(SpecError, match=match) as e:
        parse_size(text, field="--gpu-memory")
    assert "\n" not in str(e.value)


def test_cluster_spec_fields():
    c = ClusterSpec(num_nodes=4, gpus_per_node=8, gpu_memory_bytes=2**30)
    assert c.world_size == 32
    for kw, match in [({"num_nodes": 0}, "num_nodes"), ({"gpus_per_node": -1}, "gpus_per_node"),
                      ({"gpu_memory_bytes": -5}, "gpu_memory_bytes"),
                      ({"peak_flops": 0}, "peak_flops"),
                      ({"nodes_per_leaf": 3}, "nodes_per_leaf=3 must divide num_nodes=4")]:
        args = dict(num_nodes=4, gpus_per_node=8, gpu_memory_bytes=2**30) | kw
        with pytest.raises(SpecError, match=match):
            ClusterSpec(**args)
    with pytest.raises(TypeError):
        ClusterSpec(4, 8, 2**30)  # kw-only


def test_micro_batches():
    t = TrainingSpec(seq_len=4096, global_batch_tokens=4 * 2**20)
    assert t.micro_batches(1024) == 1
    assert t.micro_batches(8) == 128
    assert TrainingSpec(seq_len=8, micro_batch_size=2, global_batch_size=64).micro_batches(4) == 8
    assert TrainingSpec(seq_len=8, num_micro_batches=3).micro_batches(4096) == 3
    with pytest.raises(SpecError, match="must be a multiple of micro_batch_size x world size") as e:
        t.micro_batches(3 * 8)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,match", [
    ({"global_batch_tokens": 64, "num_micro_batches": 2}, "give at most one of"),
    ({"global_batch_tokens": 8, "global_batch_size": 1}, "give at most one of"),
    ({"global_batch_tokens": 100}, "not a multiple of seq_len"),
    ({"global_batch_size": -4}, "global_batch_size must be an integer >= 1"),
    ({"num_micro_batches": 1, "precision": "fp8"}, "precision must be one of fp32, bf16, fp16"),
    ({"num_micro_batches": 1, "optimizer": "adam"}, "optimizer must be one of adamw"),
    ({"num_micro_batches": 1, "granularity": "tensor"}, "granularity must be one of module, layer"),
    ({"num_micro_batches": 1, "bucket_bytes": 0}, "bucket_bytes"),
    ({"num_micro_batches": 1, "micro_batch_size": 0}, "micro_batch_size"),
])
def test_training_spec_errors(kw, match):
    with pytest.raises(SpecError, match=match):
        TrainingSpec(seq_len=64, **kw)
