"""Turning a config value into its key's declared type, and the one-line error when it is not one.

Strings from the command line and YAML 1.1 quirks (`1e-5` read as a string) become numbers, sizes such as `70GB`
become bytes (keys ending in `_bytes`), `true`/`off` become booleans, a YAML list or `a,b` becomes a tuple. Every
number is bounded here once: integers fit in 64 bits (a 5001-digit integer is refused, not parsed), NaN is never
a value. Keys carry their unit in their name, and the unit its range: a size (`_bytes`) is at most
units.MAX_BYTES, a link rate (`_gbps`) in units.MIN_GBPS..MAX_GBPS or inf. The schema's `__post_init__` calls
`convert` first and then `check` with its range rules; both collect every problem of a section, so a config with
four mistakes is refused once, in four lines.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields
from functools import cache
from typing import Annotated, Any, Literal, Union

import yaml

from lazytrain.errors import LazyTrainError
from lazytrain.units import MAX_BYTES, MAX_GBPS, MIN_GBPS, parse_bytes, rate_in_range

# A string key that may name several things: a YAML list (or tuple) of names is read as `a,b`.
Names = Annotated[str, "names"]
INT_BITS = 63  # every integer key fits an int64: |value| < 2**63 (torch seeds, byte counts, numpy)
MAX_INT_DIGITS = 30  # longer digit strings are refused before int() parses them (Python's limit is 4300)


class ConfigValueError(LazyTrainError):
    """A value of the wrong type or out of range; the loader names the key as the user spelled it (`--lr`)."""

    def __init__(self, key: str, value: Any, tail: str) -> None:
        self.key, self.value, self.tail = key, value, tail
        super().__init__(f"{key} = {_shown(value)}{tail}")

    def spelled(self, spelling: str) -> ConfigValueError:
        """The same error under the spelling the user wrote: `--steps 0 ...` or `steps = 0 ...`."""
        sep = " " if spelling.startswith("--") else " = "
        error = ConfigValueError(spelling, self.value, self.tail)
        error.args = (f"{spelling}{sep}{_shown(self.value)}{self.tail}",)
        return error


class ConfigErrors(LazyTrainError):
    """Every problem of a config at once, one line each (the command line prints each as its own `error:`)."""

    def __init__(self, problems: Sequence[LazyTrainError]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def raise_all(problems: Sequence[LazyTrainError]) -> None:
    """Nothing for no problem, the problem itself for one, ConfigErrors for several."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


class TooManyDigits(int):
    """A YAML integer too long to parse (it stands in for the value so the error can name its key)."""

    def __new__(cls, digits: int) -> TooManyDigits:
        made = super().__new__(cls, 0)
        made.digits = digits
        return made

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _shown(value: Any) -> str:
    if isinstance(value, str) and len(value) > 60:
        return repr(value[:40] + "...")
    return repr(value)


# =====================================================================================================
# a section's values: convert, then check
# =====================================================================================================
def convert(section: Any) -> list[ConfigValueError]:
    """Turn each field's value into its declared type (in place); a value that is not one is reset to the
    field's default and returned as a problem (so the range checks still run on the others)."""
    declared = hints(type(section))
    problems = []
    for f in fields(section):
        try:
            value = _value(f.name, getattr(section, f.name), declared[f.name])
        except ConfigValueError as err:
            problems.append(err)
            value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        object.__setattr__(section, f.name, value)
    return problems


def check(section: Any, problems: list[ConfigValueError], *rules: tuple[bool, str, str]) -> None:
    """Raise every problem of a section at once: the conversion's, then each (ok, key, rule) that fails for a key
    whose value did convert."""
    bad = {p.key for p in problems}
    for ok, key, rule in rules:
        if not ok and key not in bad:
            problems.append(ConfigValueError(key, getattr(section, key), f" is invalid: it must be {rule}"))
            bad.add(key)
    raise_all(problems)


@cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = ("none", "null", "~", "")
_NO = object()


