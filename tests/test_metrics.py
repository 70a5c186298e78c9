"""The run's outputs: strict-JSON metrics rows (non-finite as null), tensorboard scalars, loss.png, and the rows a
resumed run keeps."""

from __future__ import annotations

import json
import math
import random

import pytest

from lazytrain.train.metrics import MetricsLog, dumps, plot_losses, read_rows

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
    losses = [RNG.uniform(1, 5) for _ in range(6)]
    log = MetricsLog(tmp_path, tensorboard=True)
    for step, loss in enumerate(losses):
        row = {"step": step, "loss": loss if step != 3 else math.nan, "lr": 1e-3, "stall_s": {"h2d": 0.1}}
        if step == 5:
            row["eval_loss"] = loss + 0.1
        log.write(row)
    log.close()
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) and rows[3]["loss"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "stall_s/h2d", "eval_loss"} <= set(events.Tags()["scalars"])
    logged = [e.value for e in events.Scalars("loss")]
    assert logged == pytest.approx([x for i, x in enumerate(losses) if i != 3], rel=1e-6)  # NaN skipped
    pytest.importorskip("matplotlib")
    assert plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_log_keeps_the_rows_before_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(7):
        log.write({"step": step, "loss": float(step)})
    log.close()
    resume_at = RNG.randrange(1, 7)
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=resume_at)
    log.write({"step": resume_at, "loss": -1.0})
    log.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(resume_at + 1)) and rows[-1]["loss"] == -1.0
    MetricsLog(tmp_path, tensorboard=False).close()  # a fresh run starts a fresh file
    assert read_rows(tmp_path / "metrics.jsonl") == []
