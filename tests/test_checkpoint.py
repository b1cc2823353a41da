"""Checkpoints: save under one plan and world size, load under another, and the next steps'
losses equal those of the saving run continuing without the checkpoint. Three torchrun launches
(tests/checkpoint_worker.py): 4 ranks (save, same-world loads, HF export, errors), 8 ranks (4 -> 8
loads, save), 4 ranks (8 -> 4 loads). Plus in-process tests of the offline export and errors.

[Note: tolerances]
fp32: 1e-6 relative on the two losses after the load (the brief). Observed: 0 (bit-exact),
even across world sizes: the parameters, masters and Adam states are restored bit-for-bit
(checked directly: consolidated weights max-abs difference 0), so the first loss after the
load is the same forward; the second differs only if the plans' different gradient summation
orders change a rounded parameter, and on tiny-llama the ~1e-7 relative gradient differences
are below the parameters' fp32 resolution after Adam's lr-scaled update. The negative controls
(optimizer state dropped, LR schedule dropped after loading) move the second loss by > 1e-5,
so the bound can fail. bf16/fp16 across plans: 1e-4 relative (observed ~2e-6: compute-dtype
gradients summed in another order); the same plan is bit-exact in every precision.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_utils import run_ranks

FP32_TOL, LOW_PRECISION_TOL = 1e-6, 1e-4


def _results(proc) -> dict:
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out.setdefault(r["case"], {})[r["rank"]] = r
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    res = {}
    for nproc, suite in ((4, "save4"), (8, "cross8"), (4, "cross4")):
        res.update(_results(run_ranks(nproc, "tests.checkpoint_worker", suite, str(root), timeout=300)))
    return root, res


def _case(runs, name):
    return runs[1][name][0]


def _cases(runs, prefix):
    return {k: v[0] for k, v in runs[1].items() if k.startswith(prefix)}


def _restored(r, *, same_scaler=True):
    assert r["weights_max_abs_diff"] == 0.0, r  # params + masters, bit-for-bit
    assert r["params_vs_masters_max_abs_diff"] == 0.0, r  # every replica = its master, rounded
    assert r["num_steps"] == 2 and r["lr"] == r["lr_at_save"], r
    assert r["extra"]["step"] == 2, r
    if same_scaler:  # the fp16 loss scale continues from the saved one
        assert r["scale_after"] == r["ref_scale_after"], r


pytestmark = pytest.mark.distributed


def test_same_plan_round_trip_is_bit_exact(runs):
    cases = [c for c in runs[1] if "same-plan" in c]
    assert len(cases) == 3  # fp32, bf16, fp16
    for c in cases:
        r = _case(runs, c)
        _restored(r)
        assert r["bit_exact"], r
    assert _case(runs, "same-plan:p=2x1,g=2x1,os=2x2")["rng_restored"] is True
    assert _case(runs, "fp16-same-plan:p=2x1,g=2x2,os=2x2")["scale"] == 1024.0  # 256 grown twice


@pytest.mark.parametrize("case", ["sp1-sos4:p=1x1,g=1x1,os=2x2", "sp4-sos4:p=2x2,g=2x2,os=2x2", "ddp:ddp",
                                  "tied-frozen-sp2:p=2x1,g=2x1,os=2x2",
                                  "adafactor-same-sp:p=1x1,g=1x1,os=2x1"])
def test_other_plan_same_world(runs, case):
    r = _case(runs, case)
    _restored(r)
    assert r["loss_rel_diff"] <= FP32_TOL, r


@pytest.mark.parametrize("case", ["bf16-sp1-sos4:p=1x1,g=1x1,os=2x2", "fp16-sp1:p=1x1,g=1x1,os=2x2"])
def test_other_plan_mixed_precision(runs, case):
    r = _case(runs, case)
    _restored(r)
    assert r["first_loss_rel_diff"] <= FP32_TOL, r  # same bf16/fp16 weights, same forward
    assert r["loss_rel_diff"] <= LOW_PRECISION_TOL, r


@pytest.mark.parametrize("case", ["bf16-to-fp32:p=2x2,g=2x2,os=2x2", "fp32-to-bf16:p=2x1,g=2x2,os=2x2",
                                  "bf16-to-fp16:p=1x1,g=1x1,os=2x2"])
def test_precision_change_goes_through_the_fp32_masters(runs, case):
    r = _case(runs, case)
    _restored(r, same_scaler=False)  # the fp32 weights are the saving run's fp32 masters, exactly
    assert r["loss_rel_diff"] <= 1e-3, r  # another compute dtype than the saving run


@pytest.mark.parametrize("direction,num_cases", [("4to8:", 2), ("8to4:", 2)])
def test_other_world_size(runs, direction, num_cases):
    cases = _cases(runs, direction)
    assert len(cases) == num_cases
    for c, r in cases.items():
        _restored(r)
        assert r["saved_world"] != int(direction[-2]), r
        assert r["loss_rel_diff"] <= FP32_TOL, (c, r)
        assert any("RNG states not restored" in w for w in r["warnings"]), r


@pytest.mark.parametrize("case", ["whole-adafactor:p=1x1,g=1x1,os=2x1", "whole-adafactor:p=2x1,g=2x1,os=2x2",
                                  "whole-4to8:p=2x1,g=2x1,os=4x2", "whole-adafactor-from-sp1:p=2x1,g=2x1,os=2x2"])
def test_whole_tensor_optimizer_saved_on_row_shards_resumes_elsewhere(runs, case):
    """Adafactor saved under zero3 (whole masters and factors on whole owners,
    checkpoint.py [Note: whole-tensor optimizers in a checkpoint]) resumes under sp = 1, under
    sp = 2 with other whole owners, and on 8 ranks: weights bit for bit, the next steps as the
    saving run's (fp32)."""
    r = _case(runs, case)
    _restored(r)
    assert r["loss_rel_diff"] <= FP32_TOL, r


