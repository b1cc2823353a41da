"""The planner's inputs that every entry point defaults the same way, defined once.

``amsp plan``, ``dryrun``, ``simulate``, ``migrate``, ``config``, ``compare``, ``train``'s
``--plan auto``, the ds_config ``"amsp"`` block and the Python API (``plan_for``,
``AutoPlanConfig``) all read these: a default written out in two places drifts, and a run
planned by one entry point must be the plan another would make (tests/test_design_tree.py
checks that the literals appear nowhere else).

[Note: the GPU a plan is made for]
80 GiB is the paper's A800 (section 5 of the review) and ``paper-a800`` its bandwidth table;
the reserve is what the model cannot use on such a GPU (search.py [Note: memory reserve]).
Where a command runs the engine on this machine (``amsp train``, the integrations), the GPU
memory defaults to the device's instead (AutoPlanConfig.gpu_memory_bytes None); only the
commands that plan for a cluster they do not run on use DEFAULT_GPU_MEMORY.

Pure Python.
"""

from __future__ import annotations

__all__ = [
    "CLUSTER_PROFILE", "DEFAULT_ALL_REDUCE", "DEFAULT_GPU_MEMORY", "DEFAULT_GRAD_BUCKET_BYTES", "DEFAULT_GRANULARITY",
    "DEFAULT_PRECISION", "DEFAULT_REDUCE_DTYPE", "DEFAULT_GPU_MEMORY_BYTES", "DEFAULT_MEMORY_RESERVE",
    "DEFAULT_MISSING_MESH", "DEFAULT_OBJECTIVE", "DEFAULT_OPTIMIZER", "DEFAULT_PEAK_FLOPS", "DEFAULT_PROFILE",
    "DEFAULT_RESERVE_BYTES", "DEFAULT_SEQ_LEN", "DEFAULT_MICRO_BATCH_SIZE", "DEFAULT_MICRO_BATCHES", "A800_PEAK_FLOPS", "GiB",
]

GiB = 2**30

DEFAULT_PROFILE = "paper-a800"  # a bundled bandwidth profile (planner/profiles/)
# [Note: which profile auto plans with] Where the job runs (amsp train, amsp compare, amsp tune,
# shard(), the ds_config block), ``auto`` prices plans with a profile of that cluster: "cluster"
# is a cached profile whose fingerprint matches, else one measured in the job
# (topology/profile_cache.py, runtime/measure/cluster.py); a bundled profile only when named.
# The commands that plan for a cluster they do not run on (amsp plan, dryrun, simulate, config,
# migrate) cannot measure it: they default to DEFAULT_PROFILE and print what it describes.
CLUSTER_PROFILE = "cluster"
DEFAULT_GPU_MEMORY = "80GiB"  # as a command line or a ds_config gives it
DEFAULT_GPU_MEMORY_BYTES = 80 * GiB
DEFAULT_MEMORY_RESERVE = "2GiB"
DEFAULT_RESERVE_BYTES = 2 * GiB
DEFAULT_MISSING_MESH = "error"  # a mesh the profile lacks: refuse ("fit": alpha-beta estimate)
DEFAULT_OBJECTIVE = "comm"  # the paper's Eq. 1 ("step": compute + unhidden communication)
DEFAULT_OPTIMIZER = "adamw"  # what the engine's training routes build (choices.OPTIMIZERS)
# dense 16-bit tensor-core FLOP/s of the paper's A800 (an A100's too): the MFU denominator of a
# plan made for the paper's GPU; a calibrated profile or a detected device says its own
A800_PEAK_FLOPS = 312e12
DEFAULT_PEAK_FLOPS = A800_PEAK_FLOPS
DEFAULT_ALL_REDUCE = "flat"  # one collective per gradient all-reduce, as DDP (choices.ALL_REDUCES)
# the job's settings the engine runs with and the planner prices (EngineConfig's fields and
# TrainingSpec's): engine_config.py [Note: one default per setting] says why these values
DEFAULT_PRECISION = "fp32"
DEFAULT_REDUCE_DTYPE = "fp32"
DEFAULT_GRAD_BUCKET_BYTES = 25 * 2**20
DEFAULT_GRANULARITY = "layer"
# a step's shape where a surface names none (specs.py StepShape declares the fields with these)
DEFAULT_SEQ_LEN = 128
DEFAULT_MICRO_BATCH_SIZE = 1
DEFAULT_MICRO_BATCHES = 1
