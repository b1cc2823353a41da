"""Worker for tests/test_whole_tensor_optim.py's resume on fewer ranks: whole-tensor optimizers
trained under a row-sharded plan on 4 ranks, saved, and resumed on 2 ranks under another plan.

- Adafactor: every step and the final parameters against one uninterrupted process.
- MuonWithAdamW (Muon for the hidden matrices, AdamW for the rest): Muon's Newton-Schulz runs in
  bf16 inside torch, so one process on the whole batch is not bit-comparable, and on 4 ranks
  neither is the ``ddp`` plan (its all-reduce adds the four gradients in another order than
  zero3's reduce-scatter, and bf16 rounds those 1e-7 apart). The reference is the same
  trajectory with only the checkpoint removed: the zero3 run's whole fp32 masters and optimizer
  states after its 2 steps are handed over as plain arrays (``muon-handoff/rank*.npz``, each
  rank its owned tensors, read with allow_pickle=False; no amsp checkpoint code), and the ``ddp``
  plan on 2 ranks (bit for bit ``p=1x1,g=1x1,os=2x1`` there, test_muon_equals_ddp_bit_for_bit)
  starts from them and trains the 2 more steps.

Usage: python -m tests.whole_resume_worker SUITE DIR   (SUITE: save4 or load2)
The global batch is the same 4 sequences per step on every world size (M = 4 / world
micro-batches of one sequence). Prints ``RESULT {json}`` on rank 0; pytest decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.optim.muon_adamw import muon_adamw_factory
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from amsp_ext.runtime.state.export import consolidated_state_dict
from tests.dist_utils import end_worker, free_plan_groups

SEQ, GLOBAL_SEQS, LR = 16, 4, 1e-2
BEFORE, AFTER = (0, 1), (2, 3)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=LR)


def muon_adamw(masters):
    """docs/usage.md's factory: Muon for the hidden matrices, AdamW for the rest."""
    return muon_adamw_factory(muon={"lr": 0.02}, adamw={"lr": 3e-4})(masters)


OPTIMIZERS = {"adafactor": adafactor, "muon_adamw": muon_adamw}
# (checkpoint name, plan on 4 ranks, plan on 2 ranks, optimizer)
CASES = (("zero3-to-os2", "zero3", "p=1x1,g=1x1,os=2x1", "adafactor"),
         ("p2os4-to-zero3", "p=2x1,g=2x1,os=2x2", "zero3", "adafactor"),
         ("muon-zero3-to-os2", "zero3", "p=1x1,g=1x1,os=2x1", "muon_adamw"))
# the negative controls: the weights loaded, the optimizer's states (Adafactor's factors and
# step counts; Muon's momenta, AdamW's moments and steps) not
CONTROLS = (("control-no-optimizer-state", "zero3-to-os2", "p=1x1,g=1x1,os=2x1", "adafactor"),
            ("muon-control-no-optimizer-state", "muon-zero3-to-os2", "p=1x1,g=1x1,os=2x1", "muon_adamw"))
HANDOFF = "muon-handoff"  # the Muon reference's hand-over, beside the checkpoints


def train(model, opt, steps, *, world, rank):
    M = GLOBAL_SEQS // world
    losses = []
    for step in steps:
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(M):
            b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=1, seq_len=SEQ)
            with contextlib.nullcontext() if m == M - 1 or world == 1 else model.no_sync():
                loss = causal_lm_loss(model, b) / M
                loss.backward() if world == 1 else opt.backward(loss)
            total += loss.detach().double()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
        opt.step()
        opt.zero_grad()
    return losses


def reference():
    """Adafactor's: one process, the whole global batch, four steps without a checkpoint."""
    model = build_llama("tiny-llama", seed=0)
    opt = adafactor(list(model.parameters()))
    losses = train(model, opt, BEFORE + AFTER, world=1, rank=0)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make(plan, seed, optimizer="adafactor", model=None):
    R = int(os.environ["LOCAL_WORLD_SIZE"]) // 2 if dist.get_world_size() == 4 else 2
    return shard(model if model is not None else build_llama("tiny-llama", seed=seed), plan, OPTIMIZERS[optimizer],
                 config=ShardConfig(gpus_per_node=R, timeout=120))


def release(model):
    model.amsp.grad_sync.remove()
    model.amsp.param_sync.remove()
    model.amsp.wait_params()
    free_plan_groups(model.amsp.mesh)


def emit(obj):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(obj), flush=True)


