"""Trainer-level fault injection: non-finite gradients with every optimizer and mode, N non-finite steps in a row,
SIGTERM / SIGINT mid-run, a reused output directory. (Model loading faults: tests/test_faults_loading.py.)

Non-finite gradients are injected where a real one appears: in the host gradient a layer group lands with
(`WeightGroup.land`), before the executor takes the norm (and before any update in either mode).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from lazytrain.cli import main
from lazytrain.config import load_job_config
from lazytrain.runtime import store
from lazytrain.train import train
from lazytrain.train import trainer as trainer_module
from lazytrain.train.checkpoint import incomplete_reason
from lazytrain.train.metrics import read_rows

RNG = random.Random(20261203)
BASE = dict(model="debug", corpus="zen", batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, dtype="fp32",
            planner="megatrain", eval_batches=0, progress=False, max_grad_norm=0.0)
ARGV = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--planner", "megatrain",
        "--eval-batches", "0", "--no-progress"]


def _instrument(monkeypatch, group: str, steps: set[int], value: float) -> list[tuple[list, list]]:
    """Make group `group`'s landed gradient hold `value` on the given training steps (0-based); returns the
    (parameters, optimizer state tensors) cloned after every step."""
    current: dict[str, int | None] = {"step": None}  # None: calibration and evaluation
    real_land = store.WeightGroup.land

    def land(self, **kwargs):
        if self.name == group and current["step"] in steps:
            self.landing[RNG.randrange(self.landing.numel())] = value
        return real_land(self, **kwargs)

    taken: list[tuple[list, list]] = []
    real_step = trainer_module.Trainer.train_step

    def train_step(self, index):
        current["step"] = index
        try:
            row = real_step(self, index)
        finally:
            current["step"] = None
        self.executor.drain()  # overlap mode: the step's update, which the next step would run, applied now
        params = [p.detach().clone() for p in self.model.parameters()]
        states = [v.clone() for opt in self.optimizers for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]
        taken.append((params, states))
        return row

    monkeypatch.setattr(store.WeightGroup, "land", land)
    monkeypatch.setattr(trainer_module.Trainer, "train_step", train_step)
    return taken


@pytest.mark.parametrize("mode", ["serial", "overlap"])
@pytest.mark.parametrize("optimizer", ["adamw", "hybrid8bit", "8bit"])
def test_a_non_finite_gradient_step_is_skipped_bit_for_bit(tmp_path, monkeypatch, optimizer, mode):
    group = f"layer.{RNG.randrange(4)}"  # either mode checks every group before updating any
    bad = RNG.choice([float("inf"), float("-inf"), float("nan")])
    taken = _instrument(monkeypatch, group, {2}, bad)
    out = tmp_path / "run"
    result = train(load_job_config({**BASE, "steps": 4, "optimizer": optimizer, "optimizer_mode": mode,
                                    "output_dir": str(out)}))
    (p1, s1), (p2, s2), (p3, _) = taken[1], taken[2], taken[3]
    for a, b in zip(p1, p2, strict=True):  # step 2 changed nothing: parameters and optimizer states
        assert torch.equal(a, b)
    assert len(s1) == len(s2) and all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(p2, p3, strict=True))  # the run continues
    rows = read_rows(out / "metrics.jsonl")
    assert rows[2]["skipped"] and group in rows[2]["skipped"] and rows[2]["loss"] is not None
    assert rows[3]["lr"] == rows[2]["lr"]  # the schedule did not move
    assert [r["skipped"] for r in rows].count(None) == 3
    assert result.summary["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


@pytest.mark.parametrize("mode", ["serial", "overlap"])
def test_three_non_finite_steps_in_a_row_stop_the_run_and_save_nothing_new(tmp_path, monkeypatch, capsys, mode):
    _instrument(monkeypatch, "head", {2, 3, 4}, float("nan"))
    out = tmp_path / "run"
    argv = ["save_steps=2", *ARGV, "--steps", "8", "--dtype", "fp32", "--max-grad-norm", "0",
            "--optimizer-mode", mode, "--output-dir", str(out)]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 3 steps in a row were non-finite (first: gradients of head at step 3)"), err
    assert "\n" not in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert incomplete_reason(out / "checkpoint-2") is None
    skipped = [r["step"] for r in read_rows(out / "metrics.jsonl") if r["skipped"]]
    assert skipped == [3, 4, 5]  # the 3rd to 5th steps (1-based)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143),
                                          pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_signal_mid_run_saves_a_checkpoint_and_exits_with_one_line(tmp_path, signum, code):
    """The step in flight finishes, a complete checkpoint is saved, no spill file remains, exit 128 + signal."""
    out, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.plan.plan import Plan
    from lazytrain.train.build import model_source

    spec = ModelSpec.from_config(model_source(load_job_config(BASE), 259).config)
    plan = tmp_path / "plan.json"
    Plan.from_tiers(spec, ["gpu", "nvme", "cpu", "nvme", "gpu"]).save(plan)  # spill files every step
    cmd = [sys.executable, "-c", "import sys; from lazytrain.cli import main; sys.exit(main(sys.argv[1:]))",
           "train", *ARGV, "--steps", "100000", "--plan", str(plan), "--nvme-dir", str(nvme),
           "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    line = err.strip()
    assert "\n" not in line and line.startswith(f"interrupted: {signal.Signals(signum).name} after step "), line
    step = int(line.split("after step ")[1].split(":")[0])
    assert (out / f"checkpoint-{step}").is_dir() and incomplete_reason(out / f"checkpoint-{step}") is None
    assert len(read_rows(out / "metrics.jsonl")) == step
    assert not list(nvme.iterdir()), "spill files left behind"
