"""The MILP: place every layer boundary on gpu / cpu / nvme / recompute so that the step is shortest.

The formulation -- index sets, parameters, variables and each constraint family's equation -- is written out in
docs/planner.md; the code keeps its symbols:
    j layers 0..L-1, i boundaries 0..L, (s, e) candidate segments (e - s <= K), windows F_j, H, R_j, B_j
    x[s,e] segment, z[i] materialized, g[i] / c[i] / n[i] its home, y[j] layer kept, v[s,e] / vn[s,e] reloads,
    T[w] window seconds, Q[k] end of B_k, S the step; A[i], p[j], g[j] bytes, rho[j], beta[j] seconds, a_X = 1 / B_X

Modules: instance (the numbers), model (solver-neutral rows and columns), formulation (model units, the columns
by symbol), families (the build order of variables, path, placement, kept, capacity, gpu_memory, reloads, windows,
updates, step, counts, objective: one module each), highs and scip (the drivers), solve (the entry points below).
"""

from lazytrain.plan.milp.instance import PlanningInstance, instance_from_cost
from lazytrain.plan.milp.model import INF
from lazytrain.plan.milp.solve import (
    DEFAULT_MAX_SEGMENT,
    DEFAULT_MIP_REL_GAP,
    DEFAULT_SOLVER,
    DEFAULT_TIME_LIMIT_S,
    SOLVERS,
    MilpSolution,
    milp_step_s,
    plan_transfers,
    solve_instance,
    solve_milp,
    to_plan,
)

__all__ = [
    "DEFAULT_MAX_SEGMENT", "DEFAULT_MIP_REL_GAP", "DEFAULT_SOLVER", "DEFAULT_TIME_LIMIT_S", "INF",
    "SOLVERS", "MilpSolution", "PlanningInstance", "instance_from_cost", "milp_step_s", "plan_transfers",
    "solve_instance", "solve_milp", "to_plan",
]
