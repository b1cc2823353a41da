"""Worker for tests/test_own_loop.py: the idioms of hand-written loops (nanoGPT, torchtitan) on
``amsp_ext.shard``'s model and optimizer, each against the same loop in one process on the whole
batch, computed in this rank (a tiny model), fp32.

Usage: python -m tests.own_loop_worker GPUS_PER_NODE PLAN[;PLAN...]
Prints ``RESULT {json}`` per (plan, case) on rank 0: the run's and the reference's numbers, or
the error a case raised. pytest decides.
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.export import consolidated_state_dict
from tests.dist_utils import end_worker, free_plan_groups, start_case_worker

SEQ, MBS = 16, 1


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class HandHead(nn.Module):
    """A loss that reads ``lm_head.weight`` itself, inside the model's forward (no lm_head call)."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, input_ids):
        h = self.llama.model(input_ids=input_ids).last_hidden_state
        return h @ self.llama.lm_head.weight.t()


class Branch(nn.Module):
    """A parameter outside the layers that only some steps use (``use_branch``): a branch not
    taken, an idle expert, a vision tower on a text-only batch."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama
        torch.manual_seed(1)
        self.branch = nn.Linear(llama.config.hidden_size, llama.config.hidden_size, bias=False)
        self.use_branch = True

    def forward(self, input_ids):
        h = self.llama.model(input_ids=input_ids).last_hidden_state
        if self.use_branch:
            h = h + self.branch(h)
        return self.llama.lm_head(h)


def fused(llama):
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(llama)
    return llama


def frozen_head(llama):
    llama.lm_head.weight.requires_grad_(False)  # as under LoRA
    return llama


MODELS = {
    "plain": lambda: build_llama("tiny-llama", seed=0),
    "hand_head": lambda: HandHead(build_llama("tiny-llama", seed=0)),
    "branch": lambda: Branch(build_llama("tiny-llama", seed=0)),
    "fused_head": lambda: fused(build_llama("tiny-llama", seed=0)),
    "fused_frozen_head": lambda: frozen_head(fused(build_llama("tiny-llama", seed=0))),
}


def loss_of(kind, model, batch):
    if kind in ("hand_head", "branch"):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    if kind in ("fused_head", "fused_frozen_head"):
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone(), fused_lm_head=True)
        return -out.log_probs.mean()
    return causal_lm_loss(model, batch)


class Aborted(RuntimeError):
    pass


def aborted(model, kind, batch, backward, where):
    """A micro-batch that raises part-way (as an OOM would), caught as a loop that skips the
    batch does. ``where="backward"``: the first decoder layer's output gradient raises, after
    the later layers' backward ran; ``"forward"``: the second layer's forward raises."""
    layers = (model.llama if kind in ("hand_head", "branch") else model).model.layers

    def fail(*args):
        raise Aborted("injected")

    def arm(module, args, output):
        if where == "forward":
            fail()
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(fail)

    handle = layers[0 if where == "backward" else 1].register_forward_hook(arm)
    try:
        backward(loss_of(kind, model, batch))
        raise AssertionError("the injected failure did not raise")
    except Aborted:
        pass
    finally:
        handle.remove()


def batch_of(step, m, rank, world, M):
    return micro_batch(step, m, rank, world_size=world, num_micro_batches=M, micro_batch_size=MBS,
                       seq_len=SEQ)


def whole(step, m, world, M):
    return torch.cat([batch_of(step, m, r, world, M) for r in range(world)])


# -- the cases: each runs the same loop on (model, opt) and, with world=None, on one process ----
def run_case(case, model, opt, world, *, sharded):
    """Returns the case's record. ``world``: the data-parallel world the global batch spans."""
    rank = dist.get_rank() if sharded else 0
    kind = case["model"]
    M, steps, no_sync = case["M"], case["steps"], case.get("no_sync", False)
    losses, norms, emas = [], [], None
    params = list(model.parameters())  # taken before training, as EMA helpers keep them
    if case.get("ema"):
        emas = [p.detach().clone() for p in params]
    for step in range(steps):
        total = torch.zeros(())
        if kind == "branch":
            model.use_branch = step in case["branch_steps"]
        if case.get("abort") and step == 0:
            b = batch_of(9, 0, rank, world, 1) if sharded else whole(9, 0, world, 1)
            # a no_sync loop's failure is in a micro-batch inside no_sync()
            with model.no_sync() if (sharded and no_sync) else contextlib.nullcontext():
                aborted(model, kind, b, opt.backward if sharded else torch.Tensor.backward,
                        case.get("abort_in", "backward"))
            if case["abort"] == "zero_grad":
                opt.zero_grad()
        for m in range(M):
            b = batch_of(step, m, rank, world, M) if sharded else whole(step, m, world, M)
            last = m == M - 1
            inside = no_sync and (not last or case.get("last_in_no_sync"))
            ctx = model.no_sync() if (sharded and inside) else contextlib.nullcontext()
            with ctx:
                loss = loss_of(kind, model, b) / M
                if case.get("reference_pass"):  # DPO's: the same model, no grad, before backward
                    with torch.no_grad():
                        loss_of(kind, model, b)
                if case.get("plain_backward") or not sharded:
                    loss.backward()
                else:
                    opt.backward(loss)
            total += loss.detach()
        if sharded:
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
        if case.get("clip"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        if emas is not None:  # right after step(), from the references taken before training
            with torch.no_grad():
                for e, p in zip(emas, params):
                    e.mul_(0.9).add_(p.data, alpha=0.1)
    out = {"losses": losses, "norms": norms}
    if emas is not None:
        out["emas"] = [(e.full_tensor() if hasattr(e, "full_tensor") else e) for e in emas]
    return out


CASES = {
    "accum2": dict(model="plain", M=2, steps=2, opt=sgd),
    "accum2_nosync": dict(model="plain", M=2, steps=2, opt=sgd, no_sync=True),
    "accum4": dict(model="plain", M=4, steps=2, opt=sgd),
    "accum4_nosync": dict(model="plain", M=4, steps=2, opt=sgd, no_sync=True),
    "accum2_loss_backward": dict(model="plain", M=2, steps=2, opt=sgd, plain_backward=True),
    "clip": dict(model="plain", M=1, steps=3, opt=adamw, clip=0.5),
    "ema": dict(model="plain", M=1, steps=3, opt=sgd, ema=True),
    "hand_head": dict(model="hand_head", M=1, steps=3, opt=sgd),
    # refusals: a step after a backward inside no_sync(); .grad of fp32 gradients of bf16 params
    "step_inside_no_sync": dict(model="plain", M=2, steps=1, opt=sgd, no_sync=True, last_in_no_sync=True),
    "clip_bf16": dict(model="plain", M=1, steps=1, opt=adamw, clip=0.5, config={"precision": "bf16"}),
    "fused_head": dict(model="fused_head", M=1, steps=3, opt=sgd),
    # a parameter no backward reaches in some steps: one process skips it (no decay, no moments)
    "unused_branch": dict(model="branch", M=2, steps=3, opt=adamw, branch_steps=(0,)),
    # a backward that raised part-way, then zero_grad() (a loop skipping the batch) or not
    "aborted_then_zero_grad": dict(model="plain", M=2, steps=2, opt=sgd, abort="zero_grad"),
    "aborted_no_sync_then_zero_grad": dict(model="plain", M=2, steps=2, opt=sgd, abort="zero_grad",
                                           no_sync=True),
    "aborted_then_step": dict(model="plain", M=1, steps=1, opt=sgd, abort="step"),
    "aborted_forward_then_zero_grad": dict(model="plain", M=2, steps=2, opt=sgd, abort="zero_grad",
                                           abort_in="forward"),
    "fused_frozen_head_reference_pass": dict(model="fused_frozen_head", M=1, steps=3, opt=sgd,
                                             reference_pass=True),
}


def reference(name, world):
    case = CASES[name]
    torch.manual_seed(0)
    model = MODELS[case["model"]]()
    opt = case["opt"](list(model.parameters()))
    out = run_case(case, model, opt, world, sharded=False)
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def diff(a, b):
    return max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)


