"""What a run reports: report lines on stdout (rank 0's; the other ranks' go to their console.log), `metrics.jsonl`
(one strict-JSON row per logged step), the same scalars to the trackers of `report_to` (accelerate's trackers:
tensorboard, wandb, mlflow), `loss.png` when matplotlib is present, and `summary.json`.

Strict JSON everywhere: a non-finite number (a skipped step's loss, a NaN gradient norm) is written as null,
since `NaN` / `Infinity` are rejected by strict parsers (jq, JavaScript, Go, serde).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from lazytrain.errors import LazyTrainError
from lazytrain.jsonio import Json, dumps
from lazytrain.train import rundir
from lazytrain.writes import WRITE_ERRORS, temporary, write_atomic, writing

if TYPE_CHECKING:
    from accelerate.tracking import GeneralTracker


# =====================================================================================================
# the console: rank 0 prints, every other rank writes its own file
# =====================================================================================================
class _Console:
    """Where `say` writes: stdout on rank 0 (and without torchrun); on another rank (torchrun's RANK) its lines
    wait in memory until `to_file` names its console.log, then go there. Under torchrun the terminal then shows
    each line once."""

    def __init__(self) -> None:
        self.file: IO[str] | None = None
        self.pending: list[str] = []

    @property
    def is_main(self) -> bool:
        return os.environ.get("RANK", "0") == "0"

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)  # flushed so it lands before the progress bar (stderr)
        elif self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()
        else:
            self.pending.append(text)

    def to_file(self, path: Path) -> None:
        """This (non-0) rank's lines from now on, and those said before, go to `path`."""
        if self.is_main:
            return
        if self.file is not None:
            self.file.close()
        self.file = open(path, "a")  # noqa: SIM115  (a process-long console, closed with the next to_file)
        for text in self.pending:
            self.file.write(text + "\n")
        self.file.flush()
        self.pending.clear()


CONSOLE = _Console()


def say(text: str) -> None:
    """A line of the run's report (rank 0: stdout; another rank: its console.log)."""
    CONSOLE.say(text)


def write_json(path: Path, value: object) -> None:
    """A run's JSON file, whole or not at all (writes.py); a failure stops the run in one line."""
    rundir.check(path.parent)
    write_atomic(path, dumps(value, indent=1) + "\n", then=rundir.CONTINUE)


# =====================================================================================================
# trackers
# =====================================================================================================
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def resolve_trackers(report_to: Sequence[str]) -> list[str]:
    """The tracker names of `report_to`: `all` = every tracker whose package is installed, `none` = none. A named
    tracker whose package is missing is refused in one line naming the package."""
    names = [n for n in report_to if n != "none"]
    if "all" in names:
        return [n for n, package in TRACKER_PACKAGES.items() if _installed(package) and _installed("accelerate")]
    for name in names:
        for package in (TRACKER_PACKAGES[name], "accelerate"):
            if not _installed(package):
                raise LazyTrainError(f"report_to {name} needs the {package} package: pip install "
                                     f"'lazytrain[{name}]' (or set report_to none)")
    return list(dict.fromkeys(names))


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def start_trackers(names: Sequence[str], output_dir: Path, run_name: str, config: Mapping[str, object]
                   ) -> list[GeneralTracker]:
    """accelerate's trackers, started, with the job's config as hyperparameters. tensorboard writes under
    output_dir/tensorboard; wandb (WANDB_PROJECT, default `lazytrain`; WANDB_MODE=offline works) and mlflow
    (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME) where their own settings say, as under the HF Trainer.
    accelerate is an extra: imported only when a tracker is asked for."""
    if not names:
        return []
    from accelerate import PartialState
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    PartialState()  # accelerate's trackers log through its logger, which wants its state (this process's; torchrun's
    trackers: list[GeneralTracker] = []  # process group, when there is one, is already set up by then)
    for name in names:
        if name == "tensorboard":
            tracker = TensorBoardTracker("tensorboard", output_dir)
        elif name == "wandb":
            tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "lazytrain"), name=run_name, dir=str(output_dir))
        else:  # where MLflow's own settings say (MLFLOW_TRACKING_URI; MLFLOW_EXPERIMENT_NAME wins over ours)
            tracker = MLflowTracker(experiment_name="lazytrain", run_name=run_name)
        tracker.main_process_only = False  # rank 0 alone makes trackers
        tracker.start()
        trackers.append(tracker)
    hparams = {k: v if isinstance(v, bool | int | float | str) or v is None else str(v) for k, v in config.items()}
    for tracker in trackers:
        if tracker.name != "tensorboard":  # its hparams page needs a metric; the config is in train_config.json
            tracker.store_init_configuration(hparams)
    return trackers


