"""amsp_ext: AMSP (arXiv 2311.00257) for PyTorch.

``model, optimizer = amsp_ext.shard(model, plan, optimizer_factory, config=ShardConfig(...))``;
``amsp_ext.save_checkpoint`` / ``load_checkpoint`` (any plan, any world size), ``switch_plan`` (another plan, in memory, mid-run) and
``consolidated_state_dict`` / ``save_pretrained`` / ``export_checkpoint`` (Hugging Face weights).
The engine (and so torch) is imported lazily: ``amsp_ext.planner`` stays torch-free.
"""

__all__ = [
    "AdaptiveConfig", "AutoPlanConfig", "CheckpointError", "FP16Config", "OverlapConfig", "ShardConfig",
    "consolidated_state_dict", "export_checkpoint", "load_checkpoint", "save_checkpoint",
    "save_pretrained", "shard", "switch_plan", "verify_checkpoint", "wait_for_save",
]

# DeepSpeed-compatible entry points (amsp_ext.integrations), also lazy
_INTEGRATIONS = ("initialize", "patch_deepspeed")
__all__ += list(_INTEGRATIONS)


def __getattr__(name):
    if name in _INTEGRATIONS:
        from amsp_ext import integrations

        return getattr(integrations, name)
    if name in __all__:
        from amsp_ext import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'amsp_ext' has no attribute {name!r}")
