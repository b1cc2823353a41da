"""``init_from`` refuses a bad or hostile folder in one line naming the tensor or file, before
any collective (runtime/state/safetensors_folder.py [Note: an untrusted folder])."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from amsp_ext.runtime.state.init_source import expected_tensors, open_init_source
from amsp_ext.runtime.state.safetensors_folder import CheckpointFolderError, SafetensorsFolder


def _meta_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from amsp_ext.common.models import llama_config_dict

    cfg = LlamaConfig(**{k: v for k, v in llama_config_dict("tiny-llama").items() if k != "architectures"})
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def model():
    return _meta_model()


def _good_tensors(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g) for k, (shape, _) in expected_tensors(model).items()}


def _write(folder, tensors, name="model.safetensors"):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name))
    return folder


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_a_good_folder_reads_rows_exactly(model, tmp_path):
    t = _good_tensors(model)
    src = open_init_source(_write(tmp_path / "ok", t), model)
    w = t["model.embed_tokens.weight"]
    assert torch.equal(src.rows("model.embed_tokens.weight", 64, 128), w[64:128])
    assert torch.equal(src.rows("model.embed_tokens.weight"), w)
    bf = _write(tmp_path / "bf16", {k: v.to(torch.bfloat16) for k, v in t.items()})
    got = open_init_source(bf, model).rows("lm_head.weight", 3, 5)
    assert got.dtype == torch.float32 and torch.equal(got, t["lm_head.weight"][3:5].to(torch.bfloat16).float())


@pytest.mark.parametrize("how,match", [
    ("missing", r"tensor 'model.norm.weight' is missing"),
    ("extra", r"tensor 'extra.weight' is not in the model"),
    ("shape", r"tensor 'lm_head.weight' has shape \[255, 64\], the model's is \[256, 64\]"),
    ("dtype", r"tensor 'model.norm.weight' has dtype I64; allowed: float16, bfloat16, float32"),
])
def test_names_shapes_and_dtypes_are_checked(model, tmp_path, how, match):
    t = _good_tensors(model)
    if how == "missing":
        del t["model.norm.weight"]
    elif how == "extra":
        t["extra.weight"] = torch.zeros(2)
    elif how == "shape":
        t["lm_head.weight"] = torch.zeros(255, 64)
    else:
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(CheckpointFolderError, match=match) as e:
        open_init_source(_write(tmp_path / how, t), model)
    _one_line(e)


def test_several_differences_are_counted(model, tmp_path):
    t = _good_tensors(model)
    del t["model.norm.weight"], t["lm_head.weight"]
    with pytest.raises(CheckpointFolderError, match=r"is missing \(and 1 other difference\(s\)\)"):
        open_init_source(_write(tmp_path / "two", t), model)


def _indexed(tmp_path, model, target: str):
    t = _good_tensors(model)
    folder = _write(tmp_path / "idx", t, "model-00001-of-00001.safetensors")
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in t}}
    index["weight_map"]["lm_head.weight"] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("target,match", [
    ("model-00002-of-00002.safetensors", r"names file 'model-00002-of-00002.safetensors', which does not exist"),
    ("../x.safetensors", r"names file '../x.safetensors', which is not a plain name"),
    ("/etc/passwd.safetensors", r"names file '/etc/passwd.safetensors', which is not a plain name"),
    ("weights.bin", r"names file 'weights.bin'; only .safetensors files are read"),
])
def test_an_index_cannot_point_outside_the_folder(model, tmp_path, target, match):
    with pytest.raises(CheckpointFolderError, match=match) as e:
        open_init_source(_indexed(tmp_path, model, target), model)
    _one_line(e)


def test_a_link_leaving_the_folder_is_refused(model, tmp_path):
    outside = _write(tmp_path / "elsewhere", {"lm_head.weight": torch.zeros(256, 64)}, "secret.safetensors")
    folder = _indexed(tmp_path, model, "link.safetensors")
    os.symlink(outside / "secret.safetensors", folder / "link.safetensors")
    with pytest.raises(CheckpointFolderError, match=r"names file 'link.safetensors', which leaves .* \(a link to "):
        open_init_source(folder, model)


def test_truncated_and_lying_headers_are_refused(model, tmp_path):
    folder = _write(tmp_path / "trunc", _good_tensors(model))
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointFolderError, match=r"model.safetensors: tensor '.*' claims bytes \d+\.\.\d+ of a "
                                                    r"\d+-byte data section .*truncated") as e:
        SafetensorsFolder(folder)
    _one_line(e)
    f.write_bytes(struct.pack("<Q", len(data) * 4) + data[8:])
    with pytest.raises(CheckpointFolderError, match=r"header of \d+ bytes runs past the end of the file"):
        SafetensorsFolder(folder)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointFolderError, match=r"truncated safetensors file \(2 bytes, no header\)"):
        SafetensorsFolder(folder)


def test_pickles_are_refused_with_the_conversion(model, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(CheckpointFolderError, match=r"pytorch_model.bin is a pickle, which amsp never loads.*"
                                                    r"safe_serialization=True") as e:
        open_init_source(folder, model)
    _one_line(e)


def test_shard_refuses_a_bad_folder_before_any_collective(tmp_path):
    """In one gloo process: the error comes from shard() and the engine's context counted no
    collective (the fingerprint all-gather is the first)."""
    import torch.distributed as dist

    import amsp_ext
    from amsp_ext.runtime import collectives as C

    model = _meta_model()
    t = _good_tensors(model)
    del t["model.layers.1.mlp.up_proj.weight"]
    folder = _write(tmp_path / "bad", t)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        comm = C.CollectiveContext(timeout=30)
        with pytest.raises(CheckpointFolderError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
            amsp_ext.shard(model, "zero3", lambda ps: torch.optim.AdamW(ps), init_from=folder, comm=comm)
        assert sum(comm.counts.values()) == 0, comm.counts
        with pytest.raises(ValueError, match=r"parameter 'model.embed_tokens.weight' is on meta but 'lm_head.weight' "
                                             r"is not"):
            mixed = _meta_model()
            mixed.lm_head.weight = torch.nn.Parameter(torch.zeros(256, 64))
            amsp_ext.shard(mixed, "zero3", lambda ps: torch.optim.AdamW(ps), comm=comm)
        assert sum(comm.counts.values()) == 0, comm.counts

        class Scale(torch.nn.Module):  # a raw parameter and no reset_parameters()
            def __init__(self):
                super().__init__()
                self.gain = torch.nn.Parameter(torch.ones(4))

        with torch.device("meta"):
            custom = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
        with pytest.raises(ValueError, match=r"module '1' \(Scale\) holds tensors on meta but has no "
                                             r"reset_parameters\(\)"):
            amsp_ext.shard(custom, "ddp", lambda ps: torch.optim.AdamW(ps), comm=comm)
        assert sum(comm.counts.values()) == 0, comm.counts
    finally:
        dist.destroy_process_group()
