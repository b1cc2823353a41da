"""2-rank worker for tests/test_two_engines.py: two trained models in one process (an actor and
a critic, as OpenRLHF and verl run them), each sharded by its own engine with its own optimizer,
trained interleaved, against the same two models trained in one process on the whole batch.

Usage: python -m tests.fork_launch 2 torch,amsp,deepspeed tests.two_engines_worker PLAN[;PLAN] ROUTE[,ROUTE] DIR
  shard      amsp_ext.shard(actor, plan, AdamW) and amsp_ext.shard(critic, plan, SGD)
  deepspeed  deepspeed.initialize(model=..., config=ds_config with an amsp block) twice; after the
             steps each engine saves its checkpoint (its own folder under DIR), both train one
             more step, both load back and train that step again
Prints ``RESULT {json}`` per (plan, route) on rank 0; pytest decides.

Each step: the actor's forward, the critic's value under no_grad (between the actor's forward
and its backward), the actor's policy-gradient loss with the advantage reward - value, its
backward and step; then the critic's own forward, MSE to the reward, backward and step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaModel, LlamaPreTrainedModel

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama

SEQ, STEPS = 16, 3
ACTOR_OPT = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}}
CRITIC_OPT = {"type": "SGD", "params": {"lr": 3e-3, "momentum": 0.9}}


class TinyCritic(LlamaPreTrainedModel):
    """A small decoder with a scalar value head (PPO's critic: one value per token), a
    ``PreTrainedModel`` so it saves and loads from a folder as OpenRLHF's critic does."""

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def forward(self, input_ids):
        return self.value_head(self.model(input_ids=input_ids).last_hidden_state).squeeze(-1)


def build_pair():
    actor = build_llama("tiny-llama", seed=0)
    critic_config = build_llama("tiny-llama", num_hidden_layers=1, on_meta=True).config
    critic_config._attn_implementation = "eager"
    torch.manual_seed(1)
    return actor, TinyCritic(critic_config)


def actor_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)


def critic_opt(params):
    return torch.optim.SGD(params, lr=3e-3, momentum=0.9)


def batch_of(step, rank, world):
    return micro_batch(step, 0, rank, world_size=world, num_micro_batches=1, micro_batch_size=1, seq_len=SEQ)


def whole(step, world):
    return torch.cat([batch_of(step, r, world) for r in range(world)])


def reward_of(batch):
    return (batch[:, 1:] % 7).float() / 7.0  # a fixed per-token reward the critic learns


# -- one step on any pair: the wrappers hide the route (its forward / backward / step) --------
class Plain:
    """One process, or shard()'s model and optimizer: PyTorch's loop."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def __call__(self, *a, **k):
        return self.model(*a, **k)

    def backward(self, loss):
        loss.backward()

    def update(self):
        self.opt.step()
        self.opt.zero_grad()


class DeepSpeed:
    """deepspeed.initialize's engine: engine(...), engine.backward, engine.step."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, *a, **k):
        return self.engine(*a, **k)

    def backward(self, loss):
        self.engine.backward(loss)

    def update(self):
        self.engine.step()


def step(actor, critic, pieces):
    """One actor step then one critic step over the batches in ``pieces`` (their gradients
    summed, each loss divided by their number); returns (actor loss, critic loss)."""
    n, a_total, c_total = len(pieces), 0.0, 0.0
    for batch in pieces:
        x, target = batch[:, :-1], batch[:, 1:]
        logits = actor(input_ids=x).logits
        with torch.no_grad():  # the critic's estimate, between the actor's forward and backward
            value = critic(x)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        loss = -((reward_of(batch) - value) * logp).mean() / n
        actor.backward(loss)
        a_total += float(loss.detach())
    actor.update()
    for batch in pieces:
        loss = F.mse_loss(critic(batch[:, :-1]), reward_of(batch)) / n
        critic.backward(loss)
        c_total += float(loss.detach())
    critic.update()
    return a_total, c_total


