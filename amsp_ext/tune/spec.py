"""TuneConfig: one ``amsp tune`` run, on the training schema.

The job shape is ``amsp train``'s: the same sections (train/config.py: cluster, planner, batch,
engine) give the same flags, defaults and validation, and the engine is configured from them by
the same function (train/config.py ``engine_shard_config``), so a plan measured here runs as
``amsp train --plan P`` with the same flags would. ``TuneOptions`` adds what only tuning has.
``--steps`` are the timed steps of every plan in every round and ``--warmup-steps`` the untimed
ones before them (the optimizer runs at ``amsp train``'s default settings; no LR schedule).

Pure Python (no torch), like train/config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from amsp_ext.common.models import MODEL_CONFIGS, llama_config_dict
from amsp_ext.planner.plan import NAMED_PLANS, check_plan_text, is_auto
from amsp_ext.schema import check_options, name_of, option, section
from amsp_ext.engine_config import EngineConfig
from amsp_ext.train.config import BatchOptions, PlannerOptions, check_seq_len

__all__ = ["TuneConfig", "TuneOptions"]


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """Which plans, how often, and what to write."""

    warmup_steps: int = option(2, minimum=0, help="untimed steps of a plan before its timed ones")
    repeats: int = option(2, minimum=1, help="rounds over all plans, in alternated order "
                                             "(amsp compare's rounds); figures are medians over them")
    probe_steps: int = option(5, minimum=2, help="steps of the compute probe per round (the "
                                                 "first is dropped)")
    top: int | None = option(None, minimum=1, help="the planner's top K per objective plus the "
                             "baselines that fit (default: every legal plan that fits when there "
                             "are at most 16, else 8)")
    plans: str | None = option(None, metavar="P;P;...", help="measure these plans instead, "
                               "separated by ';' (factors or ddp, zero1, zero2, zero3, mics:K)")
    peak_tflops: float | None = option(None, above=0, help="MFU peak per GPU (default: the device "
                                       "table on GPU, measured on CPU)")
    out: str = option("tune-out", metavar="DIR", help="folder for tune.json, tune.md and the plot")
    calibrate_out: str | None = option(None, metavar="PATH", help="fit the step model on this run "
                                       "and write the profile with a calibration section here")

    def __post_init__(self) -> None:
        check_options(self)
        # spelling here, where the config is built (before any rank starts); whether a plan
        # fits the world is checked where the world is known (cli/tune.py)
        name = name_of(self, "plans")
        for text in self.plan_list:
            low = text.lower()
            if "=" not in low and not low.startswith("mics") and low not in NAMED_PLANS:
                raise ValueError(f"{name}: {text!r} is not a plan to measure; give factors "
                                 f"'p=S0xS1,g=S0xS1,os=S0xS1' or a baseline name ({', '.join(NAMED_PLANS)})")
            check_plan_text(text, name)

    @property
    def plan_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in (self.plans or "").split(";") if p.strip())


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    model: str = option("tiny-llama", choices=sorted(MODEL_CONFIGS), help="built-in Llama")
    model_config: str | None = option(None, metavar="PATH", help="a Llama-style Hugging Face "
                                      "config.json instead of --model")
    seed: int = option(0, minimum=0, help="model initialisation seed")
    planner: PlannerOptions = section(PlannerOptions)
    batch: BatchOptions = section(BatchOptions)
    engine: EngineConfig = section(EngineConfig)
    tune: TuneOptions = section(TuneOptions)

    def __post_init__(self) -> None:
        check_options(self)
        check_seq_len(self.batch, self.hf_config().get("max_position_embeddings"), self.model_name)
        if is_auto(self.engine.all_reduce):  # tune fits the model to one mode's measurements
            raise ValueError("--all-reduce must be flat or two_level for amsp tune (it measures and "
                             "calibrates one mode per run), got 'auto'")

    def hf_config(self) -> dict[str, Any]:
        """The model's Hugging Face config (read from --model-config, else the built-in's)."""
        if self.model_config is None:
            return llama_config_dict(self.model)
        try:
            with open(self.model_config) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--model-config {self.model_config}: cannot read a JSON object "
                             f"({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--model-config {self.model_config}: must hold a JSON object")
        return data

    @property
    def model_name(self) -> str:
        return self.model if self.model_config is None else self.model_config

    @property
    def bucket_bytes(self) -> int:
        return self.engine.grad_bucket_bytes

    @property
    def tokens_per_rank_per_step(self) -> int:
        b = self.batch
        return b.seq_len * b.micro_batch_size * b.num_micro_batches

    def job(self, memory_reserve_bytes: int) -> dict[str, Any]:
        """The job's shape as one flat object, for the report."""
        b, e, t = self.batch, self.engine, self.tune
        return {"model": self.model_name, "seq_len": b.seq_len,
                "micro_batch_size": b.micro_batch_size, "micro_batches": b.num_micro_batches,
                "precision": e.precision, "reduce_dtype": e.reduce_dtype,
                "granularity": e.granularity,
                "bucket_bytes": self.bucket_bytes, "recompute": e.recompute,
                "no_overlap": list(e.overlap.off), "memory_reserve_bytes": memory_reserve_bytes,
                "steps": b.steps, "warmup_steps": t.warmup_steps, "repeats": t.repeats}
