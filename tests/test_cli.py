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


def test_a_config_with_four_mistakes_is_four_lines_at_once_without_importing_torch(tmp_path) -> None:
    """Three unknown keys and one wrong type -> one run, four lines, exit 2, output dir untouched, and
    the whole config read before torch, transformers or datasets is imported (benchmarks/config_errors.py times
    it)."""
    path = tmp_path / "job.yaml"
    path.write_text("model_name_or_path: tiny-qwen2\nmax_samples: 10\nlora_rnk_typo: 8\nwarmup_stepz: 3\n"
                    "use_fancy_kernel: true\nlearning_rate: fast\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    probe = ("import sys, runpy; sys.argv = ['lazytrain'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('lazytrain', run_name='__main__')\n"
             "finally:\n    print('heavy:', sorted(m for m in ('torch', 'transformers', 'datasets')"
             " if m in sys.modules), file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", probe, "train", str(path), f"output_dir={out}"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: config file {path}: unknown key 'lora_rnk_typo'; see `lazytrain train --help` or docs/config.md",
        f"error: config file {path}: unknown key 'warmup_stepz'; did you mean 'warmup_steps'?",
        f"error: config file {path}: unknown key 'use_fancy_kernel'; see `lazytrain train --help` or docs/config.md",
        "error: learning_rate = 'fast': expected a number",
    ]
    assert "heavy: []" in done.stderr  # nothing heavy was imported
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and done.stdout == ""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "--help"]])
def test_help_imports_nothing_heavy(argv) -> None:
    probe = ("import sys, runpy; sys.argv = ['lazytrain'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('lazytrain', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('heavy:', sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.rstrip().endswith("heavy: []") and "usage:" in done.stdout


@pytest.mark.parametrize("line, needle", [
    ("finetuning_type: oft", "finetuning_type = 'oft': expected one of full, lora, freeze"),
    ("deepspeed: ds_z3_config.json", "deepspeed = 'ds_z3_config.json' (an HF Trainer key): no such file "
                                     "ds_z3_config.json"),
])
def test_oft_and_a_missing_deepspeed_file_are_one_sentence_each(tmp_path, line, needle) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"model_name_or_path: tiny-qwen2\nstage: sft\ndo_train: true\n{line}\n")
    done = _run("train", str(path), f"output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
