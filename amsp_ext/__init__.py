"""amsp_ext: AMSP (arXiv 2311.00257) for PyTorch.

``model, optimizer = amsp_ext.shard(model, plan, optimizer_factory, config=ShardConfig(...))``.
The engine (and so torch) is imported lazily: ``amsp_ext.planner`` stays torch-free.
"""

__all__ = ["AutoPlanConfig", "FP16Config", "OverlapConfig", "ShardConfig", "shard"]

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
