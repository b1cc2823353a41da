"""Worker of tests/test_collective_counts.py: the all-gathers and reduce-scatters of one
micro-batch of tiny-llama, under AMSP's ``zero3`` and under FSDP2's ``fully_shard`` of the same
model wrapped the usual way (each decoder layer, then the root), on the same 2 gloo ranks.

Both are observed the same way, below every library: a TorchDispatchMode counts the c10d ops
that reach the backend (``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``), so
FSDP2's count does not depend on which torch.distributed function it calls. On gloo AMSP issues
each reduce-scatter as an all-reduce of its input (collectives.py [Note: a reduce-scatter that
can be polled (gloo)]). AMSP's count is also read from the
engine's own counters (collectives.py [Note: counters]). Prints one ``RESULT {json}`` on rank 0.

Usage: python -m tests.collective_counts_worker
"""

from __future__ import annotations

import collections
import inspect
import json

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime.shard import shard

OPS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
       "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
       "allreduce_": "all_reduce"}
# where a reduce-scatter is waited for, by the innermost of these functions on the stack
# (deferred_rs.py [Note: a reduce-scatter decoupled on CPU])
WAITED_IN = {"add": "next_issued", "ready": "completed", "wait_all": "flush", "__call__": "at_issue"}


class C10dOps(TorchDispatchMode):
    """Counts the c10d all-gathers and reduce-scatters dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            if name in OPS:
                self.counts[OPS[name]] += 1
        return func(*args, **(kwargs or {}))


def _micro_batch(model, batch) -> dict:
    with C10dOps() as seen:
        causal_lm_loss(model, batch).backward()
    return dict(seen.counts)


def amsp_counts(batch) -> dict:
    model, opt = shard(build_llama("tiny-llama"), "zero3", lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    comm = model.amsp.comm
    out = {}
    events: list[tuple[str, int]] = []  # reduce-scatters issued and waited for, in order

    def rs_order(event, op, name, info):
        if op == "reduce_scatter" and event in ("issued", "wait_begin"):
            where = next((WAITED_IN[f.function] for f in inspect.stack()
                          if f.function in WAITED_IN and "amsp_ext" in f.filename), "other")
            events.append((event, where))

    comm.observers.append(rs_order)
    for step in range(2):  # the second step: after the first step's broadcasts and lazy init
        before = collections.Counter(comm.counts)
        events.clear()
        seen = _micro_batch(model, batch)
        counted = {op: n - before[(op, "param_shard")] for (op, g), n in comm.counts.items() if g == "param_shard"}
        opt.step()
        opt.zero_grad()
        waited_in = collections.Counter(where for ev, where in events if ev == "wait_begin")
        out = {"observed": seen, "engine": counted, "rs_waited_in": dict(waited_in),
               "rs_events": len(events)}
    # two micro-batches, the first inside no_sync(): the second's reduce-scatters find no
    # .grad to add into (grad_sync.py keeps the first's sum), so they are left in flight too
    events.clear()
    with model.no_sync():
        causal_lm_loss(model, batch).backward()
    causal_lm_loss(model, batch).backward()
    opt.step()
    opt.zero_grad()
    out["rs_waited_in_accumulating"] = dict(collections.Counter(where for ev, where in events if ev == "wait_begin"))
    return out


def loss_after_step(batch, *, no_grad_forward: bool) -> float:
    """The loss after one SGD step, with or without a no-grad forward between the backward and
    the step: the root stays gathered after it (outside_reads.py [Note: a gathered root after a
    step]), and the step must not leave the next forward its old values."""
    model, opt = shard(build_llama("tiny-llama"), "zero3", lambda ps: torch.optim.SGD(ps, lr=1.0))
    causal_lm_loss(model, batch).backward()
    if no_grad_forward:
        with torch.no_grad():
            model(input_ids=batch[:, :-1])
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        return causal_lm_loss(model, batch).item()


def fsdp2_counts(batch) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = build_llama("tiny-llama")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    for step in range(2):
        seen = _micro_batch(model, batch)
        opt.step()
        opt.zero_grad()
    return {"observed": seen, "num_layers": len(model.model.layers)}


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (2, 17))
    rec = {"amsp": amsp_counts(batch), "fsdp2": fsdp2_counts(batch),
           "loss_after_step": [loss_after_step(batch, no_grad_forward=f) for f in (False, True)]}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rec), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
