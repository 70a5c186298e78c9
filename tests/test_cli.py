"""The `lazytrain` / `python -m lazytrain` command line as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parent.parent / "src")


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "lazytrain", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def test_python_dash_m_lazytrain_shows_help() -> None:
    done = _run("--help")
    assert done.returncode == 0 and "plan" in done.stdout and "train" in done.stdout
    done = _run("train", "--help")
    assert done.returncode == 0 and "--learning-rate" in done.stdout and "--lr" in done.stdout
    assert "Peak learning rate" in done.stdout  # the field's docstring is its help text


@pytest.mark.parametrize("command", ["plan", "train"])
def test_bad_config_is_one_line_and_exit_2(command: str, tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: debug\nlearning_rat: 1e-5\n")
    out = tmp_path / "run"
    cases = {
        "unknown key": ([str(path)], "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
        "wrong type": (["max_steps=many"], "max_steps = 'many': expected an integer"),
        "wrong type of a flag": (["--batch-size", "lots"], "--batch-size 'lots': expected an integer or one of auto"),
        "missing file": ([str(tmp_path / "nope.yaml")], "cannot read it"),
        "not key=value": (["=5"], "expected key=value"),
    }
    for case, (argv, needle) in cases.items():
        done = _run(command, *argv, f"output_dir={out}")
        assert done.returncode == 2, (case, done.stderr)
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (case, done.stderr)
        assert needle in done.stderr, (case, done.stderr)
    assert not out.exists()  # nothing written


def test_train_refuses_a_key_it_does_not_act_on_yet(tmp_path) -> None:
    out = tmp_path / "run"
    done = _run("train", "--model", "debug", "hardware=h800", f"output_dir={out}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "hardware = 'h800': not supported by `lazytrain train` yet" in done.stderr
    assert not out.exists()
