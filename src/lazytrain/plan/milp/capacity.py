"""Capacity: the offloaded boundaries fit the host's activation budget (cpu) and the NVMe one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import INF

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_capacity(form: Formulation) -> None:
    # sum_i A[i] c[i] <= M_C ;  sum_i A[i] n[i] <= M_N
    A, inst = form.inst.boundary_bytes, form.inst
    if math.isfinite(inst.cpu_act_bytes):
        form.m.row("cap_cpu", {form.c[i]: A[i] for i in range(form.L + 1)}, hi=inst.cpu_act_bytes)
    if 0 < inst.nvme_act_bytes < INF:
        form.m.row("cap_nvme", {form.n[i]: A[i] for i in range(form.L + 1)}, hi=inst.nvme_act_bytes)