def test_muon_saved_on_row_shards_resumes_bit_for_bit(runs):
    """Muon's Newton-Schulz runs in bf16 inside torch: the weights and the first loss after the
    load are exact; the step after is the saving run's up to the bf16 rounding of gradients
    summed in another order (observed below 1e-6 here)."""
    r = _case(runs, "whole-muon:p=2x1,g=2x1,os=2x2")
    _restored(r)
    assert r["first_loss_rel_diff"] == 0.0 and r["loss_rel_diff"] <= 1e-4, r


def test_negative_controls_fail_the_comparison(runs):
    for c in ("control-no-optimizer-state:p=1x1,g=1x1,os=2x2", "control-no-lr-schedule:p=1x1,g=1x1,os=2x2"):
        r = _case(runs, c)
        assert r["first_loss_rel_diff"] <= FP32_TOL, r  # the weights were loaded
        assert r["loss_rel_diff"] > 10 * FP32_TOL, r  # ... but the step after is not the same


def test_weights_only_load_into_another_optimizer(runs):
    r = _case(runs, "weights-only-sgd:p=1x1,g=1x1,os=2x2")
    assert r["weights_max_abs_diff"] == 0.0 and r["params_vs_masters_max_abs_diff"] == 0.0, r
    assert r["num_steps"] == 0 and r["first_loss_rel_diff"] <= FP32_TOL, r  # same weights
    assert r["loss_rel_diff"] > 10 * FP32_TOL, r  # then SGD, not the saved AdamW, steps


def test_hf_export_gives_the_sharded_models_logits(runs):
    for c, dtype in (("hf:fp32-A", "torch.float32"), ("hf:bf16-X", "torch.bfloat16"),
                     ("hf:tied-frozen", "torch.float32")):
        r = _case(runs, c)
        assert r["strict_ok"] and r["keys"] == 21 and r["dtypes"] == [dtype], r
        assert r["pretrained_dtype"] == dtype, r
        # same weights, same ops: equal up to kernel differences between batch layouts
        assert r["logits_max_abs_diff"] <= 1e-5 * max(1.0, r["logits_scale"]), r
        assert r["pretrained_logits_max_abs_diff"] <= 1e-5 * max(1.0, r["logits_scale"]), r


def test_errors_are_one_line_and_issue_no_collective(runs):
    want = {
        "missing-path": "does not exist",
        "not-a-checkpoint": "is not a complete amsp checkpoint",
        "other-shapes": "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] in the model but [176, 64]",
        "fewer-layers": "tensor 'model.layers.1.self_attn.q_proj.weight' of the checkpoint is not in the model",
        "other-optimizer": "saved from AdamW, this optimizer is SGD",
        "optimizer-of-another-model": "optimizer is not the one amsp_ext.shard returned",
        "per-shard-state-other-sp": "can only be loaded with the same sp, not sp=2",
        "whole-state-into-row-shards": "belongs to a whole tensor (a whole-tensor optimizer saved it)",
        "flipped-amsp.json": "file amsp.json is damaged",
        "truncated-amsp.json": "file amsp.json is damaged (not valid JSON",
        "flipped-amsp.state.json": "file amsp.state.json is damaged (sha256 mismatch)",
        "truncated-amsp.state.json": "file amsp.state.json has",
    }
    # a truncated tensor file breaks its safetensors header, which every rank reads before any
    # collective: the checksums name it there
    want["truncated-shard-00001-model-00001-of-00001.safetensors"] = \
        "file shard-00001-model-00001-of-00001.safetensors has"
    # a flipped byte of data is found by the rank that reads it: one all-gather tells the others
    after_one_gather = {"flipped-shard-00003-model-00001-of-00001.safetensors":
                        "file shard-00003-model-00001-of-00001.safetensors is damaged (sha256 mismatch)"}
    for name, text in {**want, **after_one_gather}.items():
        per_rank = runs[1][f"error:{name}"]
        assert sorted(per_rank) == [0, 1, 2, 3], per_rank
        for r in per_rank.values():
            assert r["type"] == "CheckpointError" and text in r["error"], r
            assert "\n" not in r["error"], r
            assert r["collectives_issued"] == (1 if name in after_one_gather else 0), r


