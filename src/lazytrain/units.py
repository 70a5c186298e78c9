"""Byte sizes as people write them ("70GB", "1.5 TiB", "512MiB") and back; the ranges a size and a link rate may
take."""

from __future__ import annotations

import math
import re

from lazytrain.errors import LazyTrainError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# A size is at most 1 EiB: beyond any machine's memory or disk, and a sum of a few still fits an int64.
MAX_BYTES = 2**60
# A link rate (GB/s) is at least 1 MB/s (a GB then moves in 17 minutes; slower, an emulated transfer's sleep
# outgrows what time.sleep accepts) and at most 1 PB/s (beyond any link); inf means unthrottled.
MIN_GBPS, MAX_GBPS = 1e-3, 1e6
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """`"70GB"` -> 70_000_000_000; GB/TB are decimal, GiB/TiB binary; a bare number is bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise LazyTrainError(
                f"{what}: cannot read {text!r} as a size; write e.g. 70GB, 1.5TiB or 512MiB"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if value < 0:
        raise LazyTrainError(f"{what}: {text!r} is negative; sizes must be >= 0")
    if not math.isfinite(value * _UNITS[unit]):
        raise LazyTrainError(f"{what}: {text!r} is not a finite size; write e.g. 70GB, 1.5TiB or 512MiB")
    return int(round(value * _UNITS[unit]))


def rate_in_range(gbps: float) -> bool:
    """A link rate LazyTrain plans and emulates with: MIN_GBPS..MAX_GBPS, or inf."""
    return gbps == math.inf or MIN_GBPS <= gbps <= MAX_GBPS


def format_bytes(num_bytes: float) -> str:
    """Binary units, 3 significant digits: 1.23 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            digits = f"{value:.0f}" if unit == "B" or abs(value) >= 1000 else f"{value:.3g}"  # never 1.01e+03
            return f"{digits} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
