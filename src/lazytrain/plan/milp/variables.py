"""The columns x[s,e], z, g, c, n and y (symbols in docs/planner.md), pinned where tiers or K are fixed.

The tie-breaking costs on z, c and n are objective.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp.model import Infeasible
from lazytrain.plan.plan import TIERS

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_variables(form: Formulation) -> None:
    m, L, K, inst = form.m, form.L, form.K, form.inst
    # x[s,e]: candidate recompute edges, block length <= K.
    form.x = {(s, e): m.var(f"x[{s},{e}]", 0, 1, 0.0, True)
              for s in range(L) for e in range(s + 1, min(L, s + K) + 1)}
    form.z = [m.var(f"z[{i}]", 0, 1, 0.0, True) for i in range(L + 1)]
    form.g = [m.var(f"g[{i}]", 0, 1, 0.0, True) for i in range(L + 1)]
    form.c = [m.var(f"c[{i}]", 0, 1, 0.0, True) for i in range(L + 1)]
    nvme_ub = 1 if inst.nvme_act_bytes > 0 else 0
    form.n = [m.var(f"n[{i}]", 0, nvme_ub, 0.0, True) for i in range(L + 1)]
    # Boundaries 0 and L stay on the device: g[0] = g[L] = 1 (so z = 1, c = n = 0 there).
    for i in (0, L):
        m.lb[form.g[i]] = m.ub[form.c[i]] = m.ub[form.n[i]] = 0.0
        m.lb[form.g[i]] = 1.0
    # y[j]: layer j keeps its graph (a layer can be kept only when the instance has graph bytes); at most as
    # many as the head row admits with nothing else on the device (the rest fixed to 0: fewer binaries)
    keepable = 1 if inst.graph_bytes else 0
    form.y = [m.var(f"y[{j}]", 0, keepable, 0.0, True) for j in range(L)]
    if form.fixed_kept is not None:
        if form.fixed_kept and not keepable or not 0 <= form.fixed_kept <= L:
            raise Infeasible(f"kept_layers={form.fixed_kept}")
        for j, y in enumerate(form.y):
            m.lb[y] = m.ub[y] = float(j >= L - form.fixed_kept)
    elif keepable:
        for j in range(L - 1, -1, -1):
            if _kept_head_bytes(form, j) > inst.gpu_act_bytes + inst.static_working_bytes + 1e-9:
                for i in range(j + 1):
                    m.ub[form.y[i]] = 0.0
                break
    if form.fixed is not None:
        _fix_tiers(form)


def _kept_head_bytes(form: Formulation, first: int) -> float:
    """The head row's left side with layers first..L-1 kept and every other boundary but 0 off the device:
    boundaries 0 and first..L-1, the head's own bytes, the kept graphs and slots."""
    inst, L, A = form.inst, form.L, form.inst.boundary_bytes
    return ((A[0] if first > 0 else 0.0) + sum(A[first:L]) + inst.head_bytes() + inst.bwd_transient_bytes
            + sum(inst.graph_bytes[j] + inst.param_bytes[j] for j in range(first, L)))


def _fix_tiers(form: Formulation) -> None:
    """Fix z, g, c, n (and so x) to a given tier list: evaluates a rule as a point of this MILP."""
    m, fixed = form.m, form.fixed
    assert fixed is not None
    if len(fixed) != form.L + 1 or any(t not in TIERS for t in fixed):
        raise LazyTrainError(f"fixed_tiers needs {form.L + 1} entries from {', '.join(TIERS)}, got {len(fixed)}")
    for i, tier in enumerate(fixed):
        for var, value in ((form.z[i], tier != "recompute"), (form.g[i], tier == "gpu"),
                           (form.c[i], tier == "cpu"), (form.n[i], tier == "nvme")):
            if value and m.ub[var] < 1:
                raise Infeasible(f"fixed tier {tier!r} at boundary {i}")
            m.lb[var] = m.ub[var] = float(value)
