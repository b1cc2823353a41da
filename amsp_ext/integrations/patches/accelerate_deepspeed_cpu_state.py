"""Accelerate's DeepSpeed mode on CPU: make ``PartialState`` see the real world (ranks, data sharding).

Symptom (accelerate 1.15.0, DeepSpeed 0.18.9, torch 2.13 CPU, gloo; seen with ``accelerate launch``
of a DEEPSPEED-type config and with the HF Trainer's ``deepspeed=``): every rank reports
``num_processes == 1`` and ``process_index == 0`` while torch.distributed has a world of N, so the
dataloaders are not sharded (each rank trains on the whole data set) and the Trainer computes
``train_batch_size`` for a world of 1.

[Note: cause]
``PartialState.__init__`` picks its backend from the accelerator it finds (``_prepare_backend``):
with no CUDA/XPU/NPU/... device and ``cpu=False`` (DeepSpeed mode must not pass ``cpu=True``:
``AcceleratorState`` would then drop DeepSpeed, and so would ``ACCELERATE_USE_CPU``), the backend
is None. DeepSpeed's ``init_distributed`` still forms the gloo group, but the ``backend is None``
branch then sets ``num_processes = 1, process_index = 0`` before the type is switched to
DEEPSPEED.

[Note: the fix]
After the original ``__init__``, if the state is DEEPSPEED with backend None while torch.distributed
is initialised with a larger world, set ``backend``, ``num_processes``, ``process_index`` and
``local_process_index`` from torch.distributed (the values the GPU path computes). The shared
state is fixed once; nothing else changes. Applied only when the running Accelerate shows the
problem (a probe of the code path is not possible without a process group, so the check is
made on the state itself, every time it is built).

Acts only for a ds_config with an ``"amsp"`` block (amsp_ext.integrations.guard): other DeepSpeed
jobs under Accelerate are left exactly as Accelerate makes them.

Checked against accelerate 1.15.0.
"""

from __future__ import annotations

import functools
import os

from amsp_ext.integrations.patches.checked_versions import warn_unchecked

NAME = "accelerate_deepspeed_cpu_state"
CHECKED_ACCELERATE_VERSIONS = ("1.15.0",)
_MARK = "_amsp_cpu_state_patch"


def fix_state(state) -> bool:
    """Correct a DEEPSPEED ``PartialState`` that missed the world; True when it changed it."""
    import torch.distributed as tdist
    from accelerate.utils import DistributedType

    from amsp_ext.integrations.guard import amsp_block_in_play

    # cheap checks first: accelerate builds PartialState() on every logging call
    if not getattr(state, "initialized", False) or state.distributed_type != DistributedType.DEEPSPEED:
        return False
    if state.backend is not None or not tdist.is_initialized():
        return False
    if state.num_processes == tdist.get_world_size() or not amsp_block_in_play():
        return False
    state.backend = tdist.get_backend()
    state.num_processes = tdist.get_world_size()
    state.process_index = tdist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", tdist.get_rank()))
    return True


def apply() -> str:
    import accelerate
    from accelerate.state import PartialState

    if getattr(PartialState.__init__, _MARK, False):
        return "already applied"
    warn_unchecked(NAME, "accelerate", accelerate.__version__, CHECKED_ACCELERATE_VERSIONS,
                   "the fix only acts on a DEEPSPEED "
                   "state whose world disagrees with torch.distributed")
    original = PartialState.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        fix_state(self)

    setattr(__init__, _MARK, True)
    PartialState.__init__ = __init__
    fix_shared_state()  # a state built before the patch
    from amsp_ext.integrations.guard import on_note

    # the HF Trainer builds its state before it reads the ds_config (TrainingArguments'
    # device setup runs first): fix it once the config with the amsp block is seen
    on_note(fix_shared_state)
    return f"applied (accelerate {accelerate.__version__})"


def fix_shared_state() -> None:
    """Fix a state built earlier (shared by every PartialState), and AcceleratorState's copy."""
    from accelerate.state import AcceleratorState, PartialState

    if not PartialState._shared_state:
        return
    state = object.__new__(PartialState)  # a view of the shared state, without running __init__
    state.__dict__ = PartialState._shared_state
    if fix_state(state):
        if "num_processes" in AcceleratorState._shared_state:
            for key in ("backend", "num_processes", "process_index", "local_process_index"):
                AcceleratorState._shared_state[key] = PartialState._shared_state[key]
