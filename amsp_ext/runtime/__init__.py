"""The AMSP engine: ``shard(model, plan, optimizer_factory, config=ShardConfig(...))``."""

from amsp_ext.runtime.checkpoint import (CheckpointError, PendingSave, checkpoint_step, load_checkpoint,
                                         read_checkpoint_meta, save_checkpoint, verify_checkpoint, wait_for_save)
from amsp_ext.runtime.collectives import CollectiveTimeout
from amsp_ext.runtime.config import AdaptiveConfig, AutoPlanConfig, FP16Config, OverlapConfig, ShardConfig
from amsp_ext.runtime.engine import AMSPModule, Engine, MismatchError
from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.export import consolidated_state_dict, export_checkpoint, save_pretrained
from amsp_ext.runtime.optimizer import AMSPOptimizer
from amsp_ext.runtime.switch import switch_plan
from amsp_ext.runtime.units import list_units, unit_param_counts

__all__ = [
    "AdaptiveConfig", "AMSPModule", "AMSPOptimizer", "AutoPlanConfig", "CheckpointError", "CollectiveTimeout", "checkpoint_step", "Engine",
    "FP16Config", "MismatchError", "OverlapConfig", "ShardConfig", "consolidated_state_dict",
    "export_checkpoint", "list_units", "load_checkpoint", "PendingSave", "read_checkpoint_meta", "save_checkpoint",
    "save_pretrained", "shard", "switch_plan", "unit_param_counts", "verify_checkpoint", "wait_for_save",
]
