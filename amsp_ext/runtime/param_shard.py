"""Parameter sharding (sp > 1) on torch FSDP2, one ``fully_shard`` per unit on the 1-D
``param_shard`` sub-mesh.

[Note: what FSDP2 gives and what we add]
- AG per module, prefetched: one FSDP unit per module (see units.py) and explicit prefetch one
  unit ahead in forward (``set_modules_to_forward_prefetch``) and in backward
  (``set_modules_to_backward_prefetch``, reverse post-forward order: layer, down, up, gate, o, v,
  k, q, ...). Non-root units reshard after forward.
- RS decoupled from the module's backward: FSDP2 launches the reduce-scatter from its
  post-backward hook and accumulates the output into the sharded ``.grad`` later, then calls
  the parameter's ``_post_accumulate_grad_hooks``: that is where grad_sync.py picks the
  gradient up, i.e. completion is awaited only where the gradient is consumed.
- Recompute: under activation checkpointing FSDP2 sees the recompute forward in backward
  (``is_bw()``) and does not reshard after it, so the gather made for the recompute is the one
  the backward uses: one AG per unit in backward, as without recompute (tested).
- All of FSDP2's AG/RS go through collectives.py via ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, so they carry ``amsp::all_gather::param_shard`` labels and
  the collective timeout. On CPU (gloo) the custom all-gather is always issued async and its
  work returned, which FSDP2 then waits for in ``wait_for_unshard``: a prefetched gather really
  runs while the current unit computes. On GPU we keep FSDP2's own stream design (the
  ``async_op`` it asks for).
- Limits on CPU (gloo has no streams): FSDP2 asks for a synchronous reduce-scatter and reads
  its output right away, so on CPU the RS blocks the backward thread; only on GPU does it run
  on FSDP2's reduce-scatter stream, decoupled from the backward compute. The all-gather is
  truly async on CPU (above).
- Ablation ``overlap.allgather=False``: no explicit prefetch, and every AG/RS is waited for
  where it is issued (on GPU: device-synchronized). FSDP2's implicit one-unit backward prefetch
  stays (no public switch), but with blocking gathers it only reorders them.
- Reduction: FSDP2 is told to SUM (``set_force_sum_reduction_for_comms`` plus a divide factor
  of 1; gloo has no PREMUL_SUM) and grad_sync.py divides by the data-parallel size once.
- Mixed precision: the model is converted to the compute dtype after ``fully_shard`` (FSDP2's
  ``_apply`` re-pads the shards), so the sharded parameters are 2 bytes (2 Phi / sp) and no
  FSDP MixedPrecisionPolicy is needed; the fp32 masters live with the optimizer-state owners.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.units import Unit

__all__ = ["AMSPAllGather", "AMSPReduceScatter", "apply_fsdp", "fsdp_streams_wait_current",
           "prefetch_targets"]


class _Comm:
    """What both FSDP2 comm objects share: the group's label, the wait timeout, the switch."""

    def __init__(self, name: str, timeout: float, overlap: bool) -> None:
        self.name, self.timeout, self.overlap = name, timeout, overlap

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class AMSPAllGather(_Comm, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        always_async = output_tensor.device.type == "cpu" and self.overlap
        pending = C.all_gather_into_tensor(output_tensor, input_tensor, group, name=self.name,
                                           async_op=True)
        if async_op or always_async:
            # FSDP2 waits via ``Work.wait()`` in wait_for_unshard: a WorkHandle routes that wait
            # through collectives.wait (timed by the observer, timeout naming the group).
            return C.WorkHandle(pending, self.timeout)
        C.wait(pending, timeout=self.timeout)
        _serialize_if_no_overlap(output_tensor, self.overlap)
        return None


def _serialize_if_no_overlap(t: torch.Tensor, overlap: bool) -> None:
    # Ablation "AG/RS overlap off" on an accelerator: FSDP2 would still run the collective on
    # its own stream, concurrent with compute; block until it is done instead.
    if not overlap and t.device.type != "cpu":
        torch.accelerator.synchronize()


def fsdp_streams_wait_current(root: torch.nn.Module) -> None:
    """Make FSDP2's all-gather streams wait for the current stream (see param_sync.py)."""
    ctx = getattr(root._get_fsdp_state(), "_comm_ctx", None)  # type: ignore[operator]
    if ctx is None or not hasattr(ctx, "all_gather_copy_in_stream"):
        return
    current = torch.accelerator.current_stream()
    ctx.all_gather_copy_in_stream.wait_stream(current)
    ctx.all_gather_stream.wait_stream(current)


class AMSPReduceScatter(_Comm, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        pending = C.reduce_scatter_tensor(output_tensor, input_tensor, group, name=self.name,
                                          op=op, async_op=True)
        if async_op:
            return pending.work
        C.wait(pending, timeout=self.timeout)
        _serialize_if_no_overlap(output_tensor, self.overlap)
        return None


def prefetch_targets(units: Sequence[Unit]) -> tuple[dict[int, int], dict[int, int]]:
    """(forward, backward) prefetch: unit index -> the unit index it prefetches.

    Backward order is the reverse of post-forward order; a layer unit finishes its forward
    after its linears, so in backward it comes before them.
    """
    idx = [i for i, u in enumerate(units) if u.kind != "root"]
    fwd = {a: b for a, b in zip(idx, idx[1:])}
    post_forward: list[int] = []
    pending_layer: int | None = None
    for i in idx:
        u = units[i]
        if u.kind == "layer":
            if pending_layer is not None:
                post_forward.append(pending_layer)
            pending_layer = i
        elif u.kind == "linear":
            post_forward.append(i)
        else:
            if pending_layer is not None:
                post_forward.append(pending_layer)
                pending_layer = None
            post_forward.append(i)
    if pending_layer is not None:
        post_forward.append(pending_layer)
    bwd_order = list(reversed(post_forward))
    bwd = {a: b for a, b in zip(bwd_order, bwd_order[1:])}
    return fwd, bwd


def apply_fsdp(model: torch.nn.Module, units: Sequence[Unit], shard_mesh, *, name: str,
               timeout: float, overlap_allgather: bool) -> None:
    """``fully_shard`` every unit (children first), then the root; wire comms and prefetch."""
    order = [u for u in units if u.kind == "linear"] + [u for u in units if u.kind not in ("linear", "root")]
    for u in order:
        fully_shard(u.module, mesh=shard_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=False)
    modules: list[FSDPModule] = [u.module for u in units]  # type: ignore[misc]
    ag = AMSPAllGather(name, timeout, overlap_allgather)
    rs = AMSPReduceScatter(name, timeout, overlap_allgather)
    for m in modules:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
    fwd, bwd = prefetch_targets(units)
    if overlap_allgather:
        for a, b in fwd.items():
            modules[a].set_modules_to_forward_prefetch([modules[b]])
        for a, b in bwd.items():
            modules[a].set_modules_to_backward_prefetch([modules[b]])
    else:
        # No prefetch at all: each unit is gathered by its own pre-forward / pre-backward hook.
        for m in modules:
            m.set_modules_to_forward_prefetch([])
            m.set_modules_to_backward_prefetch([])
