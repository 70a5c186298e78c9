import pytest

from lazytrain.errors import LazyTrainError
from lazytrain.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("70GB", 70 * 10**9), ("1.5TiB", int(1.5 * 2**40)), ("512 MiB", 512 * 2**20), ("4096", 4096), ("2tb", 2 * 10**12)],
)
def test_parse_bytes_reads_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-5GB", "lots", "12XB", "", "1.2.3GB"])
def test_parse_bytes_refuses_bad_sizes_naming_the_knob(text):
    with pytest.raises(LazyTrainError, match="--gpu-mem-cap"):
        parse_bytes(text, what="--gpu-mem-cap")


def test_format_bytes_uses_binary_units():
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(1010 * 2**20) == "1010 MiB"  # 1000-1023 of a unit: no scientific notation
