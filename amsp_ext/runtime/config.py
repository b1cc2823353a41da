"""The engine's config: ShardConfig is amsp_ext.engine_config.EngineConfig (one definition for
every route); here only what needs torch: the torch dtypes derived from its names."""

from __future__ import annotations

import torch

from amsp_ext import choices
from amsp_ext.engine_config import (AdaptiveConfig, AutoPlanConfig, EngineConfig, FP16Config,
                                    OverlapConfig, training_spec)

__all__ = ["AdaptiveConfig", "AutoPlanConfig", "EngineConfig", "FP16Config", "OverlapConfig",
           "PRECISIONS", "ShardConfig", "compute_dtype", "training_spec", "reduce_dtype_of"]

ShardConfig = EngineConfig  # the name the engine's API has always used

# the torch dtype of each precision name (amsp_ext.choices.PRECISIONS): the one map; the tools
# and the applications read PRECISIONS
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = {name: _DTYPES[name] for name in choices.PRECISIONS}


def compute_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype parameters and gradients are computed in."""
    return PRECISIONS[config.precision]


def reduce_dtype_of(config: EngineConfig) -> torch.dtype:
    """The dtype gradients are reduced and accumulated in."""
    return PRECISIONS[config.reduce_dtype]
