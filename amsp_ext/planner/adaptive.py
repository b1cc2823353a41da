"""Adaptive AMSP's settings (pure Python, like AutoPlanConfig: the launcher, the DeepSpeed
``amsp`` block and the engine all validate with it, torch-free).

[Note: adaptive is opt-in]
``ShardConfig(adaptive=AdaptiveConfig(...))``, ``amsp train --adaptive``, ds_config
``amsp.adaptive``. None (the default) changes nothing: no monitor, no extra collective, the
same hot path. With it on, the run may re-plan while it trains: when the measured/predicted
time of some collective kind stays outside ``band`` for ``window`` steps, the profile is re-fit
from what was measured, the planner runs again and the engine switches plans in memory
(runtime/switch.py) if the predicted gain over the remaining steps exceeds the measured cost
of a switch by the ``hysteresis`` margin, and no earlier than ``min_steps_between_switches``
after the last switch. ``allow_replan=False`` forbids replacing a plan the user gave as
factors or a name; adaptive then has nothing to do on such a plan, which is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from amsp_ext.choices import check_bool, check_int, check_number

__all__ = ["AdaptiveConfig", "check_replannable"]


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    # measured / predicted time of a collective kind inside (low, high) counts as "as planned"
    band: tuple[float, float] = (0.67, 1.5)
    window: int = 20  # consecutive steps outside the band before re-planning
    min_steps_between_switches: int = 50
    hysteresis: float = 0.1  # switch only if gain > (1 + hysteresis) x switch cost
    allow_replan: bool = True  # may a plan given as factors or a name be replaced?

    def __post_init__(self) -> None:
        band = self.band
        if isinstance(band, list):
            band = tuple(band)
            object.__setattr__(self, "band", band)
        ok = (isinstance(band, tuple) and len(band) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                      for x in band))
        if not ok or not 0 < band[0] < 1 < band[1]:
            raise ValueError(f"adaptive.band must be two numbers (low, high) with 0 < low < 1 < high "
                             f"(a non-empty band around measured = predicted), got {self.band!r}")
        object.__setattr__(self, "band", (float(band[0]), float(band[1])))
        check_int(self.window, "adaptive.window (steps)", minimum=1)
        check_int(self.min_steps_between_switches, "adaptive.min_steps_between_switches", minimum=0)
        check_number(self.hysteresis, "adaptive.hysteresis", minimum=0)
        check_bool(self.allow_replan, "adaptive.allow_replan")

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "adaptive") -> "AdaptiveConfig":
        """From a JSON object (ds_config ``amsp.adaptive``); an unknown key is one line."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object with keys band, window, "
                             f"min_steps_between_switches, hysteresis, allow_replan; got {d!r}")
        known = ("band", "window", "min_steps_between_switches", "hysteresis", "allow_replan")
        for k in d:
            if k not in known:
                raise ValueError(f"{where}.{k} is not an adaptive setting (allowed: {', '.join(known)})")
        return cls(**d)


def check_replannable(plan: Any, adaptive: AdaptiveConfig | None, *, flag: str = "adaptive.allow_replan") -> None:
    """Adaptive on a plan that may not be replaced (anything but "auto" with allow_replan
    false) could never act: refuse it in one line."""
    if adaptive is None or adaptive.allow_replan:
        return
    if isinstance(plan, str) and plan.strip().lower() == "auto":
        return
    raise ValueError(f"{flag}: false with plan {plan} (explicit factors or a name) leaves adaptive "
                     f"nothing it may change; use plan 'auto', or {flag} true, or turn adaptive off")
