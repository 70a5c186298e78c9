"""The SCIP driver (optional: PySCIPOpt): the same model, for cross-checking HiGHS."""

from __future__ import annotations

import math

from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp.model import INF, Model, relative_gap


def solve(m: Model, time_limit_s: float, mip_rel_gap: float,
          start: dict[int, float] | None = None) -> tuple[str, list[float] | None, float, float]:
    try:
        import pyscipopt
    except ImportError:
        raise LazyTrainError("--solver scip needs PySCIPOpt: pip install 'lazytrain[scip]' (or use --solver highs)") \
            from None
    s = pyscipopt.Model()
    s.hideOutput()
    s.setParam("limits/time", float(time_limit_s))
    s.setParam("limits/gap", float(mip_rel_gap))
    cols = [s.addVar(name, vtype="B" if (t and lb >= 0 and ub <= 1) else ("I" if t else "C"),
                     lb=lb, ub=None if ub == INF else ub, obj=c)
            for name, lb, ub, c, t in zip(m.names, m.lb, m.ub, m.cost, m.integer, strict=True)]
    for name, coefs, lo, hi in m.rows:
        expr = pyscipopt.quicksum(coef * cols[k] for k, coef in coefs.items())
        if lo == hi:
            s.addCons(expr == lo, name=name)
        else:
            if lo > -INF:
                s.addCons(expr >= lo, name=name + "_lo")
            if hi < INF:
                s.addCons(expr <= hi, name=name)
    s.addObjoffset(m.offset)
    s.optimize()
    status = {"timelimit": "time_limit", "gaplimit": "optimal_within_gap"}.get(s.getStatus(), s.getStatus())
    if s.getNSols() == 0:
        return status, None, math.nan, math.nan
    sol = s.getBestSol()
    objective = float(s.getObjVal())
    return status, [sol[v] for v in cols], objective, \
        relative_gap(objective, float(s.getDualbound()))


