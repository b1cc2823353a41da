"""Parameter sharding (sp > 1) on torch FSDP2, one ``fully_shard`` per unit on the 1-D
``param_shard`` sub-mesh.

[Note: what FSDP2 gives and what we add]
- AG per module, prefetched: one FSDP unit per module (see units.py) and explicit prefetch one
  unit ahead in forward (``set_modules_to_forward_prefetch``) and in backward
  (``set_modules_to_backward_prefetch``, reverse post-forward order: layer, down, up, gate, o, v,
  k, q, ...). Non-root units reshard after forward; the root (everything outside the layers)
  does not (units.py [Note: one root unit]).
- RS decoupled from the module's backward: FSDP2 launches the reduce-scatter from its
  post-backward hook and accumulates the output into the sharded ``.grad`` later, then calls
  the parameter's ``_post_accumulate_grad_hooks``: that is where grad_sync.py picks the
  gradient up, i.e. completion is awaited only where the gradient is consumed.
- Recompute: under activation checkpointing FSDP2 sees the recompute forward in backward
  (``is_bw()``) and does not reshard after it, so the gather made for the recompute is the one
  the backward uses: one AG per unit in backward, as without recompute (tested).
- All of FSDP2's AG/RS go through collectives.py via ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, so they carry ``amsp::all_gather::param_shard`` labels and
  the collective timeout. See [Note: FSDP2's async_op contract] for what they return.
- On CPU (gloo has no streams) FSDP2 asks for a synchronous reduce-scatter; where FSDP2 will
  not read its output before our gradient hooks, it is left in flight and the hooks take it once
  it has completed (deferred_rs.py [Note: a reduce-scatter decoupled on CPU]); elsewhere it blocks the backward
  thread. On GPU it runs on FSDP2's reduce-scatter stream. The all-gather is truly async on CPU
  (above).
- Ablation ``overlap.allgather=False``: no explicit prefetch, and every AG/RS is waited for
  where it is issued (on GPU: device-synchronized). FSDP2's implicit one-unit backward prefetch
  stays (no public switch), but with blocking gathers it only reorders them.
- Reduction: FSDP2 is told to SUM (``set_force_sum_reduction_for_comms`` plus a divide factor
  of 1; gloo has no PREMUL_SUM) and grad_sync.py divides by the data-parallel size once.
- Mixed precision: the model is converted to the compute dtype after ``fully_shard`` (FSDP2's
  ``_apply`` re-pads the shards), so the sharded parameters are 2 bytes (2 Phi / sp); the fp32
  masters live with the optimizer-state owners. FSDP2's MixedPrecisionPolicy carries only
  ``reduce_dtype`` (ShardConfig.reduce_dtype): under "fp32" the reduce-scatter input and output
  are fp32, and FSDP2 casts the reduced shard back to the parameter dtype before handing it to
  grad_sync.py (one rounding of an exactly reduced sum per micro-batch; grad_sync.py then
  reduces and accumulates in fp32). See [Note: reduce dtype] in grad_sync.py.

[Note: FSDP2's async_op contract]
FSDP2 calls the custom all-gather with ``async_op`` and decides from the return value (Work or
None) how it frees the gathered buffer (``wait_for_unshard``: a None result in forward keeps
it until the next copy-out, for overlap). So we return a Work exactly when it asked for
``async_op=True``, and otherwise wait before returning None. On GPU FSDP2 asks for
``async_op=False`` and gets its overlap from running the call on its all-gather stream: the
wait there only makes that stream wait (collectives.wait). On CPU (gloo) there are no
streams, so a synchronous gather would block the prefetch on the CPU thread; with
``overlap.allgather`` we therefore tell FSDP2 to ask for ``async_op=True``
(``_set_unshard_async_op``, via _torch_compat): its pre-forward/pre-backward unshards and
explicit prefetches then issue async and ``wait_for_unshard`` waits on the Work, so a
prefetched gather runs while the current unit computes, within FSDP2's own protocol. FSDP2
calls the reduce-scatter synchronously (``async_op`` left False) and ignores its result.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.sync.deferred_rs import DeferredReduceScatters
from amsp_ext.runtime.sync.units import Unit

__all__ = ["AMSPAllGather", "AMSPReduceScatter", "apply_fsdp", "fsdp_streams_wait_current",
           "prefetch_targets"]


class _Comm:
    """What both FSDP2 comm objects share: the engine's collective context, the group's label,
    the wait timeout, the switch."""

    def __init__(self, comm: C.CollectiveContext, name: str, timeout: float, overlap: bool) -> None:
        self.comm, self.name, self.timeout, self.overlap = comm, name, timeout, overlap

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class AMSPAllGather(_Comm, compat.FSDPAllGatherBase):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # stream=None: FSDP2 calls us inside its own all-gather stream, the right one
        pending = C.all_gather_into_tensor(self.comm, output_tensor, input_tensor, group,
                                           name=self.name, stream=None, async_op=True,
                                           timeout=self.timeout)
        if async_op:
            # FSDP2 waits via ``Work.wait()`` in wait_for_unshard (see [Note: FSDP2's async_op
            # contract]); a WorkHandle routes that wait through collectives.wait: timed by the
            # observers, and a timeout that names the group.
            return C.WorkHandle(pending)
        C.wait(pending)
        _serialize_if_no_overlap(output_tensor, self.overlap)
        return None


def _serialize_if_no_overlap(t: torch.Tensor, overlap: bool) -> None:
    # Ablation "AG/RS overlap off" on an accelerator: FSDP2 would still run the collective on
    # its own stream, concurrent with compute; block until it is done instead.
    if not overlap and t.device.type != "cpu":
        torch.accelerator.synchronize()


def fsdp_streams_wait_current(root: torch.nn.Module) -> None:
    """Make FSDP2's all-gather streams wait for the current stream (see param_sync.py)."""
    streams = compat.fsdp_all_gather_streams(root)
    if not streams:
        return
    current = torch.accelerator.current_stream()
    for s in streams:
        s.wait_stream(current)


