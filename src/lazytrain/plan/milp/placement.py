"""Placement: a materialized boundary has exactly one home, gpu, cpu or nvme."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_placement(form: Formulation) -> None:
    # z[i] = g[i] + c[i] + n[i]   (a materialized boundary has exactly one home)
    for i in range(form.L + 1):
        form.m.row(f"place[{i}]", {form.z[i]: 1.0, form.g[i]: -1.0, form.c[i]: -1.0, form.n[i]: -1.0}, 0, 0)
