"""Worker of tests/test_meta_init.py: a tiny Llama built on meta, sharded under each plan.

Usage: python -m tests.meta_init_worker OUTDIR GPUS_PER_NODE PLAN[@bf16][;PLAN...] [INIT_FROM]

Per plan: ``shard()`` the meta model (seed 0, or ``init_from``); with ``init_from`` a dispatch
mode notes the largest storage of any tensor an op reads or writes meanwhile; gather the
full fp32 weights (the owners' fp32 masters under bf16; rank 0 writes OUTDIR/<plan>/weights.safetensors); train 2 steps of M
micro-batches; write the losses (averaged over the ranks), an eval loss, the counts and the
trained model with ``save_pretrained`` (OUTDIR/<plan>/hf, 200 KB files); the seeded run of
``CHECKPOINTED`` also saves an amsp checkpoint (OUTDIR/<plan>/ckpt) and its trained full weights
(trained.safetensors). pytest compares.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import amsp_ext
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import causal_lm_loss
from tests.dist_utils import end_worker, free_plan_groups
from tests.parity_check import M, MBS, SEQ, adamw

STEPS = 2
CHECKPOINTED = "p=2x1,g=2x1,os=2x2"  # the seeded run of this plan also saves an amsp checkpoint


def eval_batch():
    return micro_batch(99, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=2, seq_len=SEQ)


def meta_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from amsp_ext.common.models import llama_config_dict

    cfg = LlamaConfig(**{k: v for k, v in llama_config_dict("tiny-llama").items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


class NewTensors(TorchDispatchMode):
    """Records every real tensor an op reads or writes, as (op, shape, bytes of its storage):
    a view of a whole parameter read from a file counts at the whole parameter's bytes."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta:
                self.shapes.append((str(func), tuple(t.shape), t.untyped_storage().nbytes()))
        return out


def largest_sharded_bytes(model) -> int:
    """fp32 bytes of the largest parameter this rank keeps only a shard of (0: none)."""
    from amsp_ext.runtime import _torch_compat as compat

    return max((4 * p.numel() for p in model.parameters()
                if compat.dtensor_local(p).numel() < p.numel()), default=0)


def main() -> None:
    outdir, gpn, plans = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(";")
    init_from = sys.argv[4] if len(sys.argv) > 4 else None
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in plans:
        plan, _, precision = case.partition("@")  # "zero3@bf16": the plan in bf16
        model = meta_llama()
        counter = NewTensors()
        with counter if init_from is not None else contextlib.nullcontext():
            model, opt = amsp_ext.shard(model, plan, adamw, init_from=init_from,
                                        config=ShardConfig(gpus_per_node=gpn, init_seed=0,
                                                           precision=precision or "fp32"))
        largest = max(counter.shapes, key=lambda x: x[2], default=("", (), 0))
        full = amsp_ext.consolidated_state_dict(model)
        tag = re.sub(r"[^A-Za-z0-9_.=-]", "_", case)
        (outdir / tag).mkdir(parents=True, exist_ok=True)
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in full.items()}, str(outdir / tag / "weights.safetensors"))
        losses = []
        for step in range(STEPS):
            total = torch.zeros(1)
            for m in range(M):
                b = micro_batch(step, m, rank, world_size=world, num_micro_batches=M,
                                micro_batch_size=MBS, seq_len=SEQ)
                with model.no_sync() if m < M - 1 else contextlib.nullcontext():
                    loss = causal_lm_loss(model, b) / M
                    opt.backward(loss)
                total += loss.detach().float()
            dist.all_reduce(total)
            losses.append(float(total) / world)
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # the same batch on every rank
            eval_loss = float(causal_lm_loss(model, eval_batch()))
        amsp_ext.save_pretrained(model, outdir / tag / "hf", max_shard_size="200KB")
        if case == CHECKPOINTED and init_from is None:  # an amsp checkpoint to init_from
            amsp_ext.save_checkpoint(model, opt, outdir / tag / "ckpt")
            trained = amsp_ext.consolidated_state_dict(model)
            if rank == 0:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in trained.items()}, str(outdir / tag / "trained.safetensors"))
        (outdir / tag / f"rank{rank}.json").write_text(json.dumps(
            {"losses": losses, "eval_loss": eval_loss, "largest_storage": list(largest),
             "largest_sharded_param_bytes": largest_sharded_bytes(model)}))
        model.amsp.grad_sync.remove()
        model.amsp.param_sync.remove()
        free_plan_groups(model.amsp.mesh)
    end_worker(t0)


if __name__ == "__main__":
    main()
