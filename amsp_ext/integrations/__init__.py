"""DeepSpeed, Accelerate and HF Trainer integrations (imported lazily: torch-free until used).

- ``initialize``: ``deepspeed.initialize``'s signature and return value, running AMSP;
- ``patch_deepspeed``: route ``deepspeed.initialize`` to AMSP when ``amsp.enabled`` is true;
- ``AMSPSettings``: the ``"amsp"`` block of a ds_config.
"""

__all__ = ["AMSPDeepSpeedEngine", "AMSPSettings", "ConfigError", "initialize", "patch_deepspeed",
           "unpatch_deepspeed"]

_WHERE = {
    "AMSPDeepSpeedEngine": "amsp_ext.integrations.engine",
    "AMSPSettings": "amsp_ext.integrations.settings",
    "ConfigError": "amsp_ext.integrations.settings",
    "initialize": "amsp_ext.integrations.ds_initialize",
    "patch_deepspeed": "amsp_ext.integrations.patching",
    "unpatch_deepspeed": "amsp_ext.integrations.patching",
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'amsp_ext.integrations' has no attribute {name!r}")
