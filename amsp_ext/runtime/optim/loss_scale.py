"""Dynamic loss scaling for fp16 (the usual scheme: back off on overflow, grow after a run of
good steps). The overflow decision is global: a non-finite gradient norm, all-reduced over the
world (optimizer.py, nonfinite.py)."""

from __future__ import annotations

from amsp_ext.runtime.config import FP16Config

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    def __init__(self, cfg: FP16Config) -> None:
        self.cfg = cfg
        self.scale = float(cfg.initial_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.cfg.min_scale, self.scale * self.cfg.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.cfg.growth_interval == 0:
            self.scale *= self.cfg.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