class AMSPReduceScatter(_Comm, compat.FSDPReduceScatterBase):
    """One unit's: ``unit`` names its sharded parameters, ``deferred`` (None: never; so under
    the overlap-off ablation) holds the reduce-scatters left in flight on CPU (deferred_rs.py
    [Note: a reduce-scatter decoupled on CPU])."""

    def __init__(self, comm: C.CollectiveContext, name: str, timeout: float, overlap: bool, *,
                 unit: Unit, deferred: DeferredReduceScatters | None) -> None:
        super().__init__(comm, name, timeout, overlap)
        self.unit, self.deferred = unit, deferred

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if not async_op and self.deferred is not None and self.deferred.polled(group, op):
            pending = C.reduce_scatter_polled(self.comm, output_tensor, input_tensor, group,
                                              name=self.name, timeout=self.timeout)
            if self.deferred.defer(output_tensor, [p for _, p in self.unit.params]):
                self.deferred.add(pending)
                return None
        else:
            # stream=None: FSDP2 calls us inside its own reduce-scatter stream, the right one
            pending = C.reduce_scatter_tensor(self.comm, output_tensor, input_tensor, group,
                                              name=self.name, stream=None, op=op, async_op=True,
                                              timeout=self.timeout)
            if async_op:
                return pending.work
        C.wait(pending)
        _serialize_if_no_overlap(output_tensor, self.overlap)
        return None


def prefetch_targets(units: Sequence[Unit]) -> tuple[dict[int, int], dict[int, int]]:
    """(forward, backward) prefetch: unit index -> the unit index it prefetches.

    Backward order is the reverse of post-forward order; a layer unit finishes its forward
    after its linears, so in backward it comes before them. The root unit (units.py [Note: one
    root unit]) is gathered first and finishes its forward last: it prefetches the first unit in
    forward and the last one in backward, and is itself never prefetched (it stays gathered).
    """
    root = [i for i, u in enumerate(units) if u.kind == "root" and u.params]
    idx = [i for i, u in enumerate(units) if u.kind != "root"]
    fwd_order = root + idx
    fwd = {a: b for a, b in zip(fwd_order, fwd_order[1:])}
    post_forward: list[int] = []
    pending_layer: int | None = None
    for i in idx:
        u = units[i]
        if u.kind == "layer":
            if pending_layer is not None:
                post_forward.append(pending_layer)
            pending_layer = i
        else:  # "linear": a layer's linears finish their forward before the layer does
            post_forward.append(i)
    if pending_layer is not None:
        post_forward.append(pending_layer)
    bwd_order = root + list(reversed(post_forward))
    bwd = {a: b for a, b in zip(bwd_order, bwd_order[1:])}
    return fwd, bwd


def apply_fsdp(model: torch.nn.Module, units: Sequence[Unit], shard_mesh, comm: C.CollectiveContext,
               *, name: str,
               timeout: float, overlap_allgather: bool,
               reduce_dtype: torch.dtype | None = None,
               deferred: DeferredReduceScatters | None = None) -> None:
    """``fully_shard`` every unit (children first), then the root, which keeps its parameters
    gathered from its forward into its backward (units.py [Note: one root unit]); wire comms
    and prefetch.

    ``reduce_dtype``: the reduce-scatter's dtype (None: the parameters' dtype). ``deferred``:
    where reduce-scatters left in flight wait for their hooks (deferred_rs.py)."""
    order = [u for u in units if u.kind == "linear"] + [u for u in units if u.kind not in ("linear", "root")]
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for u in order:
        fully_shard(u.module, mesh=shard_mesh, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=False, mp_policy=mp)
    modules: list[FSDPModule] = [u.module for u in units]  # type: ignore[misc]
    ag = AMSPAllGather(comm, name, timeout, overlap_allgather)
    for u, m in zip(units, modules):
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(AMSPReduceScatter(comm, name, timeout, overlap_allgather, unit=u,
                                                      deferred=deferred))
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
    fwd, bwd = prefetch_targets(units)
    if overlap_allgather and shard_mesh.device_type == "cpu":
        for m in modules:  # see [Note: FSDP2's async_op contract]
            compat.set_fsdp_unshard_async_op(m, True)
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
