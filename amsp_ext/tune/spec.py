"""What one ``amsp tune`` run holds fixed: the job shape, the planner inputs and the measurement.

A kw-only dataclass that raises a one-line ``SpecError`` naming the field in ``__post_init__``;
it travels to every rank as JSON (every rank builds the same candidate list from it).
Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["SpecError", "TuneSpec"]

PRECISIONS = ("fp32", "bf16", "fp16")
GRANULARITIES = ("module", "layer")
MISSING = ("error", "fit")


class SpecError(ValueError):
    """A tune setting that cannot run. One line, names the field and the allowed values."""


@dataclass(frozen=True, kw_only=True)
class TuneSpec:
    # -- the model and the job shape (as `amsp train`) ----------------------------------------
    model: str = "small-llama"  # a built-in name (amsp_ext.models) ...
    model_config: dict[str, Any] | None = None  # ... or a Llama-style HF config.json's content
    seq_len: int = 128
    micro_batch_size: int = 4
    num_micro_batches: int = 1  # M
    precision: str = "fp32"
    recompute: bool = False
    granularity: str = "layer"
    bucket_bytes: int = 2**20  # gradient bucket U (the engine's and the planner's)
    # -- the planner's inputs -----------------------------------------------------------------
    profile: str = "paper-a800"  # bundled name or path of an amsp-profile/1 JSON
    missing: str = "fit"  # a mesh the profile lacks: alpha-beta estimate or refuse
    gpu_memory_bytes: int | None = None  # None: the device's (CPU: RAM / ranks per node)
    memory_reserve_bytes: int = 0
    top: int | None = None  # None: every fitting legal plan when <= 16, else 8 + baselines
    plans: tuple[str, ...] = ()  # explicit plans instead (factor strings or baseline names)
    # -- the measurement ----------------------------------------------------------------------
    steps: int = 8  # timed steps per plan and round
    warmup_steps: int = 2  # untimed steps before them
    repeats: int = 2  # rounds, in alternated order (compare/rounds.py)
    probe_steps: int = 5  # steps of the compute probe per round (the first is dropped)
    seed: int = 0
    lr: float = 1e-3
    clip: float = 1.0
    timeout: float = 300.0

    def __post_init__(self) -> None:
        from amsp_ext.models import MODEL_CONFIGS

        if self.model_config is None and self.model not in MODEL_CONFIGS:
            raise SpecError(f"--model must be one of {', '.join(MODEL_CONFIGS)}, got {self.model!r}")
        if self.model_config is not None and not isinstance(self.model_config, dict):
            raise SpecError("--model-config must hold a JSON object (a Hugging Face config.json)")
        for name in ("seq_len", "micro_batch_size", "num_micro_batches", "bucket_bytes", "steps",
                     "repeats", "probe_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.probe_steps < 2:
            raise SpecError(f"--probe-steps must be >= 2 (the first is dropped), got {self.probe_steps}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise SpecError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        for name, allowed in (("precision", PRECISIONS), ("granularity", GRANULARITIES),
                              ("missing", MISSING)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.top is not None and (isinstance(self.top, bool) or not isinstance(self.top, int)
                                     or self.top < 1):
            raise SpecError(f"--top must be an integer >= 1, got {self.top!r}")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 1:
            raise SpecError(f"--gpu-memory must be positive, got {self.gpu_memory_bytes}")
        if self.memory_reserve_bytes < 0:
            raise SpecError(f"--memory-reserve must be >= 0, got {self.memory_reserve_bytes}")
        for name in ("lr", "timeout"):
            if not getattr(self, name) > 0:
                raise SpecError(f"--{name} must be > 0, got {getattr(self, name)!r}")
        if self.clip < 0:
            raise SpecError(f"--clip must be >= 0, got {self.clip!r}")
        max_pos = self.hf_config().get("max_position_embeddings")
        if isinstance(max_pos, int) and self.seq_len > max_pos:
            raise SpecError(f"--seq-len must be <= {max_pos} (max_position_embeddings), got {self.seq_len}")

    @property
    def model_name(self) -> str:
        return self.model if self.model_config is None else str(
            self.model_config.get("_name_or_path") or self.model_config.get("model_type") or "model-config")

    def hf_config(self) -> dict[str, Any]:
        from amsp_ext.models import llama_config_dict

        return dict(self.model_config) if self.model_config is not None else llama_config_dict(self.model)

    @property
    def tokens_per_rank_per_step(self) -> int:
        return self.seq_len * self.micro_batch_size * self.num_micro_batches

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TuneSpec":
        d = json.loads(text)
        d["plans"] = tuple(d.get("plans") or ())
        return cls(**d)
