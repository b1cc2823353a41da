"""DeepSpeed MiCS on gloo: issue MiCS's shard-group all-gathers without the coalescing manager.

Symptom (DeepSpeed 0.18.9, torch 2.13 CPU, gloo): the first forward of a ``mics_shard_size`` run
fails with ``Backend gloo does not implement startCoalescing``.

[Note: cause, and why not just answer False in ``has_coalescing_manager``]
``deepspeed.runtime.zero.mics`` gathers a module's parameters with
``dist.all_gather_coalesced(..., group=param_shard_group)``, which wraps one
``all_gather_into_tensor`` per parameter in torch's ``_coalescing_manager``; gloo cannot start
coalescing. Making ``deepspeed.comm.has_coalescing_manager()`` return False (the first idea, and
what FIELD_NOTES records) sends MiCS to its fallback, the stage-3 ``all_gather_coalesced`` of
``Init``, which gathers over ``Init.ds_process_group`` - the *whole* data-parallel group - while
MiCS partitioned each parameter over the *shard* group. That only works when
``mics_shard_size`` equals the world size (MiCS degenerated to ZeRO-3); with a real shard group
(4 ranks, ``mics_shard_size=2``) it fails with ``ProcessGroupGloo::allgather: invalid tensor
size at index 0 (expected (8192), got (4096))``.

So this patch keeps MiCS's own code path and groups, and changes only how
``TorchBackend.all_gather_coalesced`` issues the batch when the group's backend cannot coalesce:
the same ``all_gather_into_tensor`` calls, each async, and a handle whose ``wait()`` waits for
all of them (the coalesced work's contract). On backends that can coalesce (NCCL), DeepSpeed's
own method runs unchanged.

Checked against DeepSpeed 0.18.9 (needed) with torch 2.13.0+cpu. DeepSpeed >= 0.19 removed MiCS
(``mics_shard_size`` raises DeepSpeedConfigError), so there the patch reports "not needed".
Applied only when a local probe shows the default process group cannot start coalescing; must
run after ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import functools

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "deepspeed_mics_gloo"
CHECKED_DEEPSPEED_VERSIONS = ("0.18.9",)
_MARK = "_amsp_mics_gloo_patch"
_CANNOT_COALESCE: set[str] = set()  # backend names the probe found unable to coalesce


def _probe_default_group() -> str | None:
    """Ask the world group to start coalescing; local only (no collective is issued)."""
    import torch
    import torch.distributed as tdist

    from amsp_ext.runtime import _torch_compat as compat

    if not tdist.is_initialized():
        raise RuntimeError(f"{NAME}: call after torch.distributed.init_process_group")
    group = compat.default_group()
    device = torch.device("cpu")
    try:
        compat.start_coalescing(group, device)
    except RuntimeError as e:
        _CANNOT_COALESCE.add(str(tdist.get_backend(group)))
        return str(e).splitlines()[0]
    compat.end_coalescing(group, device)
    return None


class _AllWorks:
    """One handle for several async works; ``wait()`` waits for every one, in issue order."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def needed() -> str | None:
    try:
        import deepspeed.runtime.zero.mics  # noqa: F401
        from deepspeed.comm.torch import TorchBackend
    except ImportError:
        return None
    if getattr(TorchBackend.all_gather_coalesced, _MARK, False):
        return None
    return _probe_default_group()


def apply() -> str:
    import deepspeed

    why = needed()
    if why is None:
        return "not needed: no MiCS in this DeepSpeed, or the backend can coalesce"
    warn_unchecked(NAME, "DeepSpeed", deepspeed.__version__, CHECKED_DEEPSPEED_VERSIONS,
                   f"applying because the probe says: {why}")
    import torch.distributed as tdist
    from deepspeed.comm.torch import TorchBackend

    original = TorchBackend.all_gather_coalesced

    @functools.wraps(original)
    def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):
        if str(tdist.get_backend(group)) not in _CANNOT_COALESCE:
            return original(self, output_tensors, input_tensors, group=group, async_op=async_op)
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for "
                             f"{len(input_tensors)} inputs")
        handle = _AllWorks([
            tdist.all_gather_into_tensor(out, inp, group=group, async_op=True)
            for out, inp in zip(output_tensors, input_tensors)
        ])
        if async_op:
            return handle
        handle.wait()
        return None

    setattr(all_gather_coalesced, _MARK, True)
    TorchBackend.all_gather_coalesced = all_gather_coalesced
    return f"applied (DeepSpeed {deepspeed.__version__}): {why}"
