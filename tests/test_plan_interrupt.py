"""`lazytrain plan` acts on Ctrl-C while HiGHS solves (plan/milp/highs.py runs the solve in HiGHS's thread and cancels
it through its interrupt callback): one line, exit 130, within seconds."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

HARD_SOLVE = """
import random, signal, sys
import numpy as np, highspy

# Ctrl-C as a terminal delivers it: a shell's background job (CI started with `&`) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

def market_split(h, m=4, n=40):
    # Cornuejols-Dawande market split: a 4 x 40 instance runs HiGHS to any time limit
    rng = random.Random(1)
    a = [[rng.randrange(100) for _ in range(n)] for _ in range(m)]
    h.clearModel()
    h.addVars(n + 2 * m, np.zeros(n + 2 * m), np.array([1.0] * n + [highspy.kHighsInf] * (2 * m)))
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8))
    h.changeColsCost(2 * m, np.arange(n, n + 2 * m, dtype=np.int32), np.ones(2 * m))
    for i in range(m):
        idx = list(range(n)) + [n + 2 * i, n + 2 * i + 1]
        h.addRow(sum(a[i]) // 2, sum(a[i]) // 2, len(idx), np.array(idx, dtype=np.int32),
                 np.array(a[i] + [1.0, -1.0], dtype=float))

real_start, real_run = highspy.Highs.startSolve, highspy.Highs.run
def hard(self):
    market_split(self)
    self.setOptionValue("time_limit", 600.0)
    print("solving", flush=True)
def start(self):
    hard(self)
    return real_start(self)
def run(self):
    hard(self)
    return real_run(self)
highspy.Highs.startSolve, highspy.Highs.run = start, run

from lazytrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_highs_solves_stops_plan_at_once(tmp_path):
    """`lazytrain plan` whose MILP HiGHS cannot finish (a market-split instance put in its place, time limit
    600 s): SIGINT stops it within seconds, one line, exit 130 (h.run() held the signal until the time limit)."""
    proc = subprocess.Popen([sys.executable, "-c", HARD_SOLVE, "plan", "--model", "tiny-llama", "--seq-len", "64",
                             "--time-limit-s", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while proc.stdout.readline().strip() != "solving":
        assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 20, "HiGHS ran on after Ctrl-C"
    assert proc.returncode == 130, err[-2000:]
    assert err.strip() == "interrupted", err[-2000:]


def test_the_planning_deadline_stops_a_solve_that_ignores_its_limit_in_one_line():
    """The same endless solve with HiGHS's own limit at 600 s and the planning limit at 2 s, four at once: the
    deadline's alarm (repeating every 0.1 s until planning stops) cancels HiGHS and waits for its thread; one line,
    exit 2 each. Before, a repeat of the alarm could cut that wait short and the process aborted ("terminate
    called", exit -6; 2 of 10 runs), so four catch it more often than not."""
    procs = [subprocess.Popen([sys.executable, "-c", HARD_SOLVE, "plan", "--model", "tiny-llama", "--seq-len", "64",
                               "--time-limit-s", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-2000:]
        assert len(err.strip().splitlines()) == 1, err[-2000:]
        assert "planning ran past time_limit_s 2 s while the solver ran" in err, err[-2000:]
