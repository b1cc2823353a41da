"""TrainConfig: one training run of ``amsp train``, as one tree of kw-only dataclasses.

The ``amsp train`` command line is generated from it (amsp_ext.schema: one flag per option, with
its default, help and choices), the launcher hands it to every rank as JSON, and the worker
(amsp_ext/train/loop.py) builds the optimizer from it; its ``engine`` section is the engine's
own config (amsp_ext/engine_config.py), the same object every other route uses.

[Note: adding a training option]
Add one ``option(...)`` field to the section it belongs to (its flag, default, help, choices and
bounds come from the field), then use it in amsp_ext/train/loop.py (the optimizer factory or the loop). An engine
setting is a field of amsp_ext/engine_config.py instead: every route gets it from there. Nothing else changes: the flag, the
JSON the worker receives and the validation follow from the field. A rule between fields goes
in the section's ``__post_init__`` after ``check_options(self)``, naming the flags.

Pure Python: importing it (``amsp train --help``) does not import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amsp_ext.choices import OBJECTIVES
from amsp_ext.engine_config import EngineConfig
from amsp_ext.common.models import MODEL_CONFIGS, llama_config_dict
from amsp_ext.job import Job
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.adaptive import AdaptiveConfig
from amsp_ext.planner.auto import AutoPlanConfig
from amsp_ext.planner.specs import StepShape, parse_size
from amsp_ext.schema import check_options, option, section
from amsp_ext.planner.defaults import CLUSTER_PROFILE, DEFAULT_OBJECTIVE

__all__ = ["auto_plan_config", "DEFAULT_PLAN", "AdaptiveOptions", "BatchOptions", "CheckpointOptions",
           "EngineConfig", "OptimOptions", "OutputOptions", "PlannerOptions", "TrainConfig", "engine_shard_config",
           "shard_config", "train_job"]

DEFAULT_PLAN = "p=1x1,g=1x1,os=2x1"


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """The planner's inputs for ``--plan auto`` besides the model, the world and the step."""

    profile: str = option(
        CLUSTER_PROFILE, help="bandwidth profile for --plan auto: 'cluster' (default: this cluster's, "
                           "from the cache or measured before planning), a bundled name or an "
                           "amsp-profile JSON (e.g. one written by `amsp profile`)")
    gpu_memory: str | None = option(
        None, metavar="SIZE",
        help="memory per rank for --plan auto, with a unit (e.g. 4MiB); default: the device's")
    memory_reserve: str | None = option(
        None, metavar="SIZE", help="memory the planner keeps free per rank for --plan auto "
                                   "(e.g. 0B); default: the planner's")
    objective: str = option(DEFAULT_OBJECTIVE, choices=OBJECTIVES, help="what --plan auto minimises: the "
                            "paper's Eq. 1 communication time or the modelled step time")

    def __post_init__(self) -> None:
        check_options(self)
        _ = self.gpu_memory_bytes, self.memory_reserve_bytes  # a bad size fails here, in one line

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_size(self.gpu_memory, field="--gpu-memory")

    @property
    def memory_reserve_bytes(self) -> int | None:
        if self.memory_reserve is None:
            return None
        return parse_size(self.memory_reserve, field="--memory-reserve", allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class BatchOptions(StepShape):
    """The job's shape: ``steps`` steps of the StepShape (M micro-batches of
    ``micro_batch_size`` sequences of ``seq_len`` tokens per rank)."""

    steps: int = option(10, minimum=1, help="optimizer steps")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class OptimOptions:
    """AdamW with linear warm-up then cosine decay to 10%, and global grad-norm clipping."""

    lr: float = option(3e-3, above=0, help="peak learning rate")
    warmup_steps: int = option(2, minimum=0, help="linear warm-up steps")
    clip: float = option(1.0, minimum=0, help="global grad-norm clip (0 = off)")
    weight_decay: float = option(0.1, minimum=0, help="AdamW decoupled weight decay")
    beta1: float = option(0.9, minimum=0, below=1, help="AdamW beta1")
    beta2: float = option(0.95, minimum=0, below=1, help="AdamW beta2")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Durable, resumable runs (amsp_ext/train/state.py): where checkpoints go, how often, how
    many stay, what to resume from, and how many times torchrun may replace failed ranks."""

    save_dir: str | None = option(None, metavar="DIR", help="directory of the job's checkpoints "
                                  "(one step-NNNNNNNN/ each, published whole)")
    save_every: int = option(0, minimum=0, help="save every N steps (0: at the end only)")
    keep: int = option(2, minimum=1, help="newest checkpoints kept in --save-dir")
    resume: str | None = option(
        None, metavar="auto|PATH", help="auto: the newest complete checkpoint in --save-dir (none "
                                        "yet: a fresh start, logged); PATH: that checkpoint")
    async_save: bool = option(False, help="write checkpoints in the background (training stalls "
                                          "only for the copy of the state)")
    max_restarts: int = option(
        0, minimum=0, help="torchrun --max-restarts: a failed rank is replaced and the job resumes "
                           "from its last checkpoint by itself")

    def __post_init__(self) -> None:
        check_options(self)
        for flag, used in (("--save-every", self.save_every > 0), ("--async-save", self.async_save),
                           ("--resume auto", self.resume == "auto")):
            if used and not self.save_dir:
                raise ValueError(f"{flag} needs --save-dir")
        if self.max_restarts and not (self.save_dir and self.save_every):
            raise ValueError("--max-restarts needs --save-dir and --save-every (a replaced rank "
                             "resumes from the job's last checkpoint)")


@dataclass(frozen=True, kw_only=True)
class AdaptiveOptions:
    """Adaptive AMSP (amsp_ext/planner/adaptive.py): re-plan and switch plans in memory when the
    measured collective times leave the band around the profile's prediction. Off by default."""

    adaptive: bool = option(False, help="re-plan and switch plans mid-run when the network changes")
    adaptive_band_low: float = option(0.67, above=0, help="measured/predicted below this is out of band")
    adaptive_band_high: float = option(1.5, above=0, help="measured/predicted above this is out of band")
    adaptive_window: int = option(20, minimum=1, help="consecutive out-of-band steps before re-planning")
    adaptive_min_steps_between: int = option(50, minimum=0, help="steps between two switches, at least")
    adaptive_hysteresis: float = option(0.1, minimum=0, help="switch only if the predicted gain exceeds "
                                                             "(1 + this) x the measured switch cost")
    adaptive_allow_replan: bool = option(True, help="may a --plan given as factors or a name be replaced")

    def __post_init__(self) -> None:
        check_options(self)
        if not self.adaptive_band_low < 1 < self.adaptive_band_high:
            raise ValueError(f"--adaptive-band-low and --adaptive-band-high must satisfy low < 1 < high "
                             f"(a non-empty band), got {self.adaptive_band_low:g} and {self.adaptive_band_high:g}")

    def config(self) -> AdaptiveConfig | None:
        """The engine's AdaptiveConfig, or None when --adaptive is off."""
        if not self.adaptive:
            return None
        return AdaptiveConfig(band=(self.adaptive_band_low, self.adaptive_band_high),
                              window=self.adaptive_window,
                              min_steps_between_switches=self.adaptive_min_steps_between,
                              hysteresis=self.adaptive_hysteresis, allow_replan=self.adaptive_allow_replan)


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    json: bool = option(False, help="print one JSON object instead of a log")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One ``amsp train`` run. ``schema.to_json`` / ``schema.from_json`` carry it to the ranks."""

    model: str = option("tiny-llama", choices=sorted(MODEL_CONFIGS), help="built-in Llama")
    plan: str = option(
        DEFAULT_PLAN,
        help="'auto' (the planner), ddp, zero1, zero2, zero3, mics:K, or factors "
             f"'p=S0xS1,g=S0xS1,os=S0xS1' (default {DEFAULT_PLAN}: the paper's LLaMA-7B shape, "
             "optimizer states sharded inside a node)")
    seed: int = option(0, minimum=0, below=2**63, help="model initialisation seed")
    planner: PlannerOptions = section(PlannerOptions)
    batch: BatchOptions = section(BatchOptions)
    optim: OptimOptions = section(OptimOptions)
    engine: EngineConfig = section(EngineConfig)  # the engine's one config (engine_config.py)
    checkpoint: CheckpointOptions = section(CheckpointOptions)
    adaptive: AdaptiveOptions = section(AdaptiveOptions)
    output: OutputOptions = section(OutputOptions)

    def __post_init__(self) -> None:
        check_options(self)
        check_seq_len(self.batch, MODEL_CONFIGS[self.model]["max_position_embeddings"], self.model)
        if self.adaptive.adaptive and not self.adaptive.adaptive_allow_replan and not is_auto(self.plan):
            raise ValueError(f"--adaptive with --no-adaptive-allow-replan on --plan {self.plan} leaves "
                             f"adaptive nothing it may change: use --plan auto, drop "
                             f"--no-adaptive-allow-replan, or drop --adaptive")
        T = self.engine.tensor_parallel
        if T > 1 and self.adaptive.adaptive:  # what the engine does not yet run on a 2-D mesh
            raise ValueError(f"--tensor-parallel {T} does not support --adaptive yet (allowed: "
                             f"--tensor-parallel 1)")


def check_seq_len(batch: BatchOptions, max_pos: int | None, model: str) -> None:
    """--seq-len within the model's positions (``amsp train`` and ``amsp tune``)."""
    if isinstance(max_pos, int) and batch.seq_len > max_pos:
        raise ValueError(f"--seq-len must be <= {max_pos} for {model}, got {batch.seq_len}")


def auto_plan_config(config: TrainConfig) -> AutoPlanConfig:
    """What ``--plan auto`` plans for: this run's step shape and the planner options (the
    launcher plans with it before starting any rank, and the ranks with it otherwise)."""
    return auto_plan_config_of(config.batch, config.planner)


def auto_plan_config_of(b: BatchOptions, pl: PlannerOptions) -> AutoPlanConfig:
    """:func:`auto_plan_config` from the two sections it reads (``amsp tune`` has no TrainConfig)."""
    return AutoPlanConfig(**vars(b.shape()), profile=pl.profile, objective=pl.objective,
                          missing="fit", gpu_memory_bytes=pl.gpu_memory_bytes,
                          memory_reserve_bytes=pl.memory_reserve_bytes)


def shard_config(config: TrainConfig) -> EngineConfig:
    """The engine's configuration of this run (plan "auto" plans for the same batch shape)."""
    return dataclasses.replace(engine_shard_config(config.engine, config.planner, config.batch),
                               adaptive=config.adaptive.config())


def engine_shard_config(engine: EngineConfig, pl: PlannerOptions, b: BatchOptions) -> EngineConfig:
    """The engine config with the step shape plan "auto" plans for (``amsp tune`` shares the
    sections with ``amsp train``)."""
    return dataclasses.replace(engine, auto=auto_plan_config_of(b, pl))


def train_job(config: TrainConfig, *, num_nodes: int, gpus_per_node: int) -> Job:
    """``amsp train``'s surface as a Job (amsp_ext/job.py [Note: one job, resolved once]): the one
    conversion, made by the launcher and again by every rank, so both resolve the same job."""
    engine = dataclasses.replace(shard_config(config), init_seed=config.seed, gpus_per_node=gpus_per_node)
    return Job(model=llama_config_dict(config.model), num_nodes=num_nodes, engine=engine, plan=config.plan)
