"""The single-process reference and the comparisons of the engine parity tests (pytest side).

Workers (tests/engine_worker.py) only train and write what they saw: per case, rank 0 the
per-step losses (and clip norms), the ranks of rank 0's ``optim`` group their owned fp32
masters after every step (together every tensor exactly once; under fp32 the masters are the
parameters), and every rank its final local parameters. Here pytest rebuilds full tensors from
the shards and compares them with :func:`reference`, computed in this process, at every step.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from pathlib import Path

import torch

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss

STEPS, M, MBS, SEQ, LR = 5, 2, 1, 32, 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def batches(step, world):
    return [torch.cat([micro_batch(step, m, r, world_size=world, num_micro_batches=M,
                                   micro_batch_size=MBS, seq_len=SEQ) for r in range(world)])
            for m in range(M)]


def tiny_llama(tied=False):
    return build_llama("tiny-llama", seed=0, **({"tie_word_embeddings": True} if tied else {}))


@functools.lru_cache(maxsize=None)
def reference(world, *, precision="fp32", clip=None, skip=(), sched=False, tied=False, num_steps=STEPS,
              initial=None):
    """One process, the whole global batch: fp32 AdamW; under bf16/fp16 the same mixed-precision
    recipe as the engine (compute-dtype params and grads, fp32 masters and AdamW states).
    ``initial``: a safetensors file the starting weights are loaded from (every parameter).
    Returns per-step losses, clip norms and fp32 masters (one {name: tensor} per step)."""
    torch.manual_seed(0)
    model = tiny_llama(tied)
    if initial is not None:
        from safetensors.torch import load_file

        missing, _ = model.load_state_dict(load_file(initial), strict=False)
        assert not missing, missing
    dtype = DTYPES[precision]
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    if dtype != torch.float32:
        bufs = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
        model.to(dtype)
        for m, n, b in bufs:
            setattr(m, n, b)
    opt = adamw(masters if dtype != torch.float32 else list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if sched else None
    names = [n for n, _ in model.named_parameters()]
    losses, norms, steps = [], [], []
    for step in range(num_steps):
        total = 0.0
        for b in batches(step, world):
            loss = causal_lm_loss(model, b) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        params = masters if dtype != torch.float32 else list(model.parameters())
        if step in skip:  # the engine skips this step (fp16 overflow)
            for p in model.parameters():
                p.grad = None
        else:
            if dtype != torch.float32:
                for m, p in zip(masters, model.parameters()):
                    m.grad = p.grad.float()
                    p.grad = None
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
            if dtype != torch.float32:
                with torch.no_grad():
                    for m, p in zip(masters, model.parameters()):
                        p.copy_(m)
        steps.append({n: p.detach().float().clone() for n, p in zip(names, params)})
    return {"losses": losses, "norms": norms, "steps": steps}


@functools.lru_cache(maxsize=None)
def initial_params(tied=False):
    return {n: p.detach().float().clone() for n, p in tiny_llama(tied).named_parameters()}


# -- what the workers wrote ----------------------------------------------------------------------
def _full(shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """Shard(0) chunks in shard order -> the whole tensor (a plain tensor is one chunk)."""
    return torch.cat([shards[i] for i in sorted(shards)], dim=0)


def load_cases(outdir: Path) -> dict[str, dict]:
    """case -> {"losses", "norms", "extra", "sp", "steps": [{name: full fp32 master}], "finals":
    {rank: {name: (shard index, local tensor)}}}. The files are deleted once read (a launch
    writes ~100 MB, and pytest keeps the temp dirs of three sessions)."""
    files = sorted(Path(outdir).glob("*.pt"))
    assert files, f"no results in {outdir}"
    raw: dict[str, list] = defaultdict(list)
    for f in files:
        d = torch.load(f, weights_only=False)
        raw[d["case"]].append(d)
        f.unlink()
    out = {}
    for case, parts in raw.items():
        head = next(p for p in parts if p["rank"] == 0)
        steps = []
        for s in range(len(head["losses"])):
            shards: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
            for p in parts:
                for name, (shard, t) in p["masters"][s].items():
                    assert shard not in shards[name], (case, name, shard, "owned twice")
                    shards[name][shard] = t
            steps.append({n: _full(sh) for n, sh in shards.items()})
        out[case] = {"losses": head["losses"], "norms": head["norms"], "extra": head["extra"],
                     "sp": head["sp"], "steps": steps,
                     "finals": {p["rank"]: p["final"] for p in parts}}
    return out


# -- comparisons ---------------------------------------------------------------------------------
def loss_rel_diffs(got, ref, *, nonfinite_ok=()):
    """Per-step relative loss differences; a non-finite engine loss is allowed only at the
    steps in ``nonfinite_ok`` (an injected fp16 overflow), and must be non-finite there."""
    assert len(got) == len(ref), (got, ref)  # the reference's step count is the test's
    out = []
    for s, (a, b) in enumerate(zip(got, ref)):
        if s in nonfinite_ok:
            assert not math.isfinite(a), (s, a)
            continue
        assert math.isfinite(a), (s, a)
        out.append(abs(a - b) / abs(b))
    return out


def param_max_abs_diffs(case, ref):
    """Per-step max |engine master - reference| over every tensor (fp32 runs)."""
    diffs = []
    for got, want in zip(case["steps"], ref["steps"], strict=True):
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        assert all(got[n].shape == want[n].shape for n in want), "a shard is missing"
        diffs.append(max(float((got[n] - want[n]).abs().max()) for n in want))
    return diffs


def master_update_rel_l2(case, ref, init):
    """Per step: ||master - ref|| / ||ref - init|| over every tensor (mixed precision)."""
    out = []
    for got, want in zip(case["steps"], ref["steps"], strict=True):
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        assert all(got[n].shape == want[n].shape for n in want), "a shard is missing"
        num = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want)
        den = sum(float(((want[n] - init[n]) ** 2).sum()) for n in want)
        out.append(math.sqrt(num) / math.sqrt(den))
    return out


def replicas_match_owners(case, dtype):
    """Every rank's final local parameters are the owners' last masters (cast to the compute
    dtype), i.e. every broadcast of the last step landed everywhere."""
    masters = case["steps"][-1]
    worst = 0.0
    for rank, final in case["finals"].items():
        for name, (shard, t) in final.items():
            full = masters[name].to(dtype).float()
            want = full.chunk(case["sp"], dim=0)[shard] if case["sp"] > 1 else full
            assert t.shape == want.shape, (rank, name, t.shape, want.shape)
            worst = max(worst, float((t.float() - want).abs().max()) if t.numel() else 0.0)
    return worst
