"""A `lazytrain train` subprocess that pauses at a chosen moment, so a test can act then (send signals, start a
second run, delete the output directory): it writes `marker` and sleeps `PAUSE_S` seconds at that moment.

Moments (`PAUSE_AT`): `save:<name>` after the model of the checkpoint being written as `<name>` (e.g.
`.tmp-checkpoint-2`) is in; `step:<n>` before step n (1-based) runs; `final-eval` at the first batch of the
evaluation after the last step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PROGRAM = """
import os, sys, time
from pathlib import Path
from lazytrain.train import checkpoint, trainer

marker, at, pause_s = Path(os.environ["MARKER"]), os.environ["PAUSE_AT"], float(os.environ["PAUSE_S"])

def pause():
    marker.write_text(str(os.getpid()))
    time.sleep(pause_s)

real_write_model = checkpoint._write_model
def write_model(path, *args, **kwargs):
    real_write_model(path, *args, **kwargs)
    if at == f"save:{Path(path).name}":
        pause()
checkpoint._write_model = write_model

real_step = trainer.Trainer.train_step
def train_step(self, step):
    if at == f"step:{step + 1}":
        pause()
    return real_step(self, step)
trainer.Trainer.train_step = train_step

real_loop = trainer.Trainer.loop
def loop(self, signals):
    real_loop(self, signals)
    self.looped = True
trainer.Trainer.loop = loop

real_evaluate = trainer.Trainer.evaluate
def evaluate(self, stop=None):
    def slow_stop():
        if getattr(self, "looped", False) and at == "final-eval" and not marker.exists():
            pause()
        return stop is not None and stop()
    return real_evaluate(self, stop=slow_stop)
trainer.Trainer.evaluate = evaluate

from lazytrain.cli import main
sys.exit(main(sys.argv[1:]))
"""

ARGV = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--dtype", "fp32",
        "--planner", "megatrain", "--eval-batches", "0", "--no-progress"]


def start(out: Path, marker: Path, pause_at: str, *words: str, pause_s: float = 6.0) -> subprocess.Popen:
    env = {**os.environ, "MARKER": str(marker), "PAUSE_AT": pause_at, "PAUSE_S": str(pause_s),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", PROGRAM, "train", *ARGV, *words, "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(marker: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before its pause: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run never reached its pause")
        time.sleep(0.02)
