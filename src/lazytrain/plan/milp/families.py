"""The constraint families in build order, and `build`: a Formulation with every column and row."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from lazytrain.plan.milp import (
    capacity,
    counts,
    gpu_memory,
    kept,
    objective,
    path,
    placement,
    reloads,
    step,
    updates,
    variables,
    windows,
)
from lazytrain.plan.milp.formulation import Formulation
from lazytrain.plan.milp.instance import PlanningInstance

log = logging.getLogger(__name__)

# (name, family) in build order: a family reads the columns the ones before it added
FAMILIES: tuple[tuple[str, Callable[[Formulation], None]], ...] = (
    ("variables", variables.add_variables),
    ("path", path.add_path),
    ("placement", placement.add_placement),
    ("kept", kept.add_kept),
    ("capacity", capacity.add_capacity),
    ("gpu_memory", gpu_memory.add_gpu_memory),
    ("nvme_reads", reloads.add_nvme_reads),
    ("forward_windows", windows.add_forward_windows),
    ("head_window", windows.add_head_window),
    ("recompute_windows", windows.add_recompute_windows),
    ("backward_windows", windows.add_backward_windows),
    ("updates", updates.add_updates),
    ("step", step.add_step),
    ("counts", counts.add_counts),
    ("objective", objective.set_objective),
)


def build(inst: PlanningInstance, max_segment: int, fixed_tiers: Sequence[str] | None,
          fixed_kept: int | None = None) -> Formulation:
    """The MILP of `inst` (segments of at most `max_segment` layers; tiers or K fixed where given).
    Raises model.Infeasible where a fixed value meets a row no plan can."""
    form = Formulation(inst, max_segment, fixed_tiers, fixed_kept)
    for name, family in FAMILIES:
        t0 = time.perf_counter()
        family(form)
        form.build_s[name] = time.perf_counter() - t0
    log.debug("MILP build seconds per family: %s", form.build_s)
    return form