def mean_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def reference(world, pieces):
    """Both models in one process: STEPS + 1 steps, parameters after STEPS. ``pieces``: the
    whole batch at once (False), or each rank's batch in turn with the gradients summed (True:
    the summation order of a data-parallel run, in one process)."""
    actor, critic = build_pair()
    a, c = Plain(actor, actor_opt(actor.parameters())), Plain(critic, critic_opt(critic.parameters()))
    losses, params = [], None
    for s in range(STEPS + 1):
        if s == STEPS:
            params = {"actor": clone_sd(actor.state_dict()), "critic": clone_sd(critic.state_dict())}
        batches = [batch_of(s, r, world) for r in range(world)] if pieces else [whole(s, world)]
        losses.append(step(a, c, batches))
    return {"losses": losses[:STEPS], "extra_step": losses[STEPS], "params": params}


def clone_sd(sd):
    return {k: v.detach().clone().float() for k, v in sd.items()}


def worst_diff(got, want):
    d = max(float((got[k].float() - v).abs().max()) for k, v in want.items())
    t = torch.tensor([d])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), sorted(got) == sorted(want)


def save_initial(folder):
    """Rank 0 writes the two initial models as Hugging Face folders (OpenRLHF loads from such)."""
    if dist.get_rank() == 0:
        actor, critic = build_pair()
        actor.save_pretrained(folder / "actor", max_shard_size="200KB")
        critic.save_pretrained(folder / "critic")
    dist.barrier()


# -- the routes ---------------------------------------------------------------------------------
def ds_config(plan, optimizer):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "optimizer": optimizer,
            "zero_optimization": {"stage": 3},
            "amsp": {"enabled": True, "plan": plan, "gpus_per_node": 2, "timeout": 60, "log_plan": False}}


def build_shard(plans):
    from amsp_ext import shard
    from amsp_ext.runtime.config import ShardConfig

    actor, critic = build_pair()
    am, ao = shard(actor, plans[0], actor_opt, config=ShardConfig(gpus_per_node=2))
    cm, co = shard(critic, plans[1], critic_opt, config=ShardConfig(gpus_per_node=2))
    return Plain(am, ao), Plain(cm, co), am, cm, {}


def build_deepspeed(plans, init_dir):
    """As OpenRLHF: both models from their folders while the ds_config is in play, then
    deepspeed.initialize once per model, each with its own config and optimizer."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from amsp_ext.runtime.engine import Engine

    Engine.built = 0  # as in a fresh process: an engine built earlier in this worker loads whole
    keep = HfDeepSpeedConfig(ds_config(plans[0], ACTOR_OPT))  # noqa: F841 (active while referenced)
    # eager attention, as build_pair's models (the reference) compute
    actor = AutoModelForCausalLM.from_pretrained(init_dir / "actor", attn_implementation="eager")
    critic = TinyCritic.from_pretrained(init_dir / "critic", attn_implementation="eager")
    on_meta = all(p.is_meta for m in (actor, critic) for p in m.parameters())
    ae, *_ = deepspeed.initialize(model=actor, config=ds_config(plans[0], ACTOR_OPT))
    ce, *_ = deepspeed.initialize(model=critic, config=ds_config(plans[1], CRITIC_OPT))
    return DeepSpeed(ae), DeepSpeed(ce), ae.module, ce.module, {"loaded_on_meta": on_meta}


def full_params(module):
    from amsp_ext.runtime.state.export import consolidated_state_dict

    return consolidated_state_dict(module, rank0_only=False)


def run_route(route, plan, refs, out_dir):
    """``plan``: one plan for both, or ACTOR_PLAN|CRITIC_PLAN."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = (plan.split("|") * 2)[:2]
    built = build_shard(plans) if route == "shard" else build_deepspeed(plans, out_dir / "init")
    actor, critic, am, cm, rec = built
    rec.update(plan=plan, route=route, ref_losses=refs["whole"]["losses"],
               losses=[mean_over_ranks(step(actor, critic, [batch_of(s, rank, world)])) for s in range(STEPS)])
    for name, m in (("actor", am), ("critic", cm)):
        got = full_params(m)
        rec[f"{name}_param_diff"], rec[f"{name}_same_keys"] = worst_diff(got, refs["whole"]["params"][name])
        rec[f"{name}_param_diff_pieces"], _ = worst_diff(got, refs["pieces"]["params"][name])
    rec["separate_meshes"] = am.amsp.mesh is not cm.amsp.mesh
    if route == "deepspeed":
        folder = out_dir / plan.replace(",", "_").replace("|", "-")
        rec.update(checkpoint_round_trip(actor.engine, critic.engine, refs["pieces"], folder, world))
    return rec, (am, cm)


