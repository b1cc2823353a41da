"""``AMSPDeepSpeedEngine``: what DeepSpeed users and frameworks call on ``deepspeed.initialize``'s
engine, running the AMSP engine underneath.

[Note: DeepSpeed's step conventions, kept]
- ``engine(batch)`` runs the module; ``engine.backward(loss)`` back-propagates ``loss / GAS``
  (``scale_wrt_gas``) and, under fp16, the dynamic loss scale;
- ``engine.step()`` is called after every micro-batch and steps only at the accumulation
  boundary: ``(micro_steps + 1) % GAS == 0``, or what ``set_gradient_accumulation_boundary``
  last said (Accelerate and the HF Trainer set it before each backward);
- at the boundary: global gradient norm (always, so ``get_global_grad_norm`` answers as
  DeepSpeed's ZeRO optimizers do), clipping at ``gradient_clipping`` when > 0, the optimizer
  step, zero_grad, the LR scheduler step unless the step overflowed (fp16), ``global_steps``
  and ``global_samples`` advance;
- ``optimizer.overflow`` and ``was_step_applied()`` say whether the last step was skipped (the
  engine sets ``overflow`` on the AMSPOptimizer after each step, from its skipped-step count;
  Accelerate's ``optimizer_step_was_skipped`` reads it).
- Attributes the engine lacks are looked up on the module, as DeepSpeedEngine does; like there,
  ``engine.config`` is the ds_config (the model's own config is ``engine.module.config``).

[Note: when AMSP learns the boundary]
AMSP chooses the gradient path of a backward pass (replica AllReduce at the boundary, Tg or
local accumulation before it) from the boundary flag, so ``backward`` sets it on the sharded
module from ``is_gradient_accumulation_boundary()`` - exactly when DeepSpeed's ZeRO decides to
reduce - and ``no_sync()`` forces it off.

[Note: state dicts]
``engine.state_dict()`` is the consolidated model state dict (full tensors, the module's keys
without a ``module.`` prefix), because frameworks call it through "unwrap" helpers that only
recognise DeepSpeed's own engine class (Accelerate's ``get_state_dict`` does
``unwrap_model(engine).state_dict()``). ``_zero3_consolidated_16bit_state_dict()`` returns the
same on rank 0 and ``{}`` elsewhere, as DeepSpeed's does. Both are collective when parameters
are sharded (sp > 1): every rank must call them.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from amsp_ext.integrations.settings import AMSPSettings, BatchSettings

__all__ = ["AMSPDeepSpeedEngine"]


class AMSPDeepSpeedEngine(nn.Module):
    """The object ``amsp_ext.initialize`` returns first (see the module docstring)."""

    def __init__(self, *, module: nn.Module, optimizer, lr_scheduler, config: Mapping[str, Any],
                 batch: BatchSettings, gradient_clipping: float, settings: AMSPSettings,
                 training_dataloader=None) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = dict(config)  # the ds_config (the HF Trainer reads engine.config)
        self.amsp_settings = settings
        self.training_dataloader = training_dataloader
        self._batch = batch
        self._clip = gradient_clipping
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = self.world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = module.amsp.device
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._is_gradient_accumulation_boundary: bool | None = None
        self._step_applied = False
        self.inside_no_sync_ctxt = False
        if self.optimizer is not None:  # None: a forward-only model (a reference, reward model)
            self.optimizer.overflow = False

    # -- attribute pass-through, as DeepSpeedEngine ----------------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = self.__dict__["_modules"].get("module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @property
    def amsp(self):
        """The AMSP runtime engine (plan, world, mesh)."""
        return self.module.amsp

    @property
    def plan(self):
        return self.module.amsp.plan

    # -- batch -----------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._batch.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self._clip

    def fp16_enabled(self) -> bool:
        return self.module.amsp.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.module.amsp.config.precision == "bf16"

    def zero_optimization(self) -> bool:
        return False  # the plan replaces ZeRO stages

    def zero_optimization_stage(self) -> int:
        return 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return True  # the consolidated state dict is always available

    # -- training ----------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is None:
            return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0
        return self._is_gradient_accumulation_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_gradient_accumulation_boundary = bool(is_boundary)
        # DeepSpeed sets it on its ZeRO optimizers too; code written for them may read it
        if self.optimizer is not None:
            self.optimizer.is_gradient_accumulation_boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside are not the accumulation boundary; ``step()`` is illegal."""
        if self.inside_no_sync_ctxt:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    def _trainable(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{what}: {type(self.module).__name__.removeprefix('FSDP')} was "
                               f"initialized without an optimizer (a forward-only model: a reference or "
                               f"reward model); give deepspeed.initialize an optimizer or an 'optimizer' "
                               f"block to train it")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        self._trainable("backward")
        if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad):
            raise ValueError("engine.backward needs a scalar loss tensor that requires grad")
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if (scale_wrt_gas and gas > 1) else loss
        boundary = (not self.inside_no_sync_ctxt) and self.is_gradient_accumulation_boundary()
        self.module.set_gradient_accumulation_boundary(boundary)
        with record_function(f"amsp::ds_engine::backward::{'boundary' if boundary else 'accumulate'}"):
            self.optimizer.backward(scaled, retain_graph=retain_graph)
        return scaled.detach()

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        self._trainable("step")
        if self.inside_no_sync_ctxt:
            raise RuntimeError("It is illegal to call engine.step() inside the no_sync context manager")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            with record_function("amsp::ds_engine::step"):
                self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: Mapping[str, Any] | None) -> None:
        opt = self.optimizer
        max_norm = self._clip if self._clip > 0 else math.inf
        opt.clip_grad_norm_(max_norm)
        skipped_before = opt.skipped_steps
        opt.step()
        opt.zero_grad()
        overflow = opt.skipped_steps > skipped_before
        opt.overflow = overflow
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None and lr_kwargs:
            self.lr_scheduler.step(**lr_kwargs)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        """DeepSpeed's: drop the module's ``.grad`` (not the accumulated, bucketed gradients)."""
        for p in self.module.parameters():
            p.grad = None

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.last_grad_norm if self.optimizer is not None else None

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_loss_scale(self) -> float:
        return self.optimizer.loss_scale

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    # -- state dicts -------------------------------------------------------------------------------
    def _consolidated(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        from amsp_ext.runtime.state.export import consolidated_state_dict
        from amsp_ext.runtime.config import compute_dtype

        # the compute dtype: what DeepSpeed's module state dict holds (bf16 params under bf16)
        return consolidated_state_dict(self.module, dtype=compute_dtype(self.module.amsp.config),
                                       rank0_only=rank0_only)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):  # type: ignore[override]
        sd = self._consolidated(rank0_only=False)
        if destination is not None:
            destination.update({prefix + k: v for k, v in sd.items()})
            return destination
        return {prefix + k: v for k, v in sd.items()} if prefix else sd

    def module_state_dict(self, exclude_frozen_parameters: bool = False,
                          rank0_only: bool = False) -> dict[str, torch.Tensor]:
        sd = self._consolidated(rank0_only)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        return self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters,
                                      rank0_only=True)

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's name for the saveable model weights (rank 0; ``{}`` elsewhere)."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(sd, os.path.join(save_dir, save_filename))
        return True

    # -- checkpoints (DeepSpeed layout: <dir>/<tag>/ + <dir>/latest) ----------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective. ``tag`` defaults to ``global_step<N>`` (see integrations/checkpoint.py)."""
        from amsp_ext.integrations.checkpoint import save_ds_checkpoint

        del exclude_frozen_parameters  # frozen parameters are never in AMSP's optimizer state
        save_ds_checkpoint(self, save_dir, tag, client_state, save_latest)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Collective. Returns ``(load_path, client_state)``; ``(None, None)`` when ``tag`` is None
        and there is no ``latest`` file (as DeepSpeed)."""
        from amsp_ext.integrations.checkpoint import load_ds_checkpoint

        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported by AMSP")
        del load_module_strict  # AMSP checks the model against the checkpoint strictly
        return load_ds_checkpoint(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                                  load_lr_scheduler_states=load_lr_scheduler_states,
                                  load_module_only=load_module_only)

    def destroy(self) -> None:
        """DeepSpeed's engine teardown hook (Accelerate calls it); nothing to release early."""

    def __repr__(self) -> str:
        return (f"AMSPDeepSpeedEngine(plan={self.module.amsp.plan}, world={self.world_size}, "
                f"micro_batch={self.train_micro_batch_size_per_gpu()}, "
                f"gas={self.gradient_accumulation_steps()})")
