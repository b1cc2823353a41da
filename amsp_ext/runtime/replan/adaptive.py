"""The engine side of adaptive AMSP: measure each step's collectives, agree, decide, switch.

``amsp_ext.shard`` with ``ShardConfig(adaptive=...)`` builds one ``AdaptiveRun`` (on every
route: ``amsp train --adaptive``, your own loop, ds_config ``amsp.adaptive``) and gives it to the
optimizer it returns. The decision logic is planner/adaptive.py's (Monitor, refit_scales,
replan, decide); this file feeds it and acts on it.

[Note: the step boundary is the end of optimizer.step()]
Every route calls ``optimizer.step()`` once per global batch on every rank (DeepSpeed's
``engine.step()`` and the HF Trainer call it too), so its end is where every rank is between
two steps: the one place a loop we did not write gives us. The window of step k is from the end
of step k-1's ``optimizer.step()`` to the end of its own. A step skipped for a non-finite
gradient is a boundary too (its collectives are still the step's).

[Note: where a switch happens]
``optimizer.step()`` ends with ``at_step_end``: measure, agree (one all-reduce), decide. It never
re-shards: a switch needs no gradient pending (switch_plan), and inside ``step()`` the step's
own gradients still are. A decision to switch waits for the optimizer's next ``zero_grad()``,
the call every loop makes between two steps once the gradients are consumed (runtime/step.py
``train_step``; DeepSpeed's ``engine.step()`` makes it right after ``optimizer.step()``), which
releases the gradients and then calls ``switch_if_decided``: every rank switches there, having
taken the same decision. What the loop does between the two calls (an LR scheduler's step)
acts on the old plan's param groups, whose hyper-parameters the switch carries over; after
``zero_grad()`` the same optimizer object holds the new plan's masters. A loop that never calls
``optimizer.zero_grad()`` keeps its plan.

[Note: one step's numbers]
A ``CommTrace`` (runtime/measure/comm_trace.py) records every collective while the run trains. At the
end of step k the numbers of step k-1 are read: its parameter broadcasts are overlapped with
step k's forward, so only then are all of its collectives complete. Per trace kind (AG, RS, AR,
BC) the measured figure is ``busy_s`` (the union of the kind's in-flight intervals), because
the prediction it is compared with, the step model's ``kind_times(...).busy_s``, is the kind's
time with nothing overlapping it ([Note: the kinds amsp train monitors] in planner/adaptive.py;
``amsp tune`` pairs the same two). Then the trace's records of that step are dropped.

[Note: every rank takes the same decision]
The four measured seconds and this rank's switch-cost figure go through ONE all-reduce (sum,
divided by the world size: the mean) at the step boundary, through runtime/collectives.py with
the group's timeout. The mean, not the max: the members of a group wait for each other, so a
kind's busy time is nearly the same on every rank, and one rank's hiccup (a page fault, a
checkpoint write) should move the figure by 1/world of itself rather than set it. After it
every rank holds the same floats; the Monitor, the planner and ``decide`` are deterministic,
so every rank reaches the same decision and calls ``switch_plan`` with the same plan (which
checks that again before moving anything).

[Note: the switch cost]
``decide`` needs what a switch costs. Before the first switch nothing has been measured, so
the cost is the time ``amsp_ext.shard`` took at start-up (a switch does all of ``shard``'s work,
rebuilding groups and FSDP2) plus the re-fit profile's time to broadcast the model state over
the world (``switch_move_s``, [Note: the first switch's cost] in planner/adaptive.py); after a
switch it is that switch's measured seconds (``model.amsp.switches[-1]["seconds"]``), both as
the mean over ranks.

[Note: what is re-fitted]
On drift, ``refit_scales`` turns the drifted kinds' median measured/predicted ratios into
bandwidth multipliers (intra-node, cross-node). They multiply the ones of earlier re-fits: the
prediction a ratio is taken against is already the re-fit profile's. With a calibrated profile
(``amsp tune``) only the profile-time part of the calibrated prices scales; its per-byte and
per-collective constants do not.

Off (no ``adaptive``) nothing of this exists: no trace, no monitor, no extra collective.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from amsp_ext.common.faults import slow_factor
from amsp_ext.planner.adaptive import (AdaptiveConfig, Decision, Monitor, decide, predicted_trace_kinds,
                                       refit_scales, replan, switch_move_s, trace_kinds_cross_nodes)
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.measure.comm_trace import KINDS, CommTrace
from amsp_ext.runtime.replan.switch import switch_plan

__all__ = ["AdaptiveRun"]

RATIO_STEPS = 10_000  # per-step ratios kept for the run's summary (a long run must not grow)


def _log_rank0(line: str) -> None:
    if dist.get_rank() == 0:
        print(f"[amsp] {line}", file=sys.stderr, flush=True)


class AdaptiveRun:
    """Monitor, decide and switch for one run (see the Notes). ``shard`` builds it (it installs
    the trace then) with the run's planner ``problem`` (``amsp_ext.job.problem``), the first ``plan``
    and ``world`` and the engine's ``comm``; ``close()`` removes the trace."""

    def __init__(self, model, problem, adaptive: AdaptiveConfig, *, plan, world, comm: C.CollectiveContext,
                 first_switch_cost_s: float, timeout: float, total_steps: int | None = None, faults=(),
                 log: Callable[[str], None] | None = None) -> None:
        self.model, self.problem, self.adaptive = model, problem, adaptive
        # total_steps: the run's length where known (amsp train), else adaptive.horizon_steps
        self.total_steps, self.first_cost, self.faults, self.timeout = (
            total_steps, first_switch_cost_s, list(faults), timeout)
        self.log = log or _log_rank0
        self.num_steps = 0  # step boundaries seen (optimizer.step() calls)
        self._boundary = time.perf_counter()
        self.monitor = Monitor(adaptive)
        self.scales = (1.0, 1.0)
        self.comm = comm  # the engine's; a switch keeps it, so the trace stays on
        self.trace = CommTrace(self.comm)
        self.windows: list[tuple[int, float, float]] = []  # (step, begin, end) not yet read
        self.decisions: list[Decision] = []
        # the observed steps' measured/predicted per kind (the monitor's input; a benchmark
        # reads how close a steady run came to the band from it), the last RATIO_STEPS of them
        self.ratios: collections.deque[dict[str, float]] = collections.deque(maxlen=RATIO_STEPS)
        self.last_switch_step = -1  # steps since the last switch count from the start
        self._pending: tuple[int, Any] | None = None  # (step, plan) of a switch not yet made
        self._refresh(plan, world)
        self.trace.__enter__()

    def close(self) -> None:
        self.trace.__exit__(None, None, None)

    def follow_loop(self, *, total_steps: int, first_step: int, log: Callable[[str], None]) -> None:
        """A loop that knows the run (amsp train): its length, the step it starts at (a resumed
        run goes on counting; known only once the checkpoint is loaded into the sharded model)
        and where decisions are logged. Before the first step."""
        if self.num_steps:
            raise ValueError("AdaptiveRun.follow_loop: call it before the first step")
        self.total_steps, self.num_steps, self.log = total_steps, first_step, log

    def at_step_end(self) -> None:
        """The end of ``optimizer.step()`` ([Note: the step boundary is the end of
        optimizer.step()]): this step's window, then ``after_step``."""
        now = time.perf_counter()
        step, t0 = self.num_steps, self._boundary
        self.num_steps += 1
        decision = self.after_step(step, t0, now)
        if decision is not None:
            self.log(decision.line())
        self._boundary = time.perf_counter()  # the monitor's all-reduce is no step's time

    def switch_if_decided(self, optimizer) -> None:
        """From ``optimizer.zero_grad()`` ([Note: where a switch happens]): the switch the last
        boundary decided, if any, on every rank."""
        if self._pending is None:
            return
        (step, plan), self._pending = self._pending, None  # switch_plan calls zero_grad() again
        switch_plan(self.model, optimizer, plan)
        self.last_switch_step = step
        self.windows.clear()  # the switch's own collectives are no step's
        self.trace.clear()
        self._refresh(self.model.amsp.plan, self.model.amsp.world)
        self._boundary = time.perf_counter()  # the switch is no step's time

    def _refresh(self, plan, world) -> None:
        """The prediction and the kinds' node crossing for ``plan`` and the current scales."""
        self.predicted = predicted_trace_kinds(self.problem, plan, self.scales)
        self.crosses = trace_kinds_cross_nodes(plan, world.gpus_per_node, world.num_nodes,
                                               self.problem.num_micro_batches)

    def _measured(self, step: int, t0: float, t1: float) -> dict[str, float]:
        summary = self.trace.summary(t0, t1)
        out = {k: summary[k]["busy_s"] for k in KINDS}
        f = slow_factor(self.faults, rank=dist.get_rank(), step=step)
        if f != 1.0:  # a fake slow link (common/faults.py): only this input changes
            out = {k: v * f if self.crosses[k] else v for k, v in out.items()}
        # drop what was read: the trace must not grow over a long run
        self.trace.records[:] = [r for r in self.trace.records if r.issued >= t1]
        self.trace.waits[:] = [w for w in self.trace.waits if w[2] >= t1]
        return out

    def _switch_cost(self) -> float:
        sw = self.model.amsp.switches
        return float(sw[-1]["seconds"]) if sw else float(self.first_cost)

    def after_step(self, step: int, t0: float, t1: float) -> Decision | None:
        """Call on every rank at the end of step ``step`` (its window [t0, t1)). Returns the
        decision taken now, if any; a switch it decides waits for ``switch_if_decided``."""
        self.windows.append((step, t0, t1))
        if len(self.windows) < 2:
            return None
        s, a, b = self.windows.pop(0)  # the previous step: all its collectives are complete
        mine = self._measured(s, a, b)
        vec = torch.tensor([mine[k] for k in KINDS] + [self._switch_cost()], dtype=torch.float64)
        C.all_reduce(self.comm, vec, dist.group.WORLD, name="world", stream=None, async_op=False,
                     timeout=self.timeout)  # host floats, blocking
        vec /= dist.get_world_size()
        agreed = dict(zip(KINDS, vec[:len(KINDS)].tolist()))
        cost = float(vec[len(KINDS)])
        self.ratios.append({"step": s, **self.monitor.observe(agreed, self.predicted)})
        drift = self.monitor.drift()
        if not drift:
            return None
        new = refit_scales(drift, self.crosses)
        self.scales = (self.scales[0] * new[0], self.scales[1] * new[1])
        current = self.model.amsp.plan
        best, cur_s, best_s = replan(self.problem, current, self.scales)
        if not self.model.amsp.switches:  # nothing measured yet: add the state's move
            cost += switch_move_s(self.problem, self.scales)
        remaining = (self.adaptive.horizon_steps if self.total_steps is None
                     else self.total_steps - step - 1)
        d = decide(step=step, current=str(current), candidate=str(best), current_step_s=cur_s,
                   candidate_step_s=best_s, remaining_steps=remaining,
                   switch_cost_s=cost, steps_since_switch=step - self.last_switch_step,
                   config=self.adaptive, drift=drift, scales=self.scales)
        self.decisions.append(d)
        if d.switch:
            self._pending = (step, best)
        self.monitor.reset()
        self._refresh(current, self.model.amsp.world)  # the new scales; the new plan after the switch
        return d