def checkpoint_round_trip(ae, ce, ref, folder, world):
    """Each engine saves to its own folder, both train a step, both load back, the step again."""
    rank = dist.get_rank()
    ae.save_checkpoint(str(folder / "actor"))
    ce.save_checkpoint(str(folder / "critic"))
    pair = (DeepSpeed(ae), DeepSpeed(ce))
    out = {"step_after_save": mean_over_ranks(step(*pair, [batch_of(STEPS, rank, world)]))}
    ae.load_checkpoint(str(folder / "actor"))
    ce.load_checkpoint(str(folder / "critic"))
    for name, e in (("actor", ae), ("critic", ce)):
        out[f"{name}_loaded_diff"], _ = worst_diff(full_params(e.module), ref["params"][name])
    out["step_after_load"] = mean_over_ranks(step(*pair, [batch_of(STEPS, rank, world)]))
    out["ref_extra_step"] = ref["extra_step"]
    try:  # the critic's checkpoint into the actor: refused, not mixed in
        ae.load_checkpoint(str(folder / "critic"))
        out["crossed_load"] = None
    except Exception as e:
        out["crossed_load"] = f"{type(e).__name__}: {e}"
    return out


class SharedBackbone(nn.Module):
    """A critic around the actor's own decoder: two engines would reach the same parameters."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(body.config.hidden_size, 1, bias=False)

    def forward(self, input_ids):
        return self.value_head(self.body(input_ids=input_ids).last_hidden_state).squeeze(-1)


def run_shared(plan, out_dir):
    """The actor sharded, then a critic holding the actor's decoder: both routes refuse it in
    one line naming the parameter ([Note: one engine per parameter])."""
    import deepspeed

    from amsp_ext import shard
    from amsp_ext.runtime.config import ShardConfig

    first, second = (plan.split("|") * 2)[:2]
    actor, _ = build_pair()
    am, _ = shard(actor, first, actor_opt, config=ShardConfig(gpus_per_node=2))
    rec = {"plan": plan, "route": "shared"}
    for route, fn in (("shard", lambda m: shard(m, second, critic_opt, config=ShardConfig(gpus_per_node=2))),
                      ("deepspeed", lambda m: deepspeed.initialize(model=m, config=ds_config(second, CRITIC_OPT)))):
        try:
            fn(SharedBackbone(am.model))
            rec[route] = None
        except ValueError as e:
            rec[route] = str(e)
    return rec, (am,)


def main():
    import amsp_ext
    from tests.dist_utils import end_worker, free_plan_groups

    amsp_ext.patch_deepspeed()
    plans, routes, out_dir = sys.argv[1].split(";"), sys.argv[2].split(","), Path(sys.argv[3])
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    refs = {"whole": reference(dist.get_world_size(), pieces=False),
            "pieces": reference(dist.get_world_size(), pieces=True)}
    if "deepspeed" in routes:
        save_initial(out_dir / "init")
    for plan in plans:
        for route in routes:
            t1 = time.perf_counter()
            if route == "shared":
                rec, models = run_shared(plan, out_dir)
            else:
                rec, models = run_route(route, plan, refs, out_dir)
            rec["seconds"] = round(time.perf_counter() - t1, 1)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(rec), flush=True)
            dist.barrier()
            for m in models:
                free_plan_groups(m.amsp.mesh)
    end_worker(t0)


if __name__ == "__main__":
    main()
