"""What becomes of each DeepSpeed config key under AMSP: one table, used by ``amsp migrate`` (which
reports every key it does not map) and by ``amsp_ext.initialize`` (which warns about keys that
change DeepSpeed's training and that AMSP does not honour). Never silent.

Statuses:
- ``mapped``: AMSP honours it (batch, precision, clipping, optimizer, scheduler) or the
  migration reads it into the plan/amsp block (ZeRO stage, hpZ, MiCS, bucket size, overlap);
- ``superseded``: a ZeRO knob whose job the AMSP plan and engine do differently;
- ``ignored``: logging, profiling or bookkeeping with no effect on the trained weights;
- ``unsupported``: changes what DeepSpeed trains or stores, and AMSP does not do it.

Pure Python.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["classify", "walk"]

_TOP = {
    "train_batch_size": ("mapped", "global batch"),
    "train_micro_batch_size_per_gpu": ("mapped", "micro-batch per rank"),
    "gradient_accumulation_steps": ("mapped", "micro-batches per step (M)"),
    "gradient_clipping": ("mapped", "exact global-norm clipping"),
    "optimizer": ("mapped", "rebuilt over AMSP's fp32 masters"),
    "scheduler": ("mapped", "DeepSpeed's schedule classes over the AMSP optimizer"),
    "amsp": ("mapped", "the AMSP block"),
    "zero_allow_untested_optimizer": ("ignored", "AMSP runs any torch optimizer"),
    "zero_force_ds_cpu_optimizer": ("ignored", "no CPU offload under AMSP"),
    "steps_per_print": ("ignored", "DeepSpeed progress logging"),
    "wall_clock_breakdown": ("ignored", "DeepSpeed timers; use the torch profiler (amsp:: labels)"),
    "dump_state": ("ignored", "DeepSpeed debug dump"),
    "memory_breakdown": ("ignored", "DeepSpeed memory logging"),
    "tensorboard": ("ignored", "DeepSpeed monitor"),
    "wandb": ("ignored", "DeepSpeed monitor"),
    "csv_monitor": ("ignored", "DeepSpeed monitor"),
    "comet": ("ignored", "DeepSpeed monitor"),
    "flops_profiler": ("ignored", "DeepSpeed profiler"),
    "comms_logger": ("ignored", "DeepSpeed comms logging"),
    "timers": ("ignored", "DeepSpeed timers"),
    "checkpoint": ("ignored", "DeepSpeed checkpoint-engine options; AMSP uses torch.distributed.checkpoint"),
    "dataloader_drop_last": ("mapped", "the training_data loader"),
    "prescale_gradients": ("superseded", "AMSP averages once after the reduction (fp16: before)"),
    "gradient_predivide_factor": ("superseded", "AMSP averages once after the reduction (fp16: before)"),
    "communication_data_type": ("mapped", "gradient reduce dtype (ShardConfig.reduce_dtype; absent: fp32)"),
    "data_types": ("mapped", "grad_accum_dtype: AMSP accumulates in the reduce dtype (must agree)"),
    "sparse_gradients": ("unsupported", "dense gradients only"),
    "amp": ("unsupported", "NVIDIA Apex AMP; use bf16 or fp16"),
    "torch_autocast": ("unsupported", "AMSP casts parameters to the compute dtype instead of autocast"),
    "activation_checkpointing": ("unsupported", "DeepSpeed's checkpointing API; set amsp.recompute or "
                                                "call model.gradient_checkpointing_enable()"),
    "pipeline": ("unsupported", "no pipeline parallelism"),
    "tensor_parallel": ("unsupported", "no tensor parallelism (AutoTP)"),
    "sequence_parallel_size": ("unsupported", "no sequence parallelism"),
    "data_parallel_size": ("unsupported", "AMSP's data-parallel world is the whole world"),
    "compression_training": ("unsupported", "DeepSpeed compression"),
    "data_efficiency": ("unsupported", "DeepSpeed data efficiency"),
    "curriculum_learning": ("unsupported", "DeepSpeed curriculum learning"),
    "progressive_layer_drop": ("unsupported", "DeepSpeed progressive layer drop"),
    "eigenvalue": ("unsupported", "DeepSpeed eigenvalue quantisation"),
    "elasticity": ("unsupported", "DeepSpeed elasticity"),
    "aio": ("unsupported", "NVMe offload I/O"),
    "hybrid_engine": ("unsupported", "DeepSpeed RLHF hybrid engine"),
    "sparse_attention": ("unsupported", "DeepSpeed sparse attention kernels"),
    "compile": ("unsupported", "DeepSpeed compile options; compile each decoder block yourself: "
                "block.compile(), before or after shard (docs/usage.md, 'torch.compile per block')"),
    "moe": ("unsupported", "expert parallelism"),
}

_PRECISION = {
    "enabled": ("mapped", "compute dtype"),
    "loss_scale": ("mapped", "0: dynamic; a static value starts the dynamic scale there"),
    "initial_scale_power": ("mapped", "initial dynamic loss scale 2**power"),
    "loss_scale_window": ("mapped", "good steps before the scale grows"),
    "min_loss_scale": ("mapped", "floor of the dynamic scale"),
    "hysteresis": ("superseded", "AMSP backs off at every overflow (hysteresis 1)"),
    "consecutive_hysteresis": ("superseded", "AMSP backs off at every overflow"),
    "auto_cast": ("unsupported", "inputs are not cast; cast floating inputs to the compute dtype"),
    "fp16_master_weights_and_grads": ("unsupported", "masters are always fp32"),
    "immediate_grad_update": ("superseded", "AMSP's gradient buckets replace it"),
    "check_grad_overflow": ("mapped", "fp16 overflow check (always on under fp16)"),
    "type": ("ignored", "legacy key"),
}

_ZERO = {
    "stage": ("mapped", "read as the old layout's factors; the AMSP plan replaces it"),
    "zero_hpz_partition_size": ("mapped", "ZeRO++ hpZ: read as the old layout"),
    "mics_shard_size": ("mapped", "MiCS: read as the old layout (mics:K)"),
    "reduce_bucket_size": ("mapped", "gradient bucket U (elements x bytes per element)"),
    "overlap_comm": ("mapped", "amsp.overlap.allreduce"),
    "gather_16bit_weights_on_model_save": ("mapped", "AMSP always has the consolidated 16-bit state dict"),
    "stage3_gather_16bit_weights_on_model_save": ("mapped", "AMSP always has the consolidated 16-bit state dict"),
    "stage3_gather_fp16_weights_on_model_save": ("mapped", "AMSP always has the consolidated 16-bit state dict"),
    "prefetch_bucket_size": ("superseded", "AMSP prefetches one sharding unit ahead (amsp.overlap.allgather)"),
    "stage3_prefetch_bucket_size": ("superseded", "AMSP prefetches one sharding unit ahead (amsp.overlap.allgather)"),
    "allgather_bucket_size": ("superseded", "AMSP gathers per sharding unit (amsp.granularity); "
                              "post-step broadcasts pack into half-bucket items"),
    "allgather_partitions": ("superseded", "AMSP broadcasts updated parameters from their owners"),
    "reduce_scatter": ("superseded", "AMSP reduces per the plan (AllReduce buckets, ReduceScatter when sp > 1)"),
    "contiguous_gradients": ("superseded", "AMSP copies gradients into buckets"),
    "round_robin_gradients": ("superseded", "AMSP assigns optimizer-state owners (amsp.ownership)"),
    "param_persistence_threshold": ("superseded", "AMSP shards every unit of a sharded plan"),
    "stage3_param_persistence_threshold": ("superseded", "AMSP shards every unit of a sharded plan"),
    "model_persistence_threshold": ("superseded", "AMSP shards every unit of a sharded plan"),
    "stage3_model_persistence_threshold": ("superseded", "AMSP shards every unit of a sharded plan"),
    "max_live_parameters": ("superseded", "AMSP keeps two gathered units (current + prefetch)"),
    "stage3_max_live_parameters": ("superseded", "AMSP keeps two gathered units (current + prefetch)"),
    "max_reuse_distance": ("superseded", "AMSP re-gathers each unit in backward"),
    "stage3_max_reuse_distance": ("superseded", "AMSP re-gathers each unit in backward"),
    "sub_group_size": ("superseded", "AMSP steps owned tensors one at a time"),
    "mics_hierarchical_params_gather": ("superseded", "AMSP's 2-D meshes already follow the node boundary"),
    "module_granularity_threshold": ("superseded", "amsp.granularity"),
    "use_all_reduce_for_fetch_params": ("superseded", "AMSP's plan decides the collectives"),
    "allgather_sequential": ("superseded", "AMSP's plan decides the collectives"),
    "use_multi_rank_bucket_allreduce": ("superseded", "AMSP's plan decides the collectives"),
    "ignore_unused_parameters": ("mapped", "unused parameters get zero gradients"),
    "elastic_checkpoint": ("ignored", "AMSP checkpoints reshard through torch.distributed.checkpoint"),
    "load_from_fp32_weights": ("ignored", "AMSP checkpoints hold the fp32 masters"),
    "legacy_stage1": ("ignored", "legacy key"),
    "memory_efficient_linear": ("ignored", "ZeRO-3 linear wrapper"),
    "offload_optimizer": ("unsupported", "AMSP keeps optimizer states on the GPU (shard them instead: os=...)"),
    "offload_param": ("unsupported", "AMSP keeps parameters on the GPU (shard them instead: p=...)"),
    "cpu_offload": ("unsupported", "AMSP keeps optimizer states on the GPU"),
    "cpu_offload_param": ("unsupported", "AMSP keeps parameters on the GPU"),
    "cpu_offload_use_pin_memory": ("unsupported", "no offload"),
    "zenflow": ("unsupported", "no offload"),
    "zero_quantized_weights": ("unsupported", "qwZ: AMSP gathers unquantised weights"),
    "zero_quantized_nontrainable_weights": ("unsupported", "qwZ: AMSP gathers unquantised weights"),
    "zero_quantized_gradients": ("unsupported", "qgZ: AMSP reduces unquantised gradients"),
    "zeropp_loco_param": ("unsupported", "ZeRO++ LoCo"),
    "pipeline_loading_checkpoint": ("unsupported", "pipeline checkpoint loading"),
    "leaf_module": ("superseded", "AMSP's sharding units come from amsp.granularity"),
    "override_module_apply": ("ignored", "ZeRO-3 Init detail"),
    "log_trace_cache_warnings": ("ignored", "ZeRO-3 logging"),
    "enable_sanity_checks": ("ignored", "ZeRO-3 debug checks"),
    "save_muon_momentum_buffer_in_memory": ("ignored", "Muon detail"),
}


def _disabled(key: str, value: Any) -> bool:
    """A block present but switched off: ``{"enabled": false}``, ``{"device": "none"}``,
    ``{"autotp_size": 1}``, a ``*_size`` of 0 or 1, ``false``, ``0``, ``null``."""
    if isinstance(value, Mapping):
        return (value.get("enabled") is False
                or ("device" in value and value.get("device") in (None, "none"))
                or (key == "tensor_parallel" and value.get("autotp_size", 0) in (0, 1)))
    if key.endswith("_size") and value in (0, 1):
        return True
    return value in (None, False, 0)


def walk(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, status, note)`` for every key AMSP has an opinion on, in file order.

    Sub-keys of ``zero_optimization``, ``fp16`` and ``bf16`` are listed one by one; other blocks
    as a whole. A block that is present but disabled is ``ignored``.
    """
    for key, value in config.items():
        if key == "zero_optimization" and isinstance(value, Mapping):
            for sub, v in value.items():
                status, note = _ZERO.get(sub, ("unsupported", "unknown ZeRO option"))
                if status == "unsupported" and _disabled(sub, v):
                    status, note = "ignored", "present but disabled"
                yield f"zero_optimization.{sub}", status, note
            continue
        if key in ("fp16", "bf16", "bfloat16") and isinstance(value, Mapping):
            for sub, v in value.items():
                status, note = _PRECISION.get(sub, ("unsupported", "unknown precision option"))
                yield f"{key}.{sub}", status, note
            continue
        status, note = _TOP.get(key, ("unsupported", "not a key AMSP knows"))
        if status == "unsupported" and _disabled(key, value):
            status, note = "ignored", "present but disabled"
        yield key, status, note


