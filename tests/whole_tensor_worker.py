"""Worker for tests/test_whole_tensor_optim.py: optimizers that read whole tensors (Adafactor,
Muon, a Frobenius-normalised SGD written here) and an AdamW subclass, on ``shard()``'s model,
each against the same optimizer in one process on the whole batch (or, for Muon, whose
Newton-Schulz runs in bf16 inside torch, against the ``ddp`` plan at the same world size).

Usage: python -m tests.whole_tensor_worker GPUS_PER_NODE PLAN[;PLAN...] [CASE,...]
Prints ``RESULT {json}`` per (plan, case) on rank 0. pytest decides.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.replan.switch import switch_plan
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.export import consolidated_state_dict
from tests.dist_utils import end_worker, start_case_worker

SEQ, MBS, STEPS = 16, 1, 3


class FrobeniusSGD(torch.optim.Optimizer):
    """A whole-tensor optimizer: each tensor moves by lr along its gradient divided by the
    gradient's Frobenius norm (a row shard's norm is not the tensor's)."""

    def __init__(self, params, lr=0.02):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-g["lr"])


class MyAdamW(torch.optim.AdamW):
    """A subclass with no declaration: treated as whole-tensor (it may change the update)."""


class MyDeclaredAdamW(torch.optim.AdamW):
    amsp_elementwise = True


def plain():
    return build_llama("tiny-llama", seed=0)


def matrices_only():
    """Muon takes 2-D parameters only: the norms are frozen here."""
    model = build_llama("tiny-llama", seed=0)
    for p in model.parameters():
        if p.dim() != 2:
            p.requires_grad_(False)
    return model


def muon_adamw(masters):
    """docs/usage.md's factory: Muon for the hidden matrices, AdamW for the rest."""
    from amsp_ext.runtime.optim.muon_adamw import muon_adamw_factory

    return muon_adamw_factory(muon={"lr": 0.02}, adamw={"lr": 3e-4})(masters)


