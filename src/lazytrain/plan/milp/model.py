"""A solver-neutral sparse model: columns and rows by name, handed to HiGHS or SCIP unchanged."""

from __future__ import annotations

import math

INF = math.inf


class Model:
    """Columns and rows by name; both solvers get this one, so they solve the same formulation."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[str, dict[int, float], float, float]] = []
        self.offset = 0.0
        self.stats: dict[str, int] = {}  # the solver's search: branch-and-bound nodes, LP iterations

    def var(self, name: str, lb: float = 0.0, ub: float = INF, cost: float = 0.0, integer: bool = False) -> int:
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.names) - 1

    def row(self, name: str, coefs: dict[int, float], lo: float = -INF, hi: float = INF) -> None:
        coefs = {k: v for k, v in coefs.items() if v != 0.0}
        if not coefs:  # a constant row: check it here rather than hand the solver an empty row
            if lo > 1e-9 or hi < -1e-9:
                raise Infeasible(name)
            return
        self.rows.append((name, coefs, lo, hi))


class Infeasible(Exception):
    """A row no plan meets, found while building (a constant row, a fixed tier or K the columns cannot take)."""


def add_coef(coefs: dict[int, float], var: int, value: float) -> None:
    """coefs[var] += value (a column may appear in several terms of one row)."""
    coefs[var] = coefs.get(var, 0.0) + value


def relative_gap(objective: float, bound: float) -> float:
    """Relative gap (objective - bound) / max(|objective|, 1 ms); below 1 microsecond (the solvers' tolerance on
    an objective in seconds) it is 0. Without this an objective made only of tie-breakers (~1e-4 s) would turn
    a nanosecond of tolerance into a visible "gap"."""
    if not math.isfinite(bound):
        return math.inf
    absolute = max(0.0, objective - bound)
    return 0.0 if absolute < 1e-6 else absolute / max(abs(objective), 1e-3)
