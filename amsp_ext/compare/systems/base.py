"""The system-runner interface: what every system (baseline or AMSP) gives the harness.

A runner module exposes ``setup(name, model, ctx) -> SystemRun``. It wraps the freshly built
model the way that system's users would and returns ``train_step(step) -> loss``, which runs one
optimizer step over the rank's ``M`` micro-batches and returns this rank's mean micro-batch loss
(unscaled). The harness owns everything else - timing, memory, the trace, gathering results - so
the systems differ only in what they should differ in.

A runner raises :class:`SystemUnavailable` (before any collective) when the system cannot run
here for a known reason; any other exception is recorded as the row's failure reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from amsp_ext.compare.config import RunSpec

__all__ = ["Context", "SystemRun", "SystemUnavailable", "phase"]


def phase(name: str):
    """``record_function("phase::<name>")``: forward, backward or optimizer, the phases the
    step breakdown (compare/breakdown.py) files each collective under (``Context.phase`` also
    times them)."""
    from torch.profiler import record_function

    return record_function(f"phase::{name}")


class SystemUnavailable(Exception):
    """The system cannot run in this setting; ``status`` is "skipped" or "failed"."""

    def __init__(self, reason: str, *, status: str = "skipped") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True, kw_only=True)
class Context:
    spec: RunSpec
    rank: int
    world_size: int
    num_nodes: int
    gpus_per_node: int
    # the fake process group (compare/limit.py [Note: a row's limit]): a system whose own code
    # reads a collective's result (DDP's reducer) takes that communication out itself
    compute_only: bool = False
    # (name, start, end) of each phase while the worker collects them (the last backward of a
    # compute-only step, compare/limit.py); None: not collected
    spans: list[tuple[str, float, float]] | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """``phase(name)`` of a system's step, timed into ``spans`` when collected."""
        import time

        with phase(name):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.spans is not None:
                    self.spans.append((name, t0, time.perf_counter()))

    def batches(self, step: int) -> list:
        """This rank's ``M`` micro-batches of optimizer step ``step`` (the same for every system)."""
        from amsp_ext.common.data import micro_batch

        s = self.spec
        return [
            micro_batch(step, m, self.rank, world_size=self.world_size,
                        num_micro_batches=s.num_micro_batches,
                        micro_batch_size=s.micro_batch_size, seq_len=s.seq_len)
            for m in range(s.num_micro_batches)
        ]

    def optimizer_factory(self, params) -> Any:
        """The one optimizer every system uses: AdamW with the spec's settings."""
        import torch

        s = self.spec
        return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=s.weight_decay)

    def autocast(self):
        """bf16 autocast for systems whose mixed precision is autocast (DDP); else a no-op."""
        import torch

        if self.spec.precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def param_dtype(self):
        import torch

        return torch.bfloat16 if self.spec.precision == "bf16" else torch.float32


# [Note: mixed precision of the same kind]
# Two bf16 rows can reach bf16 by different recipes, and a ratio of them then measures the
# recipe too. Each runner states its own in ``SystemRun.mixed_precision`` and the report prints
# it beside the measured wire dtypes (compare/wire.py). With --precision bf16: FSDP2/HSDP
# (MixedPrecisionPolicy param_dtype=bf16 over fp32 sharded parameters), DeepSpeed
# (bf16.enabled) and AMSP (EngineConfig precision) all compute on bf16 parameters with fp32
# masters in the optimizer - the same kind. DDP is autocast over fp32 parameters (fp32
# gradients, cast per op), because that is how DDP users run bf16: DDP has no bf16-parameter
# mode of its own. Its gradient wire is still the asked dtype (the bf16 hook), so the bytes
# match, and the remaining difference - autocast's per-op casts and fp32 gradient buffers - is
# named in its row. ``ddp-bf16`` is DDP's closer variant: DDP over bf16 parameters with fp32
# masters in the optimizer, Megatron-LM's recipe (ddp.py), so AMSP's replicate plan can be set
# beside DDP on the same kind of mixed precision, and the ratio measures the engine.
@dataclass(kw_only=True)
class SystemRun:
    train_step: Callable[[int], float]
    # How the system was configured (e.g. the DeepSpeed config), for the report.
    settings: dict[str, Any] = field(default_factory=dict)
    # How the compute dtype is reached: [Note: mixed precision of the same kind]
    mixed_precision: str = "fp32"
    # Waits for the collectives a step leaves in flight (AMSP's post-step broadcasts); the
    # others leave none. worker.py [Note: no collective in flight across a profiler boundary]
    drain: Callable[[], None] = lambda: None
