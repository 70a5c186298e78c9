"""Signals at the last moments of a run (real signals to a subprocess paused at that moment, tests/paused_run.py):
a signal during a save lets it finish, a second says one more aborts, a third abandons it cleanly; a signal
during the final evaluation or the final checkpoint is acted on and the checkpoint kept. (A signal mid-run:
test_faults.py.)"""

from __future__ import annotations

import json
import signal
import time

import pytest
from paused_run import start, wait_for

from lazytrain.train.checkpoint import incomplete_reason


def _signal(proc, count: int, signum: int = signal.SIGTERM) -> tuple[int, str]:
    for _ in range(count):
        proc.send_signal(signum)
        time.sleep(0.3)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("error:", "interrupted:"))]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_final_checkpoint_keeps_it(tmp_path, signum):
    """save_steps 0: the final checkpoint is the run's only one; a signal while it is written (it threw the run
    away before, exit 143 and no checkpoint) lets it finish and the run exits 143 / 130 with one line."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "save:.tmp-checkpoint-3", "--steps", "3", "save_steps=0", pause_s=3)
    wait_for(marker, proc)
    code, err = _signal(proc, 1, signum)
    assert code == (143 if signum == signal.SIGTERM else 130), err[-2000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "saved" in lines[0] and "checkpoint-3" in lines[0], err[-2000:]
    assert incomplete_reason(out / "checkpoint-3") is None
    assert not list(out.glob(".*tmp*"))


def test_two_signals_during_a_save_warn_and_the_save_still_finishes(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "save:.tmp-checkpoint-2", "--steps", "6", "save_steps=2", pause_s=3)
    wait_for(marker, proc)
    code, err = _signal(proc, 2)
    assert code == 143, err[-2000:]
    assert "saving a checkpoint; one more signal to abort it" in err
    lines = _error_lines(err)
    assert len(lines) == 1 and "after step 2: saved" in lines[0], err[-2000:]  # stopped once the save was in
    assert incomplete_reason(out / "checkpoint-2") is None and not (out / "checkpoint-3").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_third_signal_abandons_the_save_cleanly(tmp_path):
    """Three signals while checkpoint-4 is written: it is abandoned with no temporary left, checkpoint-2 intact,
    one line saying so; `auto` resumes from checkpoint-2."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "save:.tmp-checkpoint-4", "--steps", "6", "save_steps=2", pause_s=6)
    wait_for(marker, proc)
    code, err = _signal(proc, 3)
    assert code == 143, err[-2000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "checkpoint 4 abandoned, nothing of it kept; checkpoint-2 is intact" in lines[0], err
    assert "Traceback" not in err
    assert not (out / "checkpoint-4").exists() and not list(out.glob(".*tmp*"))
    assert incomplete_reason(out / "checkpoint-2") is None


def test_a_signal_during_the_final_evaluation_is_acted_on(tmp_path):
    """(It was recorded and ignored.) The evaluation stops at its next batch, the final checkpoint is saved, exit
    143 with one line."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "final-eval", "--steps", "2", "save_steps=0", "--eval-batches", "3", pause_s=3)
    wait_for(marker, proc)
    code, err = _signal(proc, 1)
    assert code == 143, err[-2000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "after the last step: saved" in lines[0], err[-2000:]
    assert incomplete_reason(out / "checkpoint-2") is None and not (out / "summary.json").exists()

