"""The AMSP engine: ``shard(model, plan, optimizer_factory, config=ShardConfig(...))``.

One folder per concern (docs/DESIGN.md): ``sync/`` (the FSDP units, gradient and parameter
synchronisation), ``optim/`` (the optimizer over owned masters, ownership, layout, the
non-finite guard, loss scaling), ``state/`` (checkpoints, their files, export), ``replan/``
(switching plans, adaptive AMSP) and ``measure/`` (profiler, comm trace, peak); ``shard.py``,
``engine.py``, ``collectives.py`` (the only module that issues collectives) and
``_torch_compat.py`` (every private torch name) at the top.

The names below are loaded on first use, so importing one submodule (``topology/mesh.py``
needs ``_torch_compat``) does not import the whole engine.
"""

from importlib import import_module

_HOME = {
    "amsp_ext.runtime.state.checkpoint": ("CheckpointError", "PendingSave", "checkpoint_step",
                                          "load_checkpoint", "read_checkpoint_meta",
                                          "save_checkpoint", "verify_checkpoint", "wait_for_save"),
    "amsp_ext.runtime.collectives": ("CollectiveTimeout",),
    "amsp_ext.runtime.config": ("AdaptiveConfig", "AutoPlanConfig", "FP16Config", "OverlapConfig",
                                "ShardConfig"),
    "amsp_ext.runtime.engine": ("AMSPModule", "Engine", "MismatchError"),
    "amsp_ext.runtime.shard": ("shard",),
    "amsp_ext.runtime.state.export": ("consolidated_state_dict", "export_checkpoint", "save_pretrained"),
    "amsp_ext.runtime.optim.optimizer": ("AMSPOptimizer",),
    "amsp_ext.runtime.replan.switch": ("switch_plan",),
    "amsp_ext.runtime.sync.units": ("list_units", "unit_param_counts"),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'amsp_ext.runtime' has no attribute {name!r}")
