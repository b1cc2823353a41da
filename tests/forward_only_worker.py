"""Worker for tests/test_forward_only.py: models sharded with no optimizer (a reference, reward or
teacher model; runtime/sync/grad_sync.py [Note: a model without an optimizer]), against the same
model in one process, fp32.

Usage: python -m tests.forward_only_worker GPUS_PER_NODE PLAN[;PLAN...]
Prints ``RESULT {json}`` per plan on rank 0 (every rank's worst difference, all-reduced).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.export import consolidated_state_dict
from tests.dist_utils import end_worker, free_plan_groups

SEQ = 16


def worst(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def batch(rank: int, step: int = 0) -> torch.Tensor:
    return micro_batch(step, 0, rank, world_size=dist.get_world_size(), num_micro_batches=1,
                       micro_batch_size=2, seq_len=SEQ)


def run(plan: str, gpus_per_node: int) -> dict:
    rank = dist.get_rank()
    config = ShardConfig(gpus_per_node=gpus_per_node)
    ref = build_llama("tiny-llama", seed=1)
    ids = batch(rank)[:, :-1]
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    model, opt = shard(build_llama("tiny-llama", seed=1), plan, None, config=config)
    out = {"plan": plan, "optimizer": opt is None, "run_plan": str(model.amsp.plan)}
    diffs = []
    with torch.no_grad():
        for mode in ("train", "eval"):
            getattr(model, mode)()
            diffs.append(float((model(input_ids=ids).logits - want).abs().max()))
    model.train()
    logits = model(input_ids=ids).logits  # with grad: DPO's reference runs inside the policy's step
    diffs.append(float((logits.detach() - want).abs().max()))
    out["forward_diff"] = worst(max(diffs))
    out["generate_same"] = same_generation(model, ref, ids)
    try:
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        out["backward"] = None
    except RuntimeError as e:
        out["backward"] = str(e)
    sd = consolidated_state_dict(model, rank0_only=False)
    out["weights_diff"] = worst(max(float((sd[k] - v).abs().max()) for k, v in ref.state_dict().items()))
    out["state_bytes"] = model.amsp.model_state_bytes()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    out["local_param_bytes"] = 4 * local
    free_plan_groups(model.amsp.mesh)
    out["sharded_after_fused_forward"] = sharded_after_fused_forward(plan, config, ids)
    out["policy_with_reference"] = policy_with_reference(plan, config)
    return out


def sharded_after_fused_forward(plan: str, config: ShardConfig, ids) -> bool:
    """A forward-only model whose loss reads ``lm_head.weight`` outside lm_head's forward (TRL's
    fused head) holds only its shards once the forward returns (outside_reads.py): no backward
    will come to reshard the gathered head."""
    from torch.distributed.tensor import DTensor
    from trl.trainer.utils import add_fused_lm_head

    fused = build_llama("tiny-llama", seed=1)
    add_fused_lm_head(fused)
    model, _ = shard(fused, plan, None, config=config)
    model.train()
    model(input_ids=ids, labels=ids.clone(), fused_lm_head=True)
    ok = model.amsp.plan.sp == 1 or all(isinstance(p, DTensor) for p in model.parameters())
    free_plan_groups(model.amsp.mesh)
    return ok


def same_generation(model, ref, ids) -> bool:
    """Greedy tokens of the sharded model equal the unsharded model's, on every rank."""
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        same = torch.equal(model.generate(ids[:1, :8], **kw), ref.generate(ids[:1, :8], **kw))
    flag = torch.tensor([0.0 if same else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag) == 0.0


def policy_with_reference(plan: str, config: ShardConfig) -> float:
    """Two engines in one process: a trained policy and a forward-only reference of the same
    weights; a DPO-like loss reads the reference's log-probs. Three SGD steps against one
    process on the whole batch: the worst loss difference."""
    def loss_of(policy, reference, ids):
        logp = policy(input_ids=ids[:, :-1]).logits.log_softmax(-1)
        with torch.no_grad():
            ref_logp = reference(input_ids=ids[:, :-1]).logits.log_softmax(-1)
        tok = ids[:, 1:, None]  # per token, so the ranks' mean of means is the whole batch's
        return -F.logsigmoid(0.5 * (logp.gather(-1, tok) - ref_logp.gather(-1, tok))).mean()

    world, rank = dist.get_world_size(), dist.get_rank()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    p1, r1 = build_llama("tiny-llama", seed=2), build_llama("tiny-llama", seed=2)
    o1 = sgd(list(p1.parameters()))
    policy, opt = shard(build_llama("tiny-llama", seed=2), plan, sgd, config=config)
    reference, _ = shard(build_llama("tiny-llama", seed=2), plan, None, config=config)
    worst_diff = 0.0
    for step in range(3):
        whole = torch.cat([batch(r, step) for r in range(world)])
        ref_loss = loss_of(p1, r1, whole)
        ref_loss.backward()
        o1.step()
        o1.zero_grad()
        loss = loss_of(policy, reference, batch(rank, step))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        got = loss.detach() / world
        dist.all_reduce(got)
        worst_diff = max(worst_diff, abs(float(got) - float(ref_loss)))
    if not same_generation(policy, p1, batch(0)[:, :-1]):  # the trained policy generates as one process
        worst_diff = float("inf")
    free_plan_groups(reference.amsp.mesh)
    free_plan_groups(policy.amsp.mesh)
    return worst(worst_diff)


def frozen_counted(gpus_per_node: int) -> dict:
    """Plan "auto" of a policy built after a forward-only reference counts it (planner/specs.py
    [Note: frozen models]); an explicit ``frozen_models`` wins."""
    import gc

    from amsp_ext.runtime.config import AutoPlanConfig

    gc.collect()  # the earlier cases' engines
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    auto = AutoPlanConfig(seq_len=16, micro_batch_size=1, num_micro_batches=1, gpu_memory_bytes=4 << 30,
                          profile="paper-a800")
    before, _ = shard(build_llama("tiny-llama", seed=2), "auto", sgd,
                      config=ShardConfig(gpus_per_node=gpus_per_node, auto=auto))
    reference, _ = shard(build_llama("tiny-llama", seed=2), "zero3", None,
                         config=ShardConfig(gpus_per_node=gpus_per_node))
    after, _ = shard(build_llama("tiny-llama", seed=2), "auto", sgd,
                     config=ShardConfig(gpus_per_node=gpus_per_node, auto=auto))
    told, _ = shard(build_llama("tiny-llama", seed=2), "auto", sgd,
                    config=ShardConfig(gpus_per_node=gpus_per_node,
                                       auto=dataclasses.replace(auto, frozen_models=3)))
    out = {"case": "frozen_counted", "before": before.amsp.config.auto.frozen_models,
           "after": after.amsp.config.auto.frozen_models, "told": told.amsp.config.auto.frozen_models}
    for m in (before, reference, after, told):
        free_plan_groups(m.amsp.mesh)
    return out


def main():
    gpus_per_node, plans = int(sys.argv[1]), sys.argv[2].split(";")
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    for plan in plans:
        out = run(plan, gpus_per_node)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(out), flush=True)
        dist.barrier()
    if dist.get_world_size() == 2:
        out = frozen_counted(gpus_per_node)
        if dist.get_rank() == 0:
            print("FROZEN " + json.dumps(out), flush=True)
    end_worker(t0)


if __name__ == "__main__":
    main()
