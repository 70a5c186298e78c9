"""The one write path (writes.py): every file a run writes is whole or absent, and any write error -- OSError,
SafetensorError, RuntimeError -- stops the run in one line with its temporaries removed and the last complete
checkpoint kept. Full disks are real tmpfs mounts where the tests run as root; elsewhere the writers are patched
to fail (the injected cases run everywhere: test_checkpoint.py::test_a_failed_save_leaves_the_previous_checkpoint_
intact and below)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from checks import cli_error
from safetensors import SafetensorError

from lazytrain import writes
from lazytrain.cli import main
from lazytrain.errors import LazyTrainError
from lazytrain.train.checkpoint import incomplete_reason

ARGV = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--dtype", "fp32",
        "--planner", "megatrain", "--eval-batches", "0", "--no-progress"]
CHECKPOINT_KIB = 2600  # one checkpoint of the debug model (2.5 MiB) and the run's files


def _mount(path: Path, size_kib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith(".old-"))


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "disk"
    if not _mount(path, CHECKPOINT_KIB + 1500):
        pytest.skip("mounting a tmpfs needs root (the injected cases cover this machine)")
    yield path
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_disk_that_fills_during_a_checkpoint_keeps_the_previous_one(small_disk, capsys):
    """A real full disk (tmpfs with room for one checkpoint): checkpoint-4 fails mid-write, the run stops in one
    line naming checkpoint-2 as intact and how to continue, the partial checkpoint is gone (its blocks free again);
    with room made, `auto` resumes from checkpoint-2 and finishes."""
    out = small_disk / "run"
    assert main(["train", *ARGV, "--steps", "6", "save_steps=2", "--output-dir", str(out)]) == 2
    err = cli_error(capsys)
    assert "checkpoint-4 (No space left on device); the run stopped, checkpoint-2 is intact" in err, err
    assert "resume_from_checkpoint=auto" in err
    assert _leftovers(out) == [] and incomplete_reason(out / "checkpoint-2") is None
    assert not (out / "checkpoint-4").exists()
    subprocess.run(["mount", "-o", f"remount,size={3 * CHECKPOINT_KIB + 1500}k", str(small_disk)], check=True)
    assert main(["train", *ARGV, "--steps", "6", "save_steps=2", "save_total_limit=1",
                 "resume_from_checkpoint=auto", "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]


@pytest.mark.parametrize("free_kib", [4, 8, 16, 64])
def test_a_nearly_full_disk_at_the_start_is_one_line_and_leaves_no_temporary(small_disk, capsys, free_kib):
    """A disk with a few pages free: whichever write fails first (the lock, plan.json, train_config.json,
    metrics.jsonl, a trace, the checkpoint), the run stops in one line and leaves no temporary file."""
    filler = small_disk / "filler"
    total = os.statvfs(small_disk)
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, total.f_bavail * total.f_frsize - free_kib * 1024))
    out = small_disk / "run"
    assert main(["train", *ARGV, "--steps", "2", "--output-dir", str(out)]) == 2
    err = cli_error(capsys)
    assert "No space left on device" in err, err
    assert not out.exists() or _leftovers(out) == []


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   SafetensorError("Error while serializing: IoError(No space left on device)"),
                                   RuntimeError("PytorchStreamWriter failed writing file: No space left on device")])
def test_write_atomic_turns_any_write_error_into_one_line_and_keeps_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "train_config.json"
    path.write_text("old")

    def failing_fsync(fd: int) -> None:
        raise error

    monkeypatch.setattr(writes.os, "fsync", failing_fsync)
    with pytest.raises(LazyTrainError, match=r"cannot write .*train_config.json \(No space left on device\); go on"):
        writes.write_atomic(path, "new", then="go on")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["train_config.json"]


@pytest.mark.parametrize("target", ["metrics.jsonl", "train_config.json", "plan.json", "step_trace_measured.json",
                                    "loss.png", "summary.json"])
def test_a_failing_run_file_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys, target):
    """Each file the run writes, failing with ENOSPC (patched where the file is written): one line naming it and how
    to continue, no temporary left, the run stopped."""
    real_open = open

    def full(file, mode="r", *args, **kwargs):
        if target in os.fspath(file) and ("w" in mode or "a" in mode):
            handle = real_open(file, mode, *args, **kwargs)
            handle.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    import lazytrain.train.metrics as metrics

    monkeypatch.setattr(writes, "open", full, raising=False)
    monkeypatch.setattr(metrics, "open", full, raising=False)
    if target == "loss.png":
        pytest.importorskip("matplotlib")
        import matplotlib.figure

        real_savefig = matplotlib.figure.Figure.savefig

        def savefig(self, fname, *args, **kwargs):
            if "loss.png" in os.fspath(fname):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_savefig(self, fname, *args, **kwargs)

        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    out = tmp_path / "run"
    assert main(["train", *ARGV, "--steps", "3", "save_steps=2", "--output-dir", str(out)]) == 2
    err = cli_error(capsys)
    assert target in err and "No space left on device" in err and "resume_from_checkpoint=auto" in err, err
    assert _leftovers(out) == []
