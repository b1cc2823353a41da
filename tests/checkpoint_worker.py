"""torchrun worker for the checkpoint tests: many cases per launch, prints ``RESULT {json}``.

Every case trains tiny-llama on the same global batches (8 sequences per step: M = 2
micro-batches on 4 ranks, M = 1 on 8 ranks), AdamW with a LambdaLR schedule. The reference is
the run that saved the checkpoint *continuing without it*: its losses on the steps after the
save are written next to the checkpoint, and a fresh model (another seed, so a no-op load
fails) under another plan or world size loads the checkpoint and trains the same steps.

Usage: python -m tests.checkpoint_worker SUITE DIR   (SUITE in save4, cross8, cross4)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from amsp_ext.runtime.config import FP16Config, ShardConfig, compute_dtype
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.export import consolidated_state_dict, save_pretrained
from tests.dist_utils import end_worker, free_plan_groups

SEQ, GLOBAL_SEQS, LR = 32, 8, 1e-3
BEFORE, AFTER = (0, 1), (2, 3)  # steps trained before the save, and compared after it


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2)


def muon(params):
    return torch.optim.Muon(params, lr=1e-2)


def matrices_only(model):
    """Muon takes 2-D parameters only: the norms are frozen."""
    for p in model.parameters():
        if p.dim() != 2:
            p.requires_grad_(False)


def freeze_norm(model):
    model.model.norm.weight.requires_grad_(False)  # frozen: no master, no state, still saved


def make(plan, R, *, seed=0, factory=adamw, model_kw=None, prep=None, **cfg):
    model = build_llama("tiny-llama", seed=seed, **(model_kw or {}))
    if prep is not None:
        prep(model)
    model, opt = shard(model, plan, factory, config=ShardConfig(gpus_per_node=R, timeout=120, **cfg))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def train(model, opt, sched, steps):
    world, rank = dist.get_world_size(), dist.get_rank()
    M = GLOBAL_SEQS // world
    losses = []
    for step in steps:
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(M):
            b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                            micro_batch_size=1, seq_len=SEQ)
            with contextlib.nullcontext() if m == M - 1 else model.no_sync():
                loss = causal_lm_loss(model, b) / M
                opt.backward(loss)
            total += loss.detach().double()
        dist.all_reduce(total)  # the harness's own reduction, to report the global mean
        losses.append(float(total) / world)
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses


def release(model):
    """End of a case: detach the hooks and free the plan's groups (tests/dist_utils.py,
    [Note: freeing a case's groups in a worker])."""
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    model.amsp.wait_params()
    free_plan_groups(model.amsp.mesh)


_T0 = [time.perf_counter()]


def progress(case):
    """Rank 0: one ``CASE name seconds threads`` line per case (where a launch's time goes)."""
    if dist.get_rank() == 0:
        with open("/proc/self/status") as f:
            threads = next(int(l.split()[1]) for l in f if l.startswith("Threads:"))
        print(f"CASE {case} {time.perf_counter() - _T0[0]:.2f}s threads={threads}", flush=True)
    _T0[0] = time.perf_counter()


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def emit(obj, all_ranks=False):
    if all_ranks or dist.get_rank() == 0:
        sys.stdout.write("RESULT " + json.dumps({"rank": dist.get_rank(), **obj}) + "\n")
        sys.stdout.flush()


def weights(model):
    """fp32 consolidated weights on every rank (the state a load must reproduce)."""
    return consolidated_state_dict(model, rank0_only=False)


def max_diff(a, b):
    d = torch.zeros(1)
    for k in a:
        d = torch.maximum(d, (a[k].float() - b[k].float()).abs().max().reshape(1))
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def save_reference(name, plan, R, root: Path, *, hf=False, hf_dtype=None, **cfg):
    """Train BEFORE, save, then continue AFTER: the losses a load must reproduce. With ``hf``,
    also check the Hugging Face export of the saved state."""
    model, opt, sched = make(plan, R, **cfg)
    before = train(model, opt, sched, BEFORE)
    w = weights(model)
    save_checkpoint(model, opt, root / name, lr_scheduler=sched, extra={"name": name, "step": len(BEFORE)})
    rng_after = torch.rand(3)  # a same-world load must restore this stream
    if hf:
        hf_parity(name, model, root, dtype=hf_dtype)
    lr = opt.param_groups[0]["lr"]
    after = train(model, opt, sched, AFTER)
    ref = {"plan": plan, "cfg": {k: str(v) for k, v in cfg.items()}, "world": dist.get_world_size(),
           "before": before, "after": after, "lr_at_save": lr, "scale_after": opt.loss_scale}
    if dist.get_rank() == 0:
        (root / f"{name}.ref.json").write_text(json.dumps(ref))
    progress(f"save:{name}")
    return model, opt, sched, w, rng_after, ref


def load_case(case, ckpt: Path, ref, w_ref, plan, R, *, rng_ref=None, after_load=None, load_kw=None,
              **cfg):
    model, opt, sched = make(plan, R, seed=1, **cfg)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(model, opt, ckpt, lr_scheduler=sched, **(load_kw or {}))
    load_s = time.perf_counter() - t0
    if after_load is not None:  # negative controls: drop part of what was loaded
        after_load(model, opt, sched)
    rng = torch.rand(3)
    rng_ok = None if rng_ref is None else bool(torch.equal(rng, rng_ref))
    w = weights(model)
    compute = compute_dtype(model.amsp.config)
    # every replica's compute-dtype parameters are its fp32 master rounded (owners and others)
    p = consolidated_state_dict(model, dtype=compute, rank0_only=False)
    replica_diff = max_diff(p, {k: v.to(compute) for k, v in w.items()})
    state = {"params_vs_masters_max_abs_diff": replica_diff, "num_steps": opt.num_steps,
             "lr": opt.param_groups[0]["lr"], "scale": opt.loss_scale, "extra": extra,
             "weights_max_abs_diff": max_diff(w, w_ref)}
    after = train(model, opt, sched, AFTER)
    emit({"case": case, "plan": plan, "saved_plan": ref["plan"], "saved_world": ref["world"],
          "losses": after, "ref_losses": ref["after"], "loss_rel_diff": rel(after, ref["after"]),
          "first_loss_rel_diff": rel(after[:1], ref["after"][:1]), "bit_exact": after == ref["after"],
          "lr_at_save": ref["lr_at_save"], "scale_after": opt.loss_scale, "ref_scale_after": ref["scale_after"],
          "rng_restored": rng_ok, "warnings": [str(c.message) for c in caught], "load_seconds": load_s,
          **state})
    release(model)
    progress(case)


# -- HF export ---------------------------------------------------------------------------------------
def hf_parity(case, model, root: Path, dtype=None):
    """Logits of transformers' LlamaForCausalLM built from config + the consolidated dict vs the
    sharded model's, on real text; and the same through save_pretrained / from_pretrained."""
    from transformers import LlamaForCausalLM

    x = micro_batch(9, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=2, seq_len=SEQ)[:, :-1]
    with torch.no_grad():
        sharded = model(input_ids=x).logits.float()
    sd = consolidated_state_dict(model, dtype=dtype)
    out = root / f"hf-{case}"
    save_pretrained(model, out, dtype=dtype)
    if dist.get_rank() != 0:
        return
    torch.save({"input_ids": x, "logits": sharded}, root / f"logits-{case}.pt")
    torch.manual_seed(7)  # other weights: the load must replace them all
    hf = LlamaForCausalLM(model.config)
    if dtype is not None:  # parameters only: rotary buffers stay fp32, as in the engine
        for p in hf.parameters():
            p.data = p.data.to(dtype)
    missing = hf.load_state_dict(sd, strict=True)
    with torch.no_grad():
        a = hf(input_ids=x).logits.float()
        pre = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
        b = pre(input_ids=x).logits.float()
    emit({"case": f"hf:{case}", "keys": len(sd), "dtypes": sorted({str(v.dtype) for v in sd.values()}),
          "strict_ok": not missing.missing_keys and not missing.unexpected_keys,
          "logits_max_abs_diff": float((a - sharded).abs().max()),
          "pretrained_logits_max_abs_diff": float((b - sharded).abs().max()),
          "pretrained_dtype": str(next(pre.parameters()).dtype),
          "logits_scale": float(sharded.abs().max())})


# -- suites ------------------------------------------------------------------------------------------
def suite_save4(root: Path, R):
    A = "p=2x1,g=2x1,os=2x2"
    model, opt, sched, w, rng_after, ref = save_reference("fp32-A", A, R, root, hf=True)
    release(model)
    for case, plan in (("same-plan", A), ("sp1-sos4", "p=1x1,g=1x1,os=2x2"),
                       ("sp4-sos4", "p=2x2,g=2x2,os=2x2"), ("ddp", "ddp")):
        load_case(f"{case}:{plan}", root / "fp32-A", ref, w, plan, R,
                  rng_ref=rng_after if case == "same-plan" else None)
    # negative controls: the comparison must notice a lost optimizer state or LR schedule
    load_case("control-no-optimizer-state:p=1x1,g=1x1,os=2x2", root / "fp32-A", ref, w,
              "p=1x1,g=1x1,os=2x2", R, after_load=lambda m, o, s: o.inner.state.clear())
    load_case("control-no-lr-schedule:p=1x1,g=1x1,os=2x2", root / "fp32-A", ref, w,
              "p=1x1,g=1x1,os=2x2", R, after_load=lambda m, o, s: [g.update(lr=LR) for g in o.param_groups])
    # weights only, into another optimizer class (fine-tuning): the state starts fresh
    load_case("weights-only-sgd:p=1x1,g=1x1,os=2x2", root / "fp32-A", ref, w, "p=1x1,g=1x1,os=2x2", R,
              factory=sgd, load_kw={"optimizer_states": False})
    # precision change: a bf16 run continues from the fp32 run (its masters are the fp32 weights)
    load_case("fp32-to-bf16:p=2x1,g=2x2,os=2x2", root / "fp32-A", ref, w, "p=2x1,g=2x2,os=2x2", R,
              precision="bf16")
    # mixed precision: masters and states travel in fp32, parameters in bf16
    X = "p=2x1,g=2x2,os=2x2"
    model, opt, sched, w, _, ref = save_reference("bf16-X", X, R, root, hf=True, hf_dtype=torch.bfloat16,
                                                  precision="bf16")
    release(model)
    load_case(f"bf16-same-plan:{X}", root / "bf16-X", ref, w, X, R, precision="bf16")
    load_case("bf16-sp1-sos4:p=1x1,g=1x1,os=2x2", root / "bf16-X", ref, w, "p=1x1,g=1x1,os=2x2", R,
              precision="bf16")
    # precision change: an fp32 run continues from the bf16 run's fp32 masters
    load_case("bf16-to-fp32:p=2x2,g=2x2,os=2x2", root / "bf16-X", ref, w, "p=2x2,g=2x2,os=2x2", R)
    bf16_ref, bf16_w = ref, w
    # fp16: the dynamic loss scale (grown every step here) comes back too
    fp16 = {"precision": "fp16", "fp16": FP16Config(initial_scale=256.0, growth_interval=1)}
    model, opt, sched, w, _, ref = save_reference("fp16-X", X, R, root, **fp16)
    release(model)
    load_case(f"fp16-same-plan:{X}", root / "fp16-X", ref, w, X, R, **fp16)
    # bf16 checkpoint into fp16: non-owners round the fp32 masters too (not the bf16 params)
    load_case("bf16-to-fp16:p=1x1,g=1x1,os=2x2", root / "bf16-X", bf16_ref, bf16_w,
              "p=1x1,g=1x1,os=2x2", R, **fp16)
    load_case("fp16-sp1:p=1x1,g=1x1,os=2x2", root / "fp16-X", ref, w, "p=1x1,g=1x1,os=2x2", R, **fp16)
    # tied embeddings + a frozen parameter, saved with two owner replicas per tensor (sos = 2
    # on 4 ranks): dedup must write each chunk once; loaded with sp = 2
    tied = {"model_kw": {"tie_word_embeddings": True}, "prep": freeze_norm}
    model, opt, sched, w, _, ref = save_reference("tied-frozen", "p=1x1,g=1x1,os=2x1", R, root, hf=True, **tied)
    release(model)
    load_case("tied-frozen-sp2:p=2x1,g=2x1,os=2x2", root / "tied-frozen", ref, w, "p=2x1,g=2x1,os=2x2", R, **tied)
    # Adafactor reads whole tensors: under sp = 1 its masters and row/col factors are whole, and
    # they load again under sp = 1 or under sp = 2 with whole owners
    model, opt, sched, w, _, ref = save_reference("adafactor", "p=1x1,g=1x1,os=2x2", R, root, factory=adafactor)
    release(model)
    load_case("adafactor-same-sp:p=1x1,g=1x1,os=2x1", root / "adafactor", ref, w, "p=1x1,g=1x1,os=2x1", R,
              factory=adafactor)
    load_case("whole-adafactor-from-sp1:p=2x1,g=2x1,os=2x2", root / "adafactor", ref, w, "p=2x1,g=2x1,os=2x2",
              R, factory=adafactor)
    # declared elementwise, a state not shaped like its parameter (the row/col factors of a row
    # shard) is per-shard: saved for the error cases below
    model, *_ = save_reference("adafactor-ew", "p=1x1,g=1x1,os=2x2", R, root, factory=adafactor,
                               optimizer_kind="elementwise")
    release(model)
    # whole-tensor optimizers saved under zero3 (whole masters on whole owners), loaded where the
    # masters are whole again: sp = 1, and sp = 2 with other whole owners (and on 8 ranks: cross8)
    model, opt, sched, w, _, ref = save_reference("adafactor-zero3", "p=2x2,g=2x2,os=2x2", R, root,
                                                  factory=adafactor)
    release(model)
    for plan in ("p=1x1,g=1x1,os=2x1", "p=2x1,g=2x1,os=2x2"):
        load_case(f"whole-adafactor:{plan}", root / "adafactor-zero3", ref, w, plan, R, factory=adafactor)
    model, opt, sched, w, _, ref = save_reference("muon-zero3", "p=2x2,g=2x2,os=2x2", R, root, factory=muon,
                                                  prep=matrices_only)
    release(model)
    load_case("whole-muon:p=2x1,g=2x1,os=2x2", root / "muon-zero3", ref, w, "p=2x1,g=2x1,os=2x2", R,
              factory=muon, prep=matrices_only)
    suite_errors(root, R)


def suite_errors(root: Path, R):
    """Bad checkpoints: a one-line CheckpointError on every rank, before any collective."""
    (root / "empty").mkdir(exist_ok=True)
    model, opt, _ = make("p=2x1,g=2x1,os=2x2", R)
    other, other_opt, _ = make("p=2x1,g=2x1,os=2x2", R, model_kw={"intermediate_size": 128})
    fewer, fewer_opt, _ = make("p=1x1,g=1x1,os=2x2", R, model_kw={"num_hidden_layers": 1})
    sgd_model, sgd_opt, _ = make("p=1x1,g=1x1,os=2x2", R, factory=sgd)
    # declared elementwise, Adafactor keeps its row/col factors per row shard (a state not shaped
    # like its parameter): such a checkpoint loads only under the sp it was saved with; and a
    # whole tensor's factors never load into an engine that steps row shards
    ew_model, ew_opt, _ = make("p=2x1,g=2x1,os=2x2", R, factory=adafactor, optimizer_kind="elementwise")
    cases = [("missing-path", model, opt, root / "nope"), ("not-a-checkpoint", model, opt, root / "empty"),
             ("other-shapes", other, other_opt, root / "fp32-A"), ("fewer-layers", fewer, fewer_opt, root / "fp32-A"),
             ("other-optimizer", sgd_model, sgd_opt, root / "fp32-A"),
             ("optimizer-of-another-model", model, other_opt, root / "fp32-A"),
             ("per-shard-state-other-sp", ew_model, ew_opt, root / "adafactor-ew"),
             ("whole-state-into-row-shards", ew_model, ew_opt, root / "adafactor-zero3")]
    for how, name in (("flipped", "amsp.json"), ("truncated", "amsp.json"), ("flipped", "amsp.state.json"),
                      ("truncated", "amsp.state.json"), ("flipped", "shard-00003-model-00001-of-00001.safetensors"), ("truncated", "shard-00001-model-00001-of-00001.safetensors")):
        case = f"{how}-{name}"
        if dist.get_rank() == 0:
            damaged_copy(root / "fp32-A", root / case, name, how)
        cases.append((case, model, opt, root / case))
    if dist.get_rank() == 0:
        hostile_copies(root / "fp32-A", root)
    keyed = {"signed-right-key": "key-A", "signed-wrong-key": "key-B", "unsigned-keyed": "key-B"}
    cases += [(c, model, opt, root / c) for c in ("pickle-metadata", "pickle-state", "pickle-rng", "old-format",
                                                   "pickle-tensor-file", "extra-tensor-file", "tampered-signed",
                                                   *keyed)]
    dist.barrier()
    for case, m, o, path in cases:
        issued = sum(m.amsp.comm.counts.values())  # the engine's context counts its collectives
        os.environ.pop("AMSP_CHECKPOINT_KEY", None)
        if case in keyed or case == "tampered-signed":
            os.environ["AMSP_CHECKPOINT_KEY"] = keyed.get(case, "key-A")
        try:
            load_checkpoint(m, o, path)
            err, kind = None, None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            err, kind = str(e), type(e).__name__
        os.environ.pop("AMSP_CHECKPOINT_KEY", None)
        emit({"case": f"error:{case}", "error": err, "type": kind, "marker": (root / "PWNED").exists(),
              "collectives_issued": sum(m.amsp.comm.counts.values()) - issued}, all_ranks=True)
    for m in (model, other, fewer, sgd_model, ew_model):
        release(m)


class _Payload:
    """Unpickling this creates the file ``marker``: what a hostile checkpoint would plant."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _retable(d: Path, *, fmt=None, key=None, keep_signature=False) -> None:
    """What an attacker who can write the folder does: recompute amsp.json's table and checksum
    (and, with ``key``, its signature) over whatever files are there now."""
    from amsp_ext.runtime.state.checkpoint_files import META_FILE, file_digest, write_meta

    meta = json.loads((d / META_FILE).read_text())
    sig = meta.get("signature")
    for k in ("files", "checksum", "signature"):
        meta.pop(k, None)
    if keep_signature:
        meta["signature"] = sig
    if fmt:
        meta["format"] = fmt
    files = {f.name: file_digest(f) for f in sorted(d.iterdir()) if f.name != META_FILE}
    old = os.environ.pop("AMSP_CHECKPOINT_KEY", None)
    if key:
        os.environ["AMSP_CHECKPOINT_KEY"] = key
    try:
        write_meta(d, meta, files)
    finally:
        os.environ.pop("AMSP_CHECKPOINT_KEY", None)
        if old is not None:
            os.environ["AMSP_CHECKPOINT_KEY"] = old


def hostile_copies(src: Path, root: Path) -> None:
    """Copies of ``src`` with pickles planted where a loader might unpickle them, checksums
    recomputed so that only the format stands between the payload and a load."""
    import pickle
    import shutil

    bomb = pickle.dumps(_Payload(root / "PWNED"))
    tensor_file = min(src.glob("*.safetensors")).name

    def copy(name):
        shutil.rmtree(root / name, ignore_errors=True)
        shutil.copytree(src, root / name)
        return root / name

    d = copy("pickle-metadata")
    (d / ".metadata").write_bytes(bomb)  # what DCP's FileSystemReader would pickle.load
    _retable(d)
    for name, target in (("pickle-state", "amsp.state.json"), ("pickle-rng", "rng-0.json"),
                         ("pickle-tensor-file", tensor_file)):
        d = copy(name)
        (d / target).write_bytes(bomb)
        _retable(d)
    d = copy("old-format")
    (d / ".metadata").write_bytes(bomb)
    _retable(d, fmt="amsp-checkpoint/2")
    d = copy("extra-tensor-file")
    shutil.copy(d / tensor_file, d / "shard-00009-model-00001-of-00001.safetensors")
    _retable(d)
    (d / "shard-00009-model-00001-of-00001.safetensors").write_bytes((d / tensor_file).read_bytes())
    meta = json.loads((d / "amsp.json").read_text())
    meta["files"].pop("shard-00009-model-00001-of-00001.safetensors")
    (d / "amsp.json").write_text(json.dumps(meta))  # table without it; checksum refreshed below
    _retable_keep(d)
    d = copy("signed-right-key")
    _retable(d, key="key-A")
    d = copy("signed-wrong-key")
    _retable(d, key="key-A")
    copy("unsigned-keyed")
    d = copy("tampered-signed")
    _retable(d, key="key-A")
    (d / "rng-0.json").write_bytes(bomb)
    _retable(d, keep_signature=True)  # checksums recomputed, the old signature kept: no key


def _retable_keep(d: Path) -> None:
    """amsp.json's own checksum over its current table (the table itself kept)."""
    from amsp_ext.runtime.state.checkpoint_files import META_FILE, write_meta

    meta = json.loads((d / META_FILE).read_text())
    files = meta.pop("files")
    meta.pop("checksum", None)
    write_meta(d, meta, files)


def damaged_copy(src: Path, dst: Path, name: str, how: str) -> None:
    import shutil

    shutil.copytree(src, dst)
    data = bytearray((dst / name).read_bytes())
    if how == "flipped":
        data[len(data) // 3] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    (dst / name).write_bytes(bytes(data))


def suite_cross8(root: Path, R):
    refA = json.loads((root / "fp32-A.ref.json").read_text())
    wA = export_weights(root / "fp32-A")
    for plan in ("p=1x1,g=1x1,os=4x2", "p=4x2,g=4x2,os=4x2"):
        load_case(f"4to8:{plan}", root / "fp32-A", refA, wA, plan, R)
    ref = json.loads((root / "adafactor-zero3.ref.json").read_text())
    load_case("whole-4to8:p=2x1,g=2x1,os=4x2", root / "adafactor-zero3", ref, export_weights(root / "adafactor-zero3"),
              "p=2x1,g=2x1,os=4x2", R, factory=adafactor)
    model, opt, sched, w, _, ref = save_reference("fp32-B8", "p=2x1,g=4x2,os=4x2", R, root)
    release(model)


def suite_cross4(root: Path, R):
    ref = json.loads((root / "fp32-B8.ref.json").read_text())
    w = export_weights(root / "fp32-B8")
    for plan in ("p=2x2,g=2x2,os=2x2", "p=1x1,g=2x1,os=2x1"):
        load_case(f"8to4:{plan}", root / "fp32-B8", ref, w, plan, R)


def export_weights(path):
    """The saved weights, consolidated offline (one process, DCP stitching the chunks)."""
    from amsp_ext.runtime.state.export import export_checkpoint

    return export_checkpoint(path)


SUITES = {"save4": suite_save4, "cross8": suite_cross8, "cross4": suite_cross4}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    suite, root = sys.argv[1], Path(sys.argv[2])
    R = int(os.environ["LOCAL_WORLD_SIZE"]) // 2  # two "nodes"
    t0 = time.perf_counter()
    SUITES[suite](root, R)
    end_worker(t0)


if __name__ == "__main__":
    main()