def classify(config: Mapping[str, Any], *statuses: str) -> list[tuple[str, str, str]]:
    return [row for row in walk(config) if row[1] in statuses]


# [Note: what `amsp migrate` takes out of the written config]
# Keys that frameworks read *next to* DeepSpeed, so that leaving them in makes the job differ
# from what AMSP runs: the HF Trainer and Accelerate build DeepSpeed's CPU Adam and move states
# to the host when they see an offload device, RLHF scripts drive the hybrid engine's generate
# path. migrate removes them when they
# are active (a disabled block stays) and lists each; with ``"enabled": false`` DeepSpeed then
# runs without them too (the listing says so). ZeRO-3's ``deepspeed.zero.Init`` needs no
# rewrite: ``stage`` stays for ``"enabled": false``, and under AMSP the start-up hook reports
# stage 0 to transformers and Accelerate (patches/accelerate_amsp_block.py), which migrate lists.
REMOVED_ON_MIGRATE = {
    "zero_optimization.offload_optimizer": "the Trainer/Accelerate would build DeepSpeed's CPU Adam; "
                                           "AMSP shards optimizer states instead (os=...)",
    "zero_optimization.offload_param": "AMSP keeps parameters on the device; it shards them instead (p=...)",
    "zero_optimization.cpu_offload": "legacy offload switch; AMSP shards optimizer states instead",
    "zero_optimization.cpu_offload_param": "legacy offload switch; AMSP shards parameters instead",
    "zero_optimization.cpu_offload_use_pin_memory": "offload detail",
    "zero_optimization.zenflow": "ZenFlow offload",
    "aio": "NVMe offload I/O",
    "hybrid_engine": "DeepSpeed-Chat's hybrid engine (generate/train switching) has no AMSP counterpart",
}


def strip_unhonoured(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The config without the active keys of ``REMOVED_ON_MIGRATE``, and ``(key, why)`` for
    each removed one plus the ZeRO-3 ``zero.Init`` row (kept, but not acted on under AMSP)."""
    import copy

    out = copy.deepcopy(dict(config))
    rows: list[tuple[str, str]] = []
    for key, status, _ in walk(config):
        if key not in REMOVED_ON_MIGRATE or status != "unsupported":
            continue
        block, _, sub = key.partition(".")
        if sub:
            out[block].pop(sub)
        else:
            out.pop(block)
        rows.append((key, f"removed: {REMOVED_ON_MIGRATE[key]} (with \"enabled\": false DeepSpeed "
                          f"now runs without it too)"))
    if (config.get("zero_optimization") or {}).get("stage") == 3:
        rows.append(("zero_optimization.stage", "kept at 3 for \"enabled\": false; under AMSP "
                                                "transformers and Accelerate see stage 0, so no "
                                                "model is built inside deepspeed.zero.Init"))
    return out, rows
