"""Strict JSON out: NaN and infinities become null, so every file we write parses with any JSON reader.

Python's `json` writes `NaN` / `Infinity`, which strict parsers (jq, JavaScript, Go, Rust's serde) reject;
a gap of inf or a NaN loss are real values here, so they are written as null instead. Use `dumps` wherever a
file or a line of JSON is written, and `check_writable` before long work whose result goes to a path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError

Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]


def finite_or_none(value: object) -> Json:
    """`value` with every non-finite float (at any depth of dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value  # type: ignore[return-value]


def dumps(value: object, **kwargs: Any) -> str:
    """`json.dumps` that never writes NaN or Infinity (they become null); other kwargs as json.dumps."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def check_writable(path: str | Path, knob: str) -> Path:
    """Refuse, before any work, an output file whose directory is missing or not writable (nothing is left)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise LazyTrainError(f"{knob} {path} is a directory; give a file path")
    if not parent.is_dir():
        raise LazyTrainError(f"{knob} {path}: directory {parent} does not exist; create it or pick another path")
    probe = parent / f".{path.name}.write-test"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise LazyTrainError(f"{knob} {path}: cannot write in {parent} ({err.strerror}); pick a writable path"
                             ) from None
    return path