def hf_log_lines(row: Mapping[str, object], losses: Sequence[float | None]) -> list[str]:
    """The HF Trainer's console lines for a logged row (its ProgressCallback prints each log dict, floats to 4
    significant digits): the training loss as the mean over the steps since the last logged one, grad_norm,
    learning_rate, epoch; an evaluation's eval_loss on a line of its own."""
    def shown(logs: dict[str, object]) -> str:
        return str({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items() if v is not None})

    finite = [loss for loss in losses if loss is not None and math.isfinite(loss)]
    lines = []
    if finite:
        lines.append(shown({"loss": sum(finite) / len(finite), "grad_norm": _number(row.get("grad_norm")),
                            "learning_rate": _number(row.get("lr")), "epoch": _number(row.get("epoch"))}))
    if "eval_loss" in row:
        lines.append(shown({"eval_loss": _number(row["eval_loss"]), "epoch": _number(row.get("epoch"))}))
    return lines


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def scalars(row: Mapping[str, object]) -> dict[str, float]:
    """A row's finite numbers, nested ones as `key/inner` (what every tracker takes)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        items = value.items() if isinstance(value, Mapping) else [("", value)]
        for inner, v in items:
            if key != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{key}/{inner}" if inner else key] = float(v)
    return out


# =====================================================================================================
# metrics.jsonl
# =====================================================================================================
class MetricsLog:
    """`metrics.jsonl`, appended one row per logged step (and per evaluation), flushed as it goes; the same
    scalars go to `trackers` (started by `start_trackers`; closed here).

    A resumed run appends: rows of steps after the checkpoint it resumed from are dropped first, so the file
    holds every step once, whichever run wrote it; a line a killed run or a full disk cut short is dropped too
    (with a note). Steps count from 1 (the HF Trainer's global_step). A write that fails stops the run in one line
    (writes.py); so does a directory deleted under it.
    """

    def __init__(self, output_dir: Path, *, trackers: Sequence[GeneralTracker] = (),
                 resume_step: int | None = None) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.output_dir = output_dir
        with writing(self.path, then=rundir.CONTINUE):
            if resume_step is not None and self.path.exists():
                rows, cut = _rows_through(self.path, resume_step)
                if cut:
                    say(f"note     {self.path}: dropped {cut} line(s) that are not JSON rows (a write cut short)")
                write_atomic(self.path, "".join(row + "\n" for row in rows))
            elif self.path.exists():
                self.path.unlink()
            self._file: IO[str] = open(self.path, "a")  # noqa: SIM115  (closed in close())
        self.trackers = list(trackers)

    def write(self, row: Mapping[str, object]) -> None:
        """One strict-JSON line; the row's numbers to every tracker at its step."""
        rundir.check(self.output_dir)
        with writing(self.path, then=rundir.CONTINUE):
            self._file.write(dumps(row) + "\n")
            self._file.flush()
        values = scalars(row)
        for tracker in self.trackers:
            tracker.log(values, step=int(row["step"]))  # type: ignore[call-overload]

    def close(self) -> None:
        try:
            self._file.close()
        except WRITE_ERRORS:  # its failed write already stopped the run with a line
            pass
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def _rows_through(path: Path, step: int) -> tuple[list[str], int]:
    """metrics.jsonl's lines of steps up to `step`, and how many lines were not JSON rows (cut short)."""
    kept, cut = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = row.get("step", 0) if isinstance(row, dict) else None
        except ValueError:
            row_step = None
        if not isinstance(row_step, int):
            cut += 1
        elif row_step <= step:
            kept.append(line)
    return kept, cut


def read_rows(path: Path) -> list[dict[str, Json]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path) -> bool:
    """`loss.png`: train loss (and eval loss when there is one) against step; False, with a line saying how to get
    it, when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional
        say("note     plot_loss: no loss.png, matplotlib is not installed; pip install 'lazytrain[viz]' (or "
            "matplotlib) to get it, or set plot_loss false")
        return False
    rows = read_rows(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = temporary(png_path)
    try:
        with writing(png_path, then=rundir.CONTINUE, temporaries=(tmp,)):
            fig.savefig(tmp, dpi=100, format="png")
            os.replace(tmp, png_path)
    finally:
        plt.close(fig)
    return True
