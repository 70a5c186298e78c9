"""The run's outputs: strict-JSON metrics rows (non-finite as null), the trackers of report_to (tensorboard, wandb
offline), loss.png, and the rows a resumed run keeps."""

from __future__ import annotations

import json
import math
import random

import pytest

from lazytrain.errors import LazyTrainError
from lazytrain.train.metrics import MetricsLog, dumps, plot_losses, read_rows, resolve_trackers, start_trackers

RNG = random.Random(20261203)


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null_at_any_depth():
    value = {"loss": math.nan, "grad_norm": math.inf, "stall_s": {"h2d": -math.inf, "d2h": 0.5}, "xs": [1.0, math.nan]}
    assert _strict(dumps(value)) == {"loss": None, "grad_norm": None, "stall_s": {"h2d": None, "d2h": 0.5},
                                     "xs": [1.0, None]}


def test_metrics_log_rows_tensorboard_and_plot(tmp_path):
    pytest.importorskip("tensorboard")  # optional: pip install 'lazytrain[tensorboard]' (CI installs it)
    pytest.importorskip("accelerate")
    losses = [RNG.uniform(1, 5) for _ in range(6)]
    log = MetricsLog(tmp_path, trackers=start_trackers(resolve_trackers(["tensorboard"]), tmp_path, "run", {}))
    for step, loss in enumerate(losses, start=1):
        row = {"step": step, "loss": loss if step != 4 else math.nan, "lr": 1e-3, "stall_s": {"h2d": 0.1}}
        if step == 6:
            row["eval_loss"] = loss + 0.1
        log.write(row)
    log.close()
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[3]["loss"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "stall_s/h2d", "eval_loss"} <= set(events.Tags()["scalars"])
    logged = [e.value for e in events.Scalars("loss")]
    assert logged == pytest.approx([x for i, x in enumerate(losses) if i != 3], rel=1e-6)  # NaN skipped
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 5, 6]  # steps count from 1
    pytest.importorskip("matplotlib")
    assert plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_gets_every_logged_scalar(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # optional: pip install 'lazytrain[wandb]'
    pytest.importorskip("accelerate")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[tuple[dict, int]] = []
    real_log = wandb.sdk.wandb_run.Run.log

    def spy(self, data, step=None, **kwargs):  # what reaches wandb's own Run.log (which writes the offline run)
        logged.append((dict(data), step))
        return real_log(self, data, step=step, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    log = MetricsLog(tmp_path, trackers=start_trackers(["wandb"], tmp_path, "p25-run", {"learning_rate": 1e-3}))
    losses = [RNG.uniform(1, 5) for _ in range(3)]
    for step, loss in enumerate(losses, start=1):
        log.write({"step": step, "loss": loss, "stall_s": {"h2d": 0.25}, "skipped": None})
    log.close()
    assert [(d["loss"], d["stall_s/h2d"], step) for d, step in logged] == [(x, 0.25, i + 1) for i, x in
                                                                          enumerate(losses)]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and next(runs[0].glob("*.wandb")).stat().st_size > 0  # the offline run, written


def test_mlflow_gets_every_logged_scalar_at_its_step(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # optional: pip install 'lazytrain[mlflow]'
    pytest.importorskip("accelerate")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local store, as a user sets it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    log = MetricsLog(tmp_path, trackers=start_trackers(["mlflow"], tmp_path, "p25-run", {"learning_rate": 1e-3}))
    losses = [RNG.uniform(1, 5) for _ in range(3)]
    for step, loss in enumerate(losses, start=1):
        log.write({"step": step, "loss": loss, "stall_s": {"h2d": 0.25}})
    log.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lazytrain").experiment_id])
    assert run.data.params["learning_rate"] == "0.001" and run.info.run_name == "p25-run"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(i + 1, pytest.approx(x)) for i, x in enumerate(losses)]


def test_a_tracker_whose_package_is_missing_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(LazyTrainError, match=r"^report_to mlflow needs the mlflow package: pip install "
                                             r"'lazytrain\[mlflow\]' \(or set report_to none\)$"):
        resolve_trackers(["mlflow"])
    assert "mlflow" not in resolve_trackers(["all"])  # all: the installed ones
    assert resolve_trackers(["none"]) == []


def test_a_resumed_log_keeps_the_rows_up_to_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 8):
        log.write({"step": step, "loss": float(step)})
    log.close()
    resume_at = RNG.randrange(1, 7)  # checkpoint-<resume_at> holds steps 1..resume_at
    log = MetricsLog(tmp_path, resume_step=resume_at)
    log.write({"step": resume_at + 1, "loss": -1.0})
    log.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, resume_at + 2)) and rows[-1]["loss"] == -1.0
    MetricsLog(tmp_path).close()  # a fresh run starts a fresh file
    assert read_rows(tmp_path / "metrics.jsonl") == []
