"""Online re-planning: when measured op times drift from the cost model, re-solve and switch plans between steps.

    replanner = Replanner(cost, plan, solve=lambda cost, start: solve_milp(cost, budgets, start_tiers=start.tiers,
                                                                           start_kept=start.kept_layers))
    for step in ...:
        executor.forward_backward(...)
        new_plan = replanner.observe(executor.last_step)
        if new_plan is not None:
            executor.set_plan(new_plan)                     # takes effect at the next step

After `warmup_steps` steps, every step's measured compute seconds and link rates are compared with the
cost model the current plan was made from. When the median of the last `window` steps differs by more than
`drift` (a fraction) on any of them, the measurements become a new CostModel (`runtime.calibrate`, plus the
measured link rates), the planner re-solves warm-started from the current plan, and both plans are
simulated on the new model. The new plan is adopted when it is predicted faster by more than `min_gain`;
either way the new model becomes the reference, so one drift triggers one re-solve. Each switch is logged
with the old and new predicted step seconds and the measured one.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.plan.sim import simulate
from lazytrain.runtime.calibrate import calibrate, link_gbps

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.step import StepStats

log = logging.getLogger(__name__)

# solve(cost, start) -> Plan: the run's planner on a new cost model, warm-started from the running plan (its tiers
# and its kept layers).
Solve = Callable[["CostModel", "Plan"], "Plan"]


@dataclass(frozen=True)
class Switch:
    """One plan switch: at which step, the predicted seconds of both plans on the new model, the measured one."""

    step: int
    old_predicted_s: float
    new_predicted_s: float
    measured_s: float
    old_map: str
    new_map: str

    def message(self) -> str:
        return (f"re-plan at step {self.step}: measured {self.measured_s:.3f} s/step; predicted "
                f"{self.old_predicted_s:.3f} s with {self.old_map} -> {self.new_predicted_s:.3f} s with {self.new_map}")


@dataclass
class Replanner:
    cost: CostModel  # the model the current plan was made from (the reference for drift)
    plan: Plan
    solve: Solve
    optimizer_mode: str = "overlap"
    topology: Topology = ONE_RANK  # data parallelism: plans are judged for one rank of it (the sums in the step)
    warmup_steps: int = 3
    window: int = 3
    drift: float = 0.25  # relative difference of measured vs modelled times that triggers a re-solve
    min_gain: float = 0.1  # switch only when the new plan is predicted this much faster (hysteresis)
    on_switch: Callable[[Switch], None] | None = None
    steps_seen: int = 0
    recent: list[StepStats] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)

    def observe(self, stats: StepStats) -> Plan | None:
        """Take one measured step; return the plan to switch to before the next step, or None."""
        self.steps_seen += 1
        if self.steps_seen <= self.warmup_steps:
            return None
        self.recent = [*self.recent, stats][-self.window:]
        if len(self.recent) < self.window or self.drift_fraction() <= self.drift:
            return None
        measured, measured_s = self.measured_cost(), statistics.median(s.wall_s for s in self.recent)
        old_s = simulate(self.plan, measured, optimizer_mode=self.optimizer_mode, topology=self.topology).step_s
        candidate = self.solve(measured, self.plan)
        new_s = simulate(candidate, measured, optimizer_mode=self.optimizer_mode, topology=self.topology).step_s
        self.cost, self.recent = measured, []  # the new reference: one drift, one re-solve
        if not new_s < old_s * (1 - self.min_gain):
            log.info("re-plan at step %d: kept the plan (predicted %.3f s, best other %.3f s)", self.steps_seen,
                     old_s, new_s)
            return None
        switch = Switch(self.steps_seen, old_s, new_s, measured_s, self.plan.placement_map(),
                        candidate.placement_map())
        self.switches.append(switch)
        log.info(switch.message())
        if self.on_switch is not None:
            self.on_switch(switch)
        self.plan = candidate
        return candidate

    # ---- measurements --------------------------------------------------------------------------
    def measured_rates(self) -> dict[str, float]:
        """Bytes/s per link over the recent steps (busy time of the link's jobs), where the link moved bytes."""
        return {link: gbps * 1e9 for link, gbps in link_gbps(self.recent).items()}

    def drift_fraction(self) -> float:
        """The largest relative difference between the recent steps and the reference model: per-layer compute
        (medians) and link rates."""
        c, worst = self.cost, 0.0
        pairs = [(statistics.median(sum(s.forward_s) for s in self.recent), sum(c.forward_s)),
                 (statistics.median(sum(s.backward_s) for s in self.recent), sum(c.backward_s)),
                 (statistics.median(s.head_s for s in self.recent), c.head_s)]
        for link, rate in self.measured_rates().items():
            modelled = getattr(c, f"{link}_bytes_per_s")
            if math.isfinite(modelled):
                pairs.append((rate, modelled))
        for measured, modelled in pairs:
            if modelled > 0 and measured > 0:
                worst = max(worst, abs(measured / modelled - 1))
        return worst

    def measured_cost(self) -> CostModel:
        """The reference model with the recent steps' compute seconds and link rates (one calibration path)."""
        links = {link: gbps for link, gbps in link_gbps(self.recent).items()
                 if math.isfinite(getattr(self.cost, f"{link}_bytes_per_s"))}
        return calibrate(self.cost, self.recent, links_gbps=links)
