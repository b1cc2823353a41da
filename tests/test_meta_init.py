"""A model built on meta starts (runtime/materialize.py): weights from the seed or from files,
the same bits under every plan and world size, and training that matches one process.

References are independent of the engine: the full weights of a 1-rank run and of the other
plans (seeded), the files themselves (init_from), and plain PyTorch AdamW on one process over
the same global batches (losses within 1e-6 relative) and ``from_pretrained`` (round trip).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from parity_check import M, adamw, batches

pytestmark = pytest.mark.distributed

PLANS = ["zero3", "mics:2", "p=2x1,g=2x1,os=2x2", "ddp"]
SHARDED = {"zero3", "mics:2", "p=2x1,g=2x1,os=2x2"}
BF16 = ["zero3@bf16", "p=1x1,g=1x1,os=2x2@bf16"]  # the masters come from the fp32 rows, unrounded


def _tag(plan: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", plan)


def _config():
    from transformers import LlamaConfig

    from amsp_ext.common.models import llama_config_dict

    cfg = LlamaConfig(**{k: v for k, v in llama_config_dict("tiny-llama").items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    return cfg


def _weights(outdir: Path, plan: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(outdir / _tag(plan) / "weights.safetensors"))


def _rank_results(outdir: Path, plan: str, nproc: int = 4) -> list[dict]:
    return [json.loads((outdir / _tag(plan) / f"rank{r}.json").read_text()) for r in range(nproc)]


def _reference_losses(weights: "dict[str, torch.Tensor] | Path", world: int, steps: int = 2) -> list[float]:
    """Plain PyTorch, one process, the global batch of every step, from ``weights`` (a folder:
    transformers' own ``from_pretrained``)."""
    from transformers import LlamaForCausalLM

    from amsp_ext.common.models import causal_lm_loss

    if isinstance(weights, Path):
        model = LlamaForCausalLM.from_pretrained(weights, attn_implementation="eager")
    else:
        model = LlamaForCausalLM(_config())
        model.load_state_dict(weights, strict=True)
    opt = adamw(list(model.parameters()))
    losses = []
    for step in range(steps):
        total = 0.0
        for b in batches(step, world):
            loss = causal_lm_loss(model, b) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses


def _eval_loss_from_pretrained(folder: Path) -> float:
    from transformers import LlamaForCausalLM

    from amsp_ext.common.models import causal_lm_loss
    from meta_init_worker import eval_batch

    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        return float(causal_lm_loss(model, eval_batch()))


def _check_losses_and_round_trip(outdir: Path, plan: str, ref: list[float]) -> None:
    res = _rank_results(outdir, plan)
    for got, want in zip(res[0]["losses"], ref):
        assert abs(got - want) <= 1e-6 * abs(want), (plan, res[0]["losses"], ref)
    hf = outdir / _tag(plan) / "hf"
    files = sorted(p.name for p in hf.glob("*.safetensors"))
    assert len(files) >= 3 and (hf / "model.safetensors.index.json").is_file(), (plan, files)
    got = _eval_loss_from_pretrained(hf)
    assert abs(got - res[0]["eval_loss"]) <= 1e-6 * abs(got), (plan, got, res[0]["eval_loss"])


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_seeded")
    run_ranks(4, "tests.meta_init_worker", str(out / "w4"), "2", ";".join(PLANS + BF16), timeout=400)
    run_ranks(1, "tests.meta_init_worker", str(out / "w1"), "1", "ddp", timeout=200)
    return out, _reference_losses(_weights(out / "w1", "ddp"), world=4)


def test_seeded_weights_are_the_same_bits_under_every_plan_and_world(seeded):
    seeded, _ = seeded
    one_rank = _weights(seeded / "w1", "ddp")
    assert len(one_rank) == 21
    for plan in PLANS + BF16:
        w = _weights(seeded / "w4", plan)
        assert w.keys() == one_rank.keys()
        differ = [k for k in w if not torch.equal(w[k], one_rank[k])]
        assert not differ, (plan, differ)
    # the model's own initializer ran (HF Llama: N(0, 0.02) linears, ones in the norms)
    assert abs(float(one_rank["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 2e-3
    assert torch.equal(one_rank["model.norm.weight"], torch.ones(64))
    # a different module name draws different numbers
    assert not torch.equal(one_rank["model.layers.0.self_attn.o_proj.weight"],
                           one_rank["model.layers.1.self_attn.o_proj.weight"])


@pytest.mark.parametrize("plan", PLANS)
def test_seeded_training_matches_one_process_and_round_trips(seeded, plan):
    out, ref = seeded
    _check_losses_and_round_trip(out / "w4", plan, ref)


@pytest.fixture(scope="module")
def from_files(tmp_path_factory):
    """A 3-file Hugging Face folder written by transformers' own save_pretrained."""
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("meta_init_from")
    torch.manual_seed(7)
    LlamaForCausalLM(_config()).save_pretrained(out / "src", max_shard_size="200KB")
    run_ranks(4, "tests.meta_init_worker", str(out / "w4"), "2", ";".join(PLANS), str(out / "src"),
              timeout=400)
    return out, _reference_losses(out / "src", world=4)


def _files(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_init_from_a_sharded_folder_reads_the_files_exactly(from_files):
    from_files, _ = from_files
    src = from_files / "src"
    assert len(list(src.glob("*.safetensors"))) >= 3
    files = _files(src)
    for plan in PLANS:
        w = _weights(from_files / "w4", plan)
        differ = [k for k in files if not torch.equal(w[k], files[k])]
        assert not differ, (plan, differ)


@pytest.mark.parametrize("plan", PLANS)
def test_init_from_trains_like_from_pretrained(from_files, plan):
    out, ref = from_files
    _check_losses_and_round_trip(out / "w4", plan, ref)


@pytest.mark.parametrize("plan", sorted(SHARDED))
def test_init_from_allocates_no_full_parameter_a_sharded_plan_does_not_keep(from_files, plan):
    """Every tensor any op touched during shard() lives in a storage smaller than the largest
    parameter (the (256, 64) embedding, 64 KiB in fp32), which these plans keep a shard of:
    reading it whole and cutting it (a full-tensor read) fails this."""
    for r, res in enumerate(_rank_results(from_files[0] / "w4", plan)):
        op, shape, nbytes = res["largest_storage"]
        assert res["largest_sharded_param_bytes"] == 256 * 64 * 4, (plan, r)
        assert nbytes < res["largest_sharded_param_bytes"], (plan, r, op, shape, nbytes)


def test_init_from_an_amsp_checkpoint_of_another_plan_and_world(seeded, tmp_path):
    """The 4-rank p=2x1,g=2x1,os=2x2 run's checkpoint starts a 2-rank zero3 run: its initial
    weights are the first run's trained ones, gathered there with collectives."""
    from meta_init_worker import CHECKPOINTED

    out, _ = seeded
    src = out / "w4" / _tag(CHECKPOINTED)
    run_ranks(2, "tests.meta_init_worker", str(tmp_path), "2", "zero3", str(src / "ckpt"), timeout=200)
    got, want = _weights(tmp_path, "zero3"), _weights_file(src / "trained.safetensors")
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert not torch.equal(want["lm_head.weight"], _weights(out / "w1", "ddp")["lm_head.weight"])  # trained


def _weights_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
