"""The AMSP engine: ``shard(model, plan, optimizer_factory, config=ShardConfig(...))``.

One folder per concern (docs/DESIGN.md): ``sync/`` (the FSDP units, gradient and parameter
synchronisation), ``optim/`` (the optimizer over owned masters, ownership, layout, the
non-finite guard, loss scaling), ``state/`` (checkpoints, their files, export), ``replan/``
(switching plans, adaptive AMSP) and ``measure/`` (comm trace, peak, the CPU bf16 probe); ``shard.py``,
``engine.py``, ``collectives.py`` (the only module that issues collectives) and
``_torch_compat.py`` (every private torch name) at the top.
"""

from amsp_ext.runtime.collectives import CollectiveTimeout
from amsp_ext.runtime.config import AdaptiveConfig, AutoPlanConfig, FP16Config, OverlapConfig, ShardConfig
from amsp_ext.runtime.engine import AMSPModule, Engine
from amsp_ext.runtime.preflight import MismatchError
from amsp_ext.runtime.optim.optimizer import AMSPOptimizer
from amsp_ext.runtime.replan.switch import switch_plan
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.state.checkpoint import (CheckpointError, PendingSave, checkpoint_step, load_checkpoint,
                                               read_checkpoint_meta, save_checkpoint, verify_checkpoint,
                                               wait_for_save)
from amsp_ext.runtime.state.export import consolidated_state_dict, export_checkpoint, save_pretrained
from amsp_ext.runtime.sync.units import list_units, unit_param_counts

__all__ = [
    "AdaptiveConfig", "AMSPModule", "AMSPOptimizer", "AutoPlanConfig", "CheckpointError", "CollectiveTimeout",
    "checkpoint_step", "Engine", "FP16Config", "MismatchError", "OverlapConfig", "ShardConfig",
    "consolidated_state_dict", "export_checkpoint", "list_units", "load_checkpoint", "PendingSave",
    "read_checkpoint_meta", "save_checkpoint", "save_pretrained", "shard", "switch_plan",
    "unit_param_counts", "verify_checkpoint", "wait_for_save",
]
