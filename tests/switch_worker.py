"""torchrun worker for tests/test_switch.py: one launch, two cases, 4 ranks (2 nodes x 2).

Each case trains tiny-llama for parity_check.STEPS steps under plan A, switches in memory to
plan B after step ``A_TO_B`` and back to A after step ``B_TO_A`` (amsp_ext.switch_plan, forced,
no monitor), and writes what it saw like the parity workers (tests/parity_check.py). Rank 0
also prints ``RESULT {json}``: each plan's measured model-state bytes (worst rank) next to the
planner's prediction, measured after the plan's last step (so the gradient peak is one of its
own backward passes).

Usage: python -m tests.switch_worker OUTDIR [break]   ("break": drop the optimizer states at
each switch, to show that the test fails)
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.common.models import build_llama
from amsp_ext.planner.memory import memory_breakdown
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.specs import TrainingSpec
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.state.export import consolidated_state_dict
from amsp_ext.runtime.replan.switch import switch_plan
from tests import engine_worker as W
from tests.dist_utils import end_worker
from tests.parity_check import M, MBS, SEQ

R = 2
A, B = "p=2x2,g=2x2,os=2x2", "p=1x1,g=1x1,os=2x2"  # ZeRO-3 over the world, and os-only
A_TO_B, B_TO_A = 1, 3  # after these steps (0-based): steps 2, 3 run under B, step 4 under A again
CASES = {"fp32-sched": dict(precision="fp32", sched=True), "bf16": dict(precision="bf16", sched=False)}


def measured_vs_predicted(model, precision):
    b = model.model_state_bytes()
    spec = ModelSpec.from_hf_config(build_llama("tiny-llama").config.to_dict())
    pred = memory_breakdown(spec, model.amsp.plan, TrainingSpec(
        seq_len=SEQ, micro_batch_size=MBS, num_micro_batches=M, precision=precision,
        reduce_dtype="fp32"), gpus_per_node=R, num_nodes=dist.get_world_size() // R)
    rel = torch.tensor([abs(b["total"] / pred.model_states - 1)])
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    return {"plan": str(model.amsp.plan), "measured_rank0": b["total"],
            "predicted": pred.model_states, "worst_rank_rel_err": float(rel)}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    outdir, broken = sys.argv[1], "break" in sys.argv[2:]
    W.OUTDIR = outdir
    t0 = time.perf_counter()
    for case, kw in CASES.items():
        memory, switches = [], []

        def after_step(model, step=[0]):  # noqa: B006 - the step counter of this case
            s = step[0]
            step[0] += 1
            if s in (A_TO_B, B_TO_A):
                memory.append(measured_vs_predicted(model, kw["precision"]))
                opt = model.amsp.optimizer
                got = switch_plan(model, opt, B if s == A_TO_B else A)
                assert got is opt
                if broken:
                    opt.inner.state.clear()
                switches.append(model.amsp.switches[-1])

        model, opt, run = W.train(A, ShardConfig(gpus_per_node=R, timeout=120, precision=kw["precision"]),
                                  world=dist.get_world_size(), sched=kw["sched"], after_step=after_step)
        memory.append(measured_vs_predicted(model, kw["precision"]))
        # the full model after the switch back to A (DTensor full_tensor over A's mesh again)
        full = consolidated_state_dict(model, rank0_only=False)
        assert {k for k, _ in model.named_parameters()} <= set(full), sorted(full)[:5]
        assert all(bool(torch.isfinite(v).all()) for v in full.values() if v.is_floating_point())
        W.record(case, model, run, extra={"memory": memory, "switches": switches,
                                          "num_steps": opt.num_steps,
                                          "lr": [g["lr"] for g in opt.param_groups]})
        W.release(model)
    end_worker(t0)


if __name__ == "__main__":
    main()
