"""What a run reports: report lines on stdout, `metrics.jsonl` (one strict-JSON row per step), the same scalars
to tensorboard when asked, `loss.png` when matplotlib is present, and `summary.json`.

Strict JSON everywhere: a non-finite number (a skipped step's loss, a NaN gradient norm) is written as null,
since `NaN` / `Infinity` are rejected by strict parsers (jq, JavaScript, Go, serde).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from lazytrain.errors import LazyTrainError
from lazytrain.jsonio import Json, dumps

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

def say(text: str) -> None:
    """A line of the run's report on stdout, flushed so it lands before the progress bar (stderr)."""
    print(text, flush=True)


def write_json(path: Path, value: object) -> None:
    path.write_text(dumps(value, indent=1) + "\n")


class MetricsLog:
    """`metrics.jsonl`, appended one row per logged step (and per evaluation), flushed as it goes; the same
    scalars go to tensorboard under `output_dir/tensorboard` when `tensorboard` is true.

    A resumed run appends: rows of steps after the checkpoint it resumed from are dropped first, so the file
    holds every step once, whichever run wrote it.
    """

    def __init__(self, output_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        self.path = output_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file: IO[str] = open(self.path, "a")  # noqa: SIM115  (closed in close())
        self._tensorboard: SummaryWriter | None = None
        if tensorboard:
            self._tensorboard = _summary_writer(output_dir / "tensorboard")

    def write(self, row: Mapping[str, object]) -> None:
        """One strict-JSON line; numeric scalars (and each entry of a dict of them) to tensorboard too."""
        self._file.write(dumps(row) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            step = int(row["step"])  # type: ignore[call-overload]
            for key, value in row.items():
                if key == "step":
                    continue
                if isinstance(value, Mapping):
                    for inner, v in value.items():
                        _scalar(self._tensorboard, f"{key}/{inner}", v, step)
                else:
                    _scalar(self._tensorboard, key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _summary_writer(log_dir: Path) -> SummaryWriter:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        raise LazyTrainError("report_to tensorboard needs the tensorboard package: pip install tensorboard, or "
                             "set report_to none") from None
    return SummaryWriter(log_dir=str(log_dir))


def _scalar(writer: SummaryWriter, key: str, value: object, step: int) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        writer.add_scalar(key, value, step)


def read_rows(path: Path) -> list[dict[str, Json]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path) -> bool:
    """`loss.png`: train loss (and eval loss when there is one) against step; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional
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
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True