CASES = {
    "adafactor": dict(model=plain, opt=lambda ps: torch.optim.Adafactor(ps, lr=0.02)),
    "frobenius": dict(model=plain, opt=lambda ps: FrobeniusSGD(ps, lr=0.02)),
    "adamw_subclass": dict(model=plain, opt=lambda ps: MyAdamW(ps, lr=1e-3)),
    "adamw_declared": dict(model=plain, opt=lambda ps: MyDeclaredAdamW(ps, lr=1e-3)),
    "muon": dict(model=matrices_only, opt=lambda ps: torch.optim.Muon(ps, lr=0.02), against="ddp"),
    "muon_adamw": dict(model=plain, opt=muon_adamw, against="ddp"),
    # tied embeddings break tiny-llama's pairs of equal shapes: a byte balance of the 2 owners
    # puts 1.4x the other's Newton-Schulz work on one (ownership.py [Note: owners balanced by
    # the optimizer's work])
    # switch_plan between steps (runtime/replan/switch.py [Note: whole-tensor optimizers in a
    # switch]): whole owners on row shards -> inter-tensor owners -> back
    "adafactor_switch": dict(model=plain, opt=lambda ps: torch.optim.Adafactor(ps, lr=0.02), plans=("zero3",),
                             switches={0: "p=1x1,g=1x1,os=2x1", 1: "zero3"}),
    "muon_adamw_switch": dict(model=plain, opt=muon_adamw, against="ddp", plans=("zero3",),
                              switches={0: "p=1x1,g=1x1,os=2x1", 1: "zero3"}),
    "muon_adamw_tied": dict(model=lambda: build_llama("tiny-llama", seed=0, tie_word_embeddings=True),
                            opt=muon_adamw, against="ddp", plans=("p=1x1,g=1x1,os=2x1",)),
    # the DeepSpeed route: a ds_config "optimizer" block, deepspeed.initialize routed to AMSP
    "ds_adafactor": dict(model=plain, opt=lambda ps: torch.optim.Adafactor(ps, lr=0.02),
                         block={"type": "Adafactor", "params": {"lr": 0.02}}),
    "ds_muon": dict(model=plain, block={"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}, against="ddp"),
    # the failure this file guards against: Adafactor told it is elementwise steps row shards
    "adafactor_as_elementwise": dict(model=plain, opt=lambda ps: torch.optim.Adafactor(ps, lr=0.02),
                                     config={"optimizer_kind": "elementwise"}),
}


def ds_engine(model, plan, gpus_per_node, block):
    """``deepspeed.initialize`` under an AMSP ds_config (the routed call a migrated job makes)."""
    import deepspeed

    import amsp_ext

    amsp_ext.patch_deepspeed()
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "optimizer": block,
           "zero_optimization": {"stage": 0},
           "amsp": {"enabled": True, "plan": plan, "gpus_per_node": gpus_per_node, "timeout": 120}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine.module, _EngineAsOptimizer(engine)


class _EngineAsOptimizer:
    """The DeepSpeed loop's calls in the own loop's names (backward, step; zero_grad is step's)."""

    def __init__(self, engine):
        self.engine = engine
        self.kind, self.whole = engine.module.amsp.optimizer.kind, engine.module.amsp.optimizer.whole

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def zero_grad(self):
        pass


def batch(step, rank, world):
    return micro_batch(step, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=MBS, seq_len=SEQ)


def train(model, opt, world, *, sharded, switches=None):
    """``switches``: step -> the plan switched to after that step."""
    rank = dist.get_rank() if sharded else 0
    losses = []
    for step in range(STEPS):
        if sharded:
            loss = causal_lm_loss(model, batch(step, rank, world))
            opt.backward(loss)
            total = loss.detach().clone()
            dist.all_reduce(total)
            total /= world
        else:
            b = torch.cat([batch(step, r, world) for r in range(world)])
            loss = causal_lm_loss(model, b)
            loss.backward()
            total = loss.detach()
        losses.append(float(total))
        opt.step()
        opt.zero_grad()
        if step in (switches or {}):
            switch_plan(model, opt, switches[step])
    return losses


def reference(case, world):
    torch.manual_seed(0)
    model = case["model"]()
    opt = case["opt"]([p for p in model.parameters() if p.requires_grad])
    losses = train(model, opt, world, sharded=False)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    gpus_per_node, plans, names, t0 = start_case_worker(CASES)
    world, rank = dist.get_world_size(), dist.get_rank()
    refs = {n: reference(CASES[n], world) for n in names if "against" not in CASES[n]}
    for name in names:
        case = CASES[name]
        mine = [p for p in plans if p in case.get("plans", plans)]  # a case may name its plans
        for plan in ([case["against"]] if "against" in case else []) + mine:
            rec = {"plan": plan, "case": name}
            try:
                config = ShardConfig(gpus_per_node=gpus_per_node, **case.get("config", {}))
                if "block" in case:
                    model, opt = ds_engine(case["model"](), plan, gpus_per_node, case["block"])
                else:
                    model, opt = shard(case["model"](), plan, case["opt"], config=config)
                losses = train(model, opt, world, sharded=True,
                               switches=case.get("switches") if plan != case.get("against") else None)
                full = consolidated_state_dict(model, rank0_only=False)
                if plan == case.get("against") and name not in refs:
                    refs[name] = (losses, {k: v.clone() for k, v in full.items()})
                ref_losses, ref_params = refs[name]
                inner = model.amsp.optimizer.inner
                rec.update(losses=losses, ref_losses=ref_losses, kind=opt.kind, whole=opt.whole is not None,
                           groups=[[bool(g.get("use_muon")), len(g["params"])] for g in inner.param_groups],
                           param_diff=max(float((full[k] - v).abs().max()) for k, v in ref_params.items()),
                           owners={t.name: [t.owner_rank, list(t.global_shape)] for t in model.amsp.tensors},
                           switched=[[w["from"], w["to"]] for w in model.amsp.switches])
            except Exception as e:  # the test decides
                rec["error"] = f"{type(e).__name__}: {e}"
            if rank == 0:
                print("RESULT " + json.dumps(rec), flush=True)
            dist.barrier()
    end_worker(t0)


if __name__ == "__main__":
    main()