def main():
    gpus_per_node, plans, names, t0 = start_case_worker(CASES)
    world, rank = dist.get_world_size(), dist.get_rank()
    refs = {n: reference(n, world) for n in names}
    for plan in plans:
        for name in names:
            case = CASES[name]
            model = MODELS[case["model"]]()
            rec = {"plan": plan, "case": name}
            try:
                config = ShardConfig(gpus_per_node=gpus_per_node, **case.get("config", {}))
                model, opt = shard(model, plan, case["opt"], config=config)
                got = run_case(case, model, opt, world, sharded=True)
                ref = refs[name]
                full = consolidated_state_dict(model, rank0_only=False)
                rec.update(losses=got["losses"], ref_losses=ref["losses"], norms=got["norms"],
                           ref_norms=ref["norms"],
                           param_diff=max(float((full[k] - v).abs().max()) for k, v in ref["params"].items()))
                if "emas" in got:
                    rec["ema_diff"] = diff(got["emas"], ref["emas"])
                    # every rank's, not rank 0's alone
                    worst = torch.tensor([rec["ema_diff"]])
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                    rec["ema_diff_all_ranks"] = float(worst)
            except Exception as e:  # the test decides whether this case must refuse
                rec["error"] = f"{type(e).__name__}: {e}"
            if rank == 0:
                print("RESULT " + json.dumps(rec), flush=True)
            dist.barrier()
            if getattr(model, "amsp", None) is not None:
                free_plan_groups(model.amsp.mesh)
            del model
    end_worker(t0)


if __name__ == "__main__":
    main()