def hand_off(opt, folder: Path):
    """This rank's whole fp32 masters and their optimizer states as plain arrays (the Muon
    reference's start; no checkpoint code). Under zero3 every rank's masters are whole. The
    states are read from the torch Muon and AdamW that step them, not through
    MuonWithAdamW's ``state`` (whose loss to a wrapper de31dda fixed, so this test can see it)."""
    assert opt.whole is not None
    stepping = [o.state for o in (opt.inner._muon, opt.inner._adamw) if o is not None]
    out = {}
    for idx, m in opt.masters.items():
        name = opt.tensors[idx].name
        out[f"master|{name}"] = m.detach().numpy().copy()
        for k, v in next((st[m] for st in stepping if m in st), {}).items():
            out[f"state|{name}|{k}"] = v.detach().numpy().copy()
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"rank{dist.get_rank()}.npz", **out)


def handed_over(folder: Path):
    """Every rank's hand-over as ({name: master}, {name: {state key: tensor}})."""
    masters, states = {}, {}
    for f in sorted(folder.glob("rank*.npz")):
        with np.load(f, allow_pickle=False) as z:
            for key in z.files:
                t = torch.from_numpy(z[key].copy())
                kind, name, *k = key.split("|")
                if kind == "master":
                    assert name not in masters, name  # one whole owner per tensor
                    masters[name] = t
                else:
                    states.setdefault(name, {})[k[0]] = t
    return masters, states


def muon_reference(root: Path, world: int, rank: int):
    """The ``ddp`` plan on 2 ranks from the zero3 run's handed-over masters and states: steps
    2 and 3 of the same trajectory, the checkpoint removed."""
    masters, states = handed_over(root / HANDOFF)
    model = build_llama("tiny-llama", seed=2)
    params = dict(model.named_parameters())
    assert set(masters) == set(params), sorted(set(masters) ^ set(params))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(masters[n])
    model, opt = make("ddp", seed=2, optimizer="muon_adamw", model=model)
    assert len(opt.masters) == len(params)  # ddp: every rank steps every tensor
    # torch's own load_state_dict (ids are positions in the param groups): no amsp code
    ids = {id(p): i for i, p in enumerate(p for g in opt.inner.param_groups for p in g["params"])}
    sd = opt.inner.state_dict()
    sd["state"] = {}
    for idx, m in opt.masters.items():
        name = opt.tensors[idx].name
        assert torch.equal(m.detach(), masters[name]), name
        sd["state"][ids[id(m)]] = {k: v.clone() for k, v in states[name].items()}
    opt.inner.load_state_dict(sd)
    losses = train(model, opt, AFTER, world=world, rank=rank)
    full = consolidated_state_dict(model, rank0_only=False)
    release(model)
    return losses, {k: v.detach().clone() for k, v in full.items()}, sorted({k for s in states.values() for k in s})


def suite_save4(root: Path):
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, plan, _, optimizer in CASES:
        model, opt = make(plan, seed=0, optimizer=optimizer)
        losses = train(model, opt, BEFORE, world=world, rank=rank)
        save_checkpoint(model, opt, root / name)
        if optimizer == "muon_adamw":
            hand_off(opt, root / HANDOFF)
        emit({"case": name, "suite": "save4", "plan": plan, "losses": losses, "whole": opt.whole is not None})
        release(model)


def suite_load2(root: Path):
    world, rank = dist.get_world_size(), dist.get_rank()
    refs = {"adafactor": reference()}
    muon = muon_reference(root, world, rank)
    refs["muon_adamw"] = muon[:2]
    emit({"case": "muon-reference", "suite": "load2", "plan": "ddp", "losses": muon[0], "state_keys": muon[2]})
    for case, name, plan, optimizer in [(n, n, p, o) for n, _, p, o in CASES] + list(CONTROLS):
        ref_losses, ref_params = refs[optimizer]
        model, opt = make(plan, seed=1, optimizer=optimizer)  # other weights: a load that does nothing fails
        rec = {"case": case, "suite": "load2", "plan": plan, "ref_losses": ref_losses}
        try:
            load_checkpoint(model, opt, root / name, optimizer_states="control" not in case)
            rec["losses"] = train(model, opt, AFTER, world=world, rank=rank)
            full = consolidated_state_dict(model, rank0_only=False)
            rec["param_diff"] = max(float((full[k] - v).abs().max()) for k, v in ref_params.items())
            rec["whole"] = opt.whole is not None
        except Exception as e:  # noqa: BLE001 - the test decides
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        emit(rec)
        release(model)


def main():
    dist.init_process_group("gloo")
    suite, root = sys.argv[1], Path(sys.argv[2])
    t0 = time.perf_counter()
    {"save4": suite_save4, "load2": suite_load2}[suite](root)
    end_worker(t0)


if __name__ == "__main__":
    main()
