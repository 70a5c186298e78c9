"""Every config in examples/ loads, `lazytrain plan` runs on it, and the tiny one trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazytrain.cli import main
from lazytrain.config import load_job_config
from lazytrain.train.metrics import read_rows

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"tiny", "qwen2.5-7b-sft-rtx3090", "qwen2.5-7b-sft-h800", "plan-qwen3.6-27b-h800"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads_and_plans(path: Path, capsys) -> None:
    job = load_job_config(path)
    if "sft" in path.stem:  # the paper's SFT setting
        assert job.data.cutoff_len == 1024 and job.optim.learning_rate == 1e-5
        assert job.optim.weight_decay == 0.01 and job.optim.max_grad_norm == 1.0 and not job.data.train_on_prompt
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "placement" in out and "prediction (simulator)" in out


def test_tiny_example_trains(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "run"
    assert main(["train", str(EXAMPLES[[p.stem for p in EXAMPLES].index("tiny")]), "max_steps=2",
                 f"output_dir={out}", "--no-progress"]) == 0
    rows = read_rows(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["loss"] > 0 for r in rows)


def test_minimal_train_runs_on_the_public_api(capsys) -> None:
    """examples/minimal_train.py, as a reader runs it: it plans under its cap (offloading), checks its first step
    against transformers, and its loss falls."""
    pytest.importorskip("torch")
    import runpy

    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "minimal_train.py"), run_name="__main__")
    out = capsys.readouterr().out
    plan = next(line for line in out.splitlines() if line.startswith("plan "))
    assert set(plan.split()[1]) - {"G", "K"}, plan  # the cap made it offload or recompute
    assert "every gradient too" in out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0]
