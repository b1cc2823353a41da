"""``amsp_ext.initialize``: ``deepspeed.initialize``'s signature and return value, running AMSP.

    engine, optimizer, dataloader, lr_scheduler = amsp_ext.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

[Note: order]
1. Read the config (dict, path, JSON string, or ``args.deepspeed_config``) and validate every
   key AMSP uses - the amsp block, batch keys, precision, clipping, optimizer and scheduler
   blocks - raising a one-line ConfigError before any collective.
2. Initialise torch.distributed if it is not (env://; NCCL with CUDA, else gloo), as
   ``deepspeed.initialize`` does.
3. Broadcast rank 0's parameters and buffers to every rank (DeepSpeed's ``_broadcast_model``):
   AMSP assumes identical replicas, and a script that seeds per rank must not diverge silently.
   A model on meta is not broadcast: ``from_pretrained`` under an AMSP config built it there
   and named its folder (patches/transformers_meta_load.py), which ``shard`` reads each rank's
   share of; one the script built on meta gets the seeded initializer's values.
4. ``amsp_ext.shard`` with the plan, the ShardConfig built from the block and the DeepSpeed
   keys, and the optimizer rebuilt over the masters (integrations.optim); then the scheduler,
   the dataloader (integrations.dataloader) and the engine. The sharded model's
   ``state_dict()`` is the full one from here on (runtime/engine.py [Note: state dicts on the
   integration routes]): ``engine.module`` is what scripts save.
5. Rank 0 logs the plan (``[amsp] plan ...``) unless ``amsp.log_plan`` is false.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.integrations import ds_keys
from amsp_ext.integrations.engine import AMSPDeepSpeedEngine
from amsp_ext.integrations.optim import build_optimizer_factory, build_scheduler
from amsp_ext.planner.plan import is_auto
from amsp_ext.integrations.settings import (
    AMSPSettings, BatchSettings, ConfigError, PrecisionSettings, config_origin, ds_bucket_bytes,
    gradient_clipping, load_ds_config, resolve_batch,
)

__all__ = ["initialize", "resolve_config"]

logger = logging.getLogger("amsp_ext")


def resolve_config(args: Any = None, config: Any = None, config_params: Any = None) -> dict[str, Any]:
    """The ds_config as ``deepspeed.initialize`` finds it: ``config``, else ``config_params``,
    else ``args.deepspeed_config`` (or the deprecated ``args.deepscale_config``)."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("a ds_config was given both in args.deepspeed_config and as config=; give one")
        config = from_args
    if config is None:
        raise ConfigError("no ds_config: pass config= (a dict or a path) or args.deepspeed_config")
    return load_ds_config(config)


def _init_distributed(dist_init_required: bool | None) -> None:
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ConfigError("dist_init_required=False but torch.distributed is not initialized")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("torch.distributed is not initialized and RANK/WORLD_SIZE are not set: "
                          "launch with torchrun, deepspeed or accelerate launch")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")


def _check_mpu(mpu: Any) -> None:
    """Megatron-style scripts always pass their ``mpu``; AMSP accepts it when every model-parallel
    dimension it reports is 1 (the data-parallel group is then the world)."""
    if mpu is None:
        return
    sizes = {}
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size",
                 "get_pipeline_model_parallel_world_size", "get_sequence_parallel_world_size"):
        fn = getattr(mpu, name, None)
        if callable(fn):
            sizes[name.removeprefix("get_").removesuffix("_world_size")] = int(fn())
    bad = {k: v for k, v in sizes.items() if v != 1}
    if bad:
        raise ConfigError(f"mpu: AMSP runs data parallelism only; this job has "
                          f"{', '.join(f'{k} size {v}' for k, v in bad.items())}")
    fn = getattr(mpu, "get_data_parallel_world_size", None)
    if callable(fn) and int(fn()) != dist.get_world_size():
        raise ConfigError(f"mpu: data-parallel size {fn()} differs from the world size "
                          f"{dist.get_world_size()}; AMSP shards over the whole world")


def _broadcast_model(comm, model: nn.Module, timeout: float) -> None:
    from amsp_ext.runtime import collectives as C

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if device is not None and t.device != device:
                t.data = t.data.to(device)
            C.broadcast(comm, t.data, 0, None, name="world", stream=None, async_op=False,
                        timeout=timeout)  # blocking, before anything reads the model


def _shard_config(settings: AMSPSettings, cfg: Mapping[str, Any], prec: PrecisionSettings,
                  batch: BatchSettings):
    from amsp_ext.runtime.config import AutoPlanConfig, FP16Config

    # the step's shape and the planner's inputs, for the job shard() resolves (amsp_ext/job.py):
    # AMSPSettings refuses a block that must be priced without amsp.seq_len
    auto = None
    if settings.seq_len is not None:
        auto = AutoPlanConfig(seq_len=settings.seq_len, micro_batch_size=batch.micro_batch_size,
                              num_micro_batches=batch.gradient_accumulation_steps,
                              profile=settings.profile, objective=settings.objective,
                              missing=settings.missing_mesh, frozen_models=settings.frozen_models,
                              gpu_memory_bytes=settings.gpu_memory_bytes)
    fp16 = FP16Config(initial_scale=prec.initial_scale, growth_interval=prec.growth_interval,
                      min_scale=prec.min_scale)
    return settings.engine_config(precision=prec.precision, reduce_dtype=prec.reduce_dtype, fp16=fp16,
                                  ds_bucket_bytes=ds_bucket_bytes(cfg, prec.precision), auto=auto)