def _value(key: str, value: Any, hint: Any) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
        if type(None) in options:
            return None
    if isinstance(value, TooManyDigits):
        raise ConfigValueError(key, value, ": out of range; integers must be below 2**63")
    for option in options:
        if option is type(None):
            continue
        converted = _as(key, value, option)
        if converted is not _NO:
            return converted
    raise ConfigValueError(key, value, f": expected {_type_name(hint)}")


def _as(key: str, value: Any, option: Any) -> Any:
    """`value` as `option` (a type, a Literal or a tuple of one type), or _NO when it is not one."""
    origin = typing.get_origin(option)
    if origin is Annotated:  # Names: a list of names is one comma-separated string
        if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
            value = ",".join(v.strip() for v in value)
        return _as(key, value, typing.get_args(option)[0])
    if origin is Literal:
        choices = typing.get_args(option)
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        if key == "optimizer" and value in ("fp32", "hybrid"):  # older names, mapped in OptimConfig
            return value
        return _NO
    if origin is tuple:  # tuple[X, ...]: a YAML list, or a comma-separated string
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            return _NO
        inner = typing.get_args(option)[0]
        converted = tuple(_as(key, item.strip() if isinstance(item, str) else item, inner) for item in items)
        return _NO if any(item is _NO for item in converted) else converted
    if option is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        return True if text in _TRUE else False if text in _FALSE else _NO
    if isinstance(value, bool):  # never read True as 1
        return _NO
    if option is int:
        return _int(key, value)
    if option is float:
        if isinstance(value, float):
            number = value
        elif isinstance(value, int):
            number = float(value) if abs(value) < 2**1023 else math.copysign(math.inf, value)
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                return _NO
        if math.isnan(number):
            raise ConfigValueError(key, value, ": not a number; give a number")
        if key.endswith("_gbps") and not rate_in_range(number):
            raise ConfigValueError(key, value, f": out of range; a rate in GB/s must be in {MIN_GBPS:g}.."
                                   f"{MAX_GBPS:g} (inf = unthrottled)")
        return number
    if option is str:
        return value if isinstance(value, str) else _NO
    if option is dict:  # a YAML mapping, or one written inline on the command line: key={a: 1, b: 2}
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                return _NO
        return dict(value) if isinstance(value, dict) else _NO
    raise AssertionError(f"no conversion for {option!r}")


def _int(key: str, value: Any) -> Any:
    if key.endswith("_bytes") and isinstance(value, int | float | str):
        try:
            number = parse_bytes(value, what=key)
        except LazyTrainError as err:  # "cannot read 'lots' as a size" / "is negative"
            raise ConfigValueError(key, value, ": " + str(err).split(": ", 1)[1].replace(f"{value!r} ", "")) from None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        text = str(value).strip().replace("_", "")
        if sum(c.isdigit() for c in text) > MAX_INT_DIGITS:  # never hand int() a 5001-digit string
            raise ConfigValueError(key, value, ": out of range; integers must be below 2**63")
        try:
            number = int(text)
        except ValueError:
            return _NO
    if abs(number) >= 2**INT_BITS:
        raise ConfigValueError(key, value, ": out of range; integers must be below 2**63")
    if key.endswith("_bytes") and number > MAX_BYTES:
        raise ConfigValueError(key, value, ": out of range; a size must be at most 1 EiB")
    return number


def _type_name(hint: Any) -> str:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    names = []
    for option in options:
        if typing.get_origin(option) is Annotated:
            option = typing.get_args(option)[0]
        if typing.get_origin(option) is Literal:
            names.append("one of " + ", ".join(map(str, typing.get_args(option))))
        elif typing.get_origin(option) is tuple:
            inner = _type_name(typing.get_args(option)[0])
            names.append(f"one or more of {inner.removeprefix('one of ')} (a list or a,b)"
                         if inner.startswith("one of ") else f"a list of {inner.removeprefix('a ')}s (or a,b)")
        elif option is type(None):
            names.append("none")
        else:
            names.append({int: "an integer", float: "a number", bool: "true/false", str: "a string",
                          dict: "a mapping"}[option])
    return " or ".join(names)
