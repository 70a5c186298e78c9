"""Checks that many test files share, written once: the one-line error (the project's rule for bad input:
one line saying what is wrong and what to do, no traceback) and a small tmpfs for full-disk tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lazytrain.errors import LazyTrainError


def one_line(text: str, *needles: str) -> str:
    """`text` (an error's message, or a command's stderr) is one line without a traceback and names every needle."""
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


def cli_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """What a command printed on stderr: one `error: ...` line naming every needle."""
    err = one_line(capsys.readouterr().err, *needles)
    assert err.startswith("error: "), err
    return err


def raises_one_line(fn: Callable[[], Any], *needles: str) -> str:
    """`fn()` raises a LazyTrainError of one line naming every needle; its text."""
    with pytest.raises(LazyTrainError) as err:
        fn()
    return one_line(str(err.value), *needles)


def mount_tmpfs(path: Path, options: str) -> bool:
    """A tmpfs at `path` (root only: False where it cannot be mounted, and the test skips)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0