def _dataloader(training_data, batch: BatchSettings, collate_fn, cfg: Mapping[str, Any]):
    if training_data is None:
        return None
    from amsp_ext.integrations.dataloader import AMSPDataLoader

    return AMSPDataLoader(training_data, batch_size=batch.micro_batch_size, rank=dist.get_rank(),
                          world_size=dist.get_world_size(), collate_fn=collate_fn,
                          drop_last=bool(cfg.get("dataloader_drop_last", False)))


def plan_line(sharded, settings: AMSPSettings, prec: PrecisionSettings, batch: BatchSettings,
              clip: float, opt_source: str, scheduler) -> str:
    """``[amsp] plan ...``: what runs, in one line. "GPU(s)" only where the ranks have GPUs."""
    w, plan = sharded.amsp.world, sharded.amsp.plan
    source = ("planner" if is_auto(settings.plan)
              else "" if settings.plan == str(plan) else settings.plan)
    device = sharded.amsp.device
    backend = dist.get_backend() if dist.is_initialized() else "no process group"
    per_node = (f"{w.gpus_per_node} GPU(s)" if device.type == "cuda"
                else f"{w.gpus_per_node} rank(s) on {device.type.upper()} ({backend})")
    return (f"[amsp] plan {plan}{f' ({source})' if source else ''} "
            f"on {w.num_nodes} node(s) x {per_node}; {prec.precision} (gradients reduced in "
            f"{prec.reduce_dtype}); batch "
            f"{batch.micro_batch_size} x {batch.gradient_accumulation_steps} x {w.size} = "
            f"{batch.train_batch_size}; clipping {clip or 'off'}; optimizer {opt_source}; "
            f"scheduler {type(scheduler).__name__ if scheduler is not None else 'none'}")


def _warn_unsupported(cfg: Mapping[str, Any]) -> None:
    rows = ds_keys.classify(cfg, "unsupported")
    if rows and dist.get_rank() == 0:
        for key, _, note in rows:
            warnings.warn(f"amsp: ds_config key {key!r} is not honoured under AMSP: {note}", stacklevel=3)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None):
    """``deepspeed.initialize`` for AMSP: returns ``(engine, optimizer, dataloader, lr_scheduler)``."""
    del distributed_port  # torch's env:// rendezvous reads MASTER_PORT
    cfg = resolve_config(args, config, config_params)
    if model is None:
        raise ConfigError("initialize requires a model")
    if mesh_param is not None:
        raise ConfigError("mesh_param: AMSP runs data parallelism only (no sequence parallelism)")
    if type(model).__name__ == "PipelineModule":
        raise ConfigError("model is a DeepSpeed PipelineModule: AMSP has no pipeline parallelism")
    settings = AMSPSettings.from_dict(cfg.get("amsp"), origin=config_origin(config or config_params, args))
    prec = PrecisionSettings.from_ds(cfg)
    clip = gradient_clipping(cfg)
    factory, opt_source = build_optimizer_factory(
        model, client_optimizer=optimizer, model_parameters=model_parameters, ds_config=cfg)
    _init_distributed(dist_init_required)  # a rendezvous, not a collective
    _check_mpu(mpu)
    batch = resolve_batch(cfg, dist.get_world_size())
    shard_config = _shard_config(settings, cfg, prec, batch)
    _warn_unsupported(cfg)
    if prec.notes and dist.get_rank() == 0:
        for note in prec.notes:
            warnings.warn(f"amsp: {note}", stacklevel=2)

    from amsp_ext.runtime.collectives import CollectiveContext
    from amsp_ext.runtime.shard import check_not_sharded, shard

    from amsp_ext.integrations.patches.transformers_meta_load import adopt
    from amsp_ext.runtime.materialize import model_on_meta

    prior = getattr(model, "amsp", None)
    if prior is not None and prior.forward_only and factory is not None:
        # evaluated before training (patches/transformers_ds_inference.py): whole again, then trained
        from amsp_ext.runtime.replan.switch import release_forward_only

        release_forward_only(model)
    check_not_sharded(model)  # [Note: one engine per parameter], before the broadcast
    comm = CollectiveContext(timeout=settings.engine.timeout)  # the engine's, from the first broadcast
    folder = adopt(model)  # [Note: which from_pretrained loads on meta]: no whole fill from here on
    on_meta = model_on_meta(model)
    if not on_meta:  # a model on meta gets the same values everywhere from its file or seed
        _broadcast_model(comm, model, settings.engine.timeout)
    init_from = folder if on_meta else None
    sharded, amsp_opt = shard(model, settings.plan, factory, config=shard_config, comm=comm,
                              init_from=init_from)
    sharded.amsp.full_state_dict = True  # engine.module saves like the user's model
    scheduler = build_scheduler(amsp_opt, client_scheduler=lr_scheduler, ds_config=cfg)
    loader = _dataloader(training_data, batch, collate_fn, cfg)
    engine = AMSPDeepSpeedEngine(module=sharded, optimizer=amsp_opt, lr_scheduler=scheduler,
                                 config=cfg, batch=batch, gradient_clipping=clip, settings=settings,
                                 training_dataloader=loader)
    if settings.log_plan and dist.get_rank() == 0:
        msg = plan_line(sharded, settings, prec, batch, clip, opt_source, scheduler)
        sys.stdout.write(msg + "\n")  # one write: other ranks may share this stdout
        sys.stdout.flush()
        logger.debug(msg)  # debug: a script's logging.basicConfig(INFO) would print it twice
    return engine, amsp_opt, loader, scheduler