def test_metadata_table_and_one_writer_per_chunk(runs):
    root = runs[0]
    from amsp_ext.runtime.state.checkpoint import dcp_metadata, read_checkpoint_meta

    meta = read_checkpoint_meta(root / "fp32-A")
    assert (meta["plan"], meta["world"]["size"], meta["sp"], meta["step"]) == ("p=2x1,g=2x1,os=2x2", 4, 2, 2)
    # every trainable tensor in 2 chunks (sp = 2) tiling dim 0, each with one owner (dp / sos = 1)
    by_name: dict[str, list] = {}
    for c in meta["tensors"]:
        by_name.setdefault(c["name"], []).append(c)
    assert len(by_name) == 21
    for name, chunks in by_name.items():
        n = chunks[0]["global_shape"][0]
        assert [c["offset"][0] for c in chunks] == [0, (n + 1) // 2], name
        assert sum(c["local_shape"][0] for c in chunks) == n and all(len(c["owners"]) == 1 for c in chunks)
        assert set(chunks[0]["state"]) == {"step", "exp_avg", "exp_avg_sq"}
    # saved with 4 parameter replicas and 2 owner replicas per tensor (p=1x1,os=2x1 on 4 ranks):
    # DCP records each chunk once and the files hold about one copy of the state
    meta = read_checkpoint_meta(root / "tied-frozen")
    assert all(len(c["owners"]) == 2 for c in meta["tensors"])
    assert "model.norm.weight" not in {c["name"] for c in meta["tensors"]}  # frozen: no state
    md = dcp_metadata(root / "tied-frozen")
    numel = sum(torch.Size(m.size).numel() for k, m in md.items() if hasattr(m, "size"))
    written = sum(f.stat().st_size for f in (root / "tied-frozen").glob("*.safetensors"))
    assert all(len(m.chunks) == 1 for k, m in md.items() if hasattr(m, "chunks"))
    assert written < 1.2 * 4 * numel, (written, numel)  # fp32; without dedup: ~2-4x


@pytest.mark.parametrize("case,dtype", [("fp32-A", None), ("bf16-X", torch.bfloat16), ("tied-frozen", None)])
def test_offline_export_from_a_checkpoint(runs, case, dtype, tmp_path):
    """One process, no process group: DCP stitches the chunks; transformers loads the result."""
    from transformers import LlamaForCausalLM

    from amsp_ext.runtime.state.export import export_checkpoint

    assert export_checkpoint(runs[0] / case, tmp_path / "hf", dtype=dtype) is None  # written, not held
    sd = export_checkpoint(runs[0] / case, dtype=dtype)
    saved = torch.load(runs[0] / f"logits-{case}.pt")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert next(model.parameters()).dtype == (dtype or torch.float32)
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits.float()
    assert (logits - saved["logits"]).abs().max() <= 1e-5 * max(1.0, float(saved["logits"].abs().max()))
    assert len(sd) == 21


def test_missing_checkpoint_needs_no_process_group(tmp_path):
    from amsp_ext.runtime.state.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(None, None, tmp_path / "nope")
    os.makedirs(tmp_path / "half")
    (tmp_path / "half" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="save did not finish"):
        load_checkpoint(None, None, tmp_path / "half")


# -- durability: atomic publish and checksums ---------------------------------------------------------
def _damaged_copy(src, dst, name, how):
    import shutil

    shutil.copytree(src, dst)
    f = dst / name
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[len(data) // 3] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "bit":
        data[-2] ^= 0x01
    f.write_bytes(bytes(data))


def test_every_file_checksummed_and_a_flipped_byte_refused(runs, tmp_path):
    """Offline (no process group): a flipped byte, a flipped bit or a truncation in any file of a
    checkpoint is refused with one line naming that file; the intact checkpoint verifies."""
    from amsp_ext.runtime.state.checkpoint import CheckpointError, verify_checkpoint
    from amsp_ext.runtime.state.export import export_checkpoint

    src = runs[0] / "fp32-A"
    meta = verify_checkpoint(src)
    names = sorted(p.name for p in src.iterdir())
    assert set(meta["files"]) == set(names) - {"amsp.json"} and len(names) >= 6, names
    for name in names:
        for how in ("flip", "bit", "truncate"):
            dst = tmp_path / f"{name}-{how}"
            _damaged_copy(src, dst, name, how)
            with pytest.raises(CheckpointError) as err:
                verify_checkpoint(dst)
            msg = str(err.value)
            assert "\n" not in msg and f"file {name} " in msg, (name, how, msg)
    with pytest.raises(CheckpointError, match=r"file shard-00002-model-00001-of-00001\.safetensors is damaged"):
        export_checkpoint(tmp_path / "shard-00002-model-00001-of-00001.safetensors-flip")


def test_a_killed_save_never_loses_the_previous_checkpoint(tmp_path):
    """A save killed (SIGKILL) at >= 5 points - random file-system events of the save plus the
    publishing rename and the events just around it - leaves a complete checkpoint: the
    previous one before the publish, the new one after it; the next process loads it and gets
    the probe loss recorded when it was saved."""
    import subprocess
    import sys

    from dist_utils import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoint_kill_worker", str(tmp_path / "k"), "5", "11"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    events = json.loads((tmp_path / "k" / "events.json").read_text())
    publish = events.index("amsp.checkpoint.publish")
    kills = [r for r in lines if "point" in r]
    assert len(kills) >= 5 and {publish, publish + 1} <= {k["point"] for k in kills}, kills
    assert all(k["exit"] == -9 for k in kills), kills  # every save was killed at its point
    killed = [r for r in lines if "gen" in r and r["kill_at"] is not None]  # in order, gen 1, 2, ...
    final = [r for r in lines if "gen" in r and r["kill_at"] is None][-1]
    assert [r["gen"] for r in killed] == list(range(1, len(kills) + 1)) and final["gen"] == len(kills) + 1
    survivor = 0
    for r in killed:  # generation g loaded what survived the kill of generation g - 1
        assert r["loaded"] == {"gen": survivor, "probe_ok": True}, (r, survivor)
        if r["kill_at"] > publish:  # killed after the publishing rename: the new one is complete
            survivor = r["gen"]
    assert final["loaded"] == {"gen": survivor, "probe_ok": True}, final
    assert survivor > 0  # a kill after the publish kept the new checkpoint
    assert lines[-1]["final_listing"] == ["ckpt", "events.json"]  # no staging left behind


def test_hostile_checkpoints_run_no_code_and_keys_are_checked(runs):
    """Pickles planted where a loader could unpickle them (a .metadata for DCP's pickle reader,
    the JSON state files, a tensor file), with amsp.json's checksums recomputed as an attacker who
    can write the folder would: nothing is executed (the payload would create PWNED), the
    planted files are refused in one line or ignored; a keyed load refuses unsigned, otherwise
    signed and re-tabled checkpoints. Every refusal comes before any collective (but one)."""
    root = runs[0]
    refused = {
        "pickle-state": "file amsp.state.json is damaged (not amsp data",
        "pickle-rng": "file rng-0.json is damaged (not amsp data",
        "pickle-tensor-file": "a tensor file cannot be read",
        "old-format": "pickles (loading them could run code): refused",
        "extra-tensor-file": "file shard-00009-model-00001-of-00001.safetensors is not one this checkpoint wrote",
        "signed-wrong-key": "signed with another key than this run's",
        "unsigned-keyed": "not signed, and this run has a checkpoint key",
        "tampered-signed": "signed with another key than this run's",
    }
    for name in ["pickle-metadata", "signed-right-key", *refused]:
        per_rank = runs[1][f"error:{name}"]
        assert sorted(per_rank) == [0, 1, 2, 3], per_rank
        for rank, r in per_rank.items():
            assert r["marker"] is False, r
            if name in refused:
                assert r["type"] == "CheckpointError" and refused[name] in r["error"], r
                # rng-<r>.json is read by rank r alone: one all-gather tells the others
                assert "\n" not in r["error"] and r["collectives_issued"] == (name == "pickle-rng"), r
            else:
                assert r["error"] is None, r  # loaded; the planted .metadata was never read
    assert not (root / "PWNED").exists()
