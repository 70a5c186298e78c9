"""Cardinality counts: integer sums of the binaries the solver can branch and cut on (same integer points)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import INF

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_counts(form: Formulation) -> None:
    """Integer counts of the binaries with the cardinality bounds the capacity and memory rows imply:
        N_c = sum_i c[i] <= floor(M_C / a)      N_n = sum_i n[i] <= floor(M_N / a)
        N_g = sum_i g[i] <= min over the head row and each B_s row of the gpu boundaries it admits
        N_z = sum_i z[i] = N_g + N_c + N_n      N_long = sum_{lifted} x[s,e] <= floor(L / 2)
    over the interior boundaries (0 and L are gpu), with a the smallest of them: every boundary a count admits
    takes at least a bytes of its row. The same integer points (an overstated bound fails the brute-force
    tests). The LP relaxation materializes 43.5 boundaries where 41 fit (27B, 50 GB cap) or spreads a long
    segment over fractional edges (27B, d2h 1.5 GB/s); a count is one integer the solver can branch on (at
    most 41 boundaries, or at least 42) and cut on (19 cpu boundaries of 0.75 GB fill 15 GB), which no
    single binary gives it. The bounds are below what each count's own row implies, so presolve keeps the
    counts (HiGHS substitutes an integer column that only sums others and is bounded by them).
    N_long counts only the lifted long edges: (s, e >= s+2) whose end's gradient d2h outlasts R_s's compute
    (windows.add_recompute_windows), the rows where a fractional spread hides seconds. Elsewhere the count's bound
    is the path rows' own (a unit path has at most L / 2 long edges in the LP too) and it only fed HiGHS's root cut
    loop: counting every long edge multiplied the LP iterations (docs/planner.md, "N_long counts only ..."). Any
    subset of a path's long edges has at most floor(L / 2) of them."""
    m, L, inst, A = form.m, form.L, form.inst, form.inst.boundary_bytes
    form.counts: dict[int, list[int]] = {}  # count column -> the binaries it sums (start_values)
    free = [i for i in range(1, L) if m.ub[form.z[i]] > m.lb[form.z[i]]]  # 0 and L are gpu; fixed tiers: none
    if not free:
        return
    a = min(A[i] for i in free)

    def fits(budget: float) -> float:
        return math.floor(budget / a + 1e-6) if math.isfinite(budget) and a > 0 else INF

    room = inst.gpu_act_bytes + inst.static_working_bytes - inst.bwd_transient_bytes
    gpu = fits(room - inst.head_bytes() - A[0])  # gpu_head: boundary 0 and the free ones, other terms >= 0
    for s in range(1, L):  # gpu_bwd[s]: 0 and the free gpu boundaries below s, at most one each from s up
        gpu = min(gpu, fits(room - (A[s] + A[s + 1] + inst.working_bytes[s]) - A[0])
                  + sum(1 for i in free if i >= s))
    bounds = {"N_g": (form.g, gpu), "N_c": (form.c, fits(inst.cpu_act_bytes)),
              "N_n": (form.n, fits(inst.nvme_act_bytes))}
    total: dict[int, float] = {}
    for name, (family, bound) in bounds.items():
        members = [family[i] for i in free if m.ub[family[i]] > 0]
        if members:
            count = _count(form, name, members, bound)
            total[count] = 1.0
    if total:
        _count(form, "N_z", [form.z[i] for i in free], sum(m.ub[v] for v in total), total)
    lifted = [xv for xv in form.lifted_long if m.ub[xv] > 0]
    if lifted:
        _count(form, "N_long", lifted, L // 2)


def _count(form: Formulation, name: str, members: list[int], bound: float,
           parts: dict[int, float] | None = None) -> int:
    """N = sum members (integer, 0 <= N <= bound); with parts also N = sum parts."""
    m = form.m
    count = m.var(name, 0, min(float(len(members)), bound), 0.0, True)
    m.row(name, {count: 1.0, **{v: -1.0 for v in members}}, 0, 0)
    if parts:
        m.row(f"{name}_parts", {count: 1.0, **{v: -c for v, c in parts.items()}}, 0, 0)
    form.counts[count] = members
    return count
