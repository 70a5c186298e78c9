"""One place resolves the job (job/resolve.py): nothing `auto` or derived is left for the trainer to rewrite, and
the run's effective config is printed before the model is built and written as train_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from lazytrain.cli import main  # noqa: E402  (after the importorskip guards)
from lazytrain.config import JobConfig, job_config_from_dict, load_job_config  # noqa: E402
from lazytrain.job.resolve import describe, resolve_job  # noqa: E402
from lazytrain.paths import cache_dir  # noqa: E402
from lazytrain.train import rundir  # noqa: E402


def test_the_resolved_job_has_nothing_left_to_derive(tmp_path, monkeypatch):
    """device, dtype and batch `auto`, no output_dir, dataset math on a built-in shape: each comes back concrete,
    the math set as the default job's model directory and files, the output directory as the one claimed."""
    monkeypatch.chdir(tmp_path)
    job = load_job_config({"model": "debug", "dataset": "math", "device": "auto", "dtype": "auto",
                           "per_device_train_batch_size": "auto", "cutoff_len": 32, "gpu_mem_cap_bytes": "8MiB",
                           "progress": False})
    assert job.checkpoint.output_dir is None
    try:
        run = resolve_job(job)
    finally:
        rundir.release_all()
    resolved = run.job
    assert resolved.runtime.device in ("cpu", "cuda") and resolved.runtime.dtype in ("fp32", "bf16")
    assert isinstance(resolved.data.per_device_train_batch_size, int) and resolved.data.per_device_train_batch_size > 0
    assert Path(resolved.checkpoint.output_dir) == run.output_dir and run.output_dir.parent == Path("runs")
    default_job = cache_dir() / "default-job-debug"
    assert Path(resolved.model.model) == default_job / "model" and resolved.model.init == "random"
    assert Path(resolved.data.dataset).parent == default_job and Path(resolved.data.eval_dataset).is_file()
    assert run.exact_match_file == Path(resolved.data.eval_dataset)
    assert run.resume_from is None and run.ranks is None
    # written and read back, the resolved job is the same value (train_config.json re-runs it)
    assert job_config_from_dict(json.loads(json.dumps(resolved.to_dict()))) == resolved


def test_train_config_json_is_the_effective_config_printed_first(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32",
            "--eval-batches", "0", "--steps", "1", "--dtype", "auto", "--planner", "megatrain", "--no-progress",
            "--output-dir", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    written = json.loads((out / "train_config.json").read_text())
    job = job_config_from_dict(written)
    assert written["runtime"]["device"] in ("cpu", "cuda") and written["runtime"]["dtype"] != "auto"
    assert written["checkpoint"]["output_dir"] == str(out)
    config = [line.removeprefix("config   ") for line in printed if line.startswith("config   ")]
    assert config == describe(job) and config  # the file is exactly what was printed (its non-default keys)
    first_model_line = next(i for i, line in enumerate(printed) if line.startswith("model    "))
    assert max(i for i, line in enumerate(printed) if line.startswith("config   ")) < first_model_line
    assert describe(JobConfig()) == []
