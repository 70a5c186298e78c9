"""The objective, in seconds: min S + lambda_z sum z[i] + lambda_c sum c[i] + lambda_n sum n[i] (+ a constant).

Without the tie-breakers (lambda: 1e-5 s per materialized or cpu boundary, 1e-4 s per nvme boundary) it is the
simulated step of the plan's program (`MilpSolution.step_s`). In serial mode the whole optimizer step follows
the backward from idle lanes: a constant, the objective's offset (with the states on NVMe, their updates through
the staging slots).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation


def set_objective(form: Formulation) -> None:
    m, inst = form.m, form.inst
    m.cost[form.S] = 1.0
    for i in range(form.L + 1):
        m.cost[form.z[i]] = inst.lambda_z
        m.cost[form.c[i]] = inst.lambda_c
        m.cost[form.n[i]] = inst.lambda_n
    if inst.optimizer_mode == "serial":
        m.offset = inst.serial_updates_s() if form.state is not None else inst.optimizer_step_s
