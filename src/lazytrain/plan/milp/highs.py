"""The HiGHS driver: the model into highspy's arrays, the solve in HiGHS's thread so that a signal stops it."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import Model, relative_gap

if TYPE_CHECKING:
    import highspy


@contextlib.contextmanager
def _stdout_silenced():
    """HiGHS prints its banner from C++ when constructed; keep `lazytrain plan` output clean."""
    try:
        fd = os.dup(1)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(fd, 1)
            os.close(fd)


def solve(m: Model, time_limit_s: float, mip_rel_gap: float,
          start: dict[int, float] | None = None) -> tuple[str, list[float] | None, float, float]:
    import highspy
    import numpy as np

    with _stdout_silenced():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("mip_abs_gap", 0.0 if mip_rel_gap == 0 else 1e-6)  # the tie-breakers are ~1e-6 s
    h.setOptionValue("threads", 1)
    n = len(m.names)
    inf = highspy.kHighsInf
    h.addVars(n, np.array([max(lb, -inf) for lb in m.lb]), np.array([min(ub, inf) for ub in m.ub]))
    idx = np.arange(n, dtype=np.int32)
    h.changeColsCost(n, idx, np.array(m.cost, dtype=float))
    if any(m.integer):
        h.changeColsIntegrality(n, idx, np.array([1 if t else 0 for t in m.integer], dtype=np.uint8))
    starts, index, value, lo, hi = [], [], [], [], []
    for _, coefs, rlo, rhi in m.rows:
        starts.append(len(index))
        index.extend(coefs)
        value.extend(coefs.values())
        lo.append(max(rlo, -inf))
        hi.append(min(rhi, inf))
    h.addRows(len(m.rows), np.array(lo), np.array(hi), len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value, dtype=float))
    h.changeObjectiveOffset(m.offset)
    if start:  # a warm start: the incumbent plan's binaries (HiGHS completes the continuous part)
        h.setSolution(len(start), np.array(list(start), dtype=np.int32), np.array(list(start.values()), dtype=float))
    _run_interruptibly(h)
    status = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    name = {S.kOptimal: "optimal", S.kTimeLimit: "time_limit", S.kInfeasible: "infeasible",
            S.kSolutionLimit: "solution_limit", S.kInterrupt: "interrupted"}.get(status, h.modelStatusToString(status))
    if status == S.kInfeasible or not has_solution:
        return name, None, math.nan, math.nan
    objective = float(info.objective_function_value)
    bound = float(info.mip_dual_bound) if any(m.integer) else objective
    m.stats = {"bb_nodes": int(info.mip_node_count), "lp_iterations": int(info.simplex_iteration_count)}
    return name, list(h.getSolution().col_value), objective, relative_gap(objective, bound)


# the signals whose handlers raise while HiGHS solves: Ctrl-C, a run's SIGTERM, the planning deadline's alarm
_SOLVE_SIGNALS = {signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", signal.SIGTERM)}


def _run_interruptibly(h: highspy.Highs) -> None:
    """`h.run()` in HiGHS's solver thread while this one waits, so a signal (Ctrl-C; a run's SIGTERM; the planning
    deadline) is acted on at once: HiGHS is cancelled at its next interrupt check, its thread joined, and the
    exception goes on (h.run() held the signal until the solve ended, up to time_limit_s).

    The thread must never outlive the exception: a process that exits while HiGHS runs aborts ("terminate called
    without an active exception") or hangs. So the signals wait while startSolve() starts it (one landing there
    would leave the thread running, unowned), and a second signal (another Ctrl-C, the deadline's repeating alarm)
    during the join cancels again rather than cutting the join short. Left: Ctrl-C within a millisecond of a solve's
    start still ends in that abort about one time in three, after "interrupted" (in HiGHS's teardown; none later)."""
    h.HandleUserInterrupt = True  # HiGHS's interrupt callbacks stop the solve once cancelSolve() was called
    masked = hasattr(signal, "pthread_sigmask")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SOLVE_SIGNALS) if masked else set()
    try:
        h.startSolve()  # its thread inherits the mask: the signals are this thread's to handle
        try:
            if masked:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal that waited is raised in here
            while not h.wait(0.1)[0]:
                pass
        except BaseException:
            h.cancelSolve()
            _join_solver(h)
            raise
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _join_solver(h: highspy.Highs) -> None:
    """Wait until HiGHS's thread (cancelled) has stopped, whatever signal comes meanwhile."""
    while True:
        try:
            if h.wait(0.1)[0]:
                return
        except BaseException:
            h.cancelSolve()


