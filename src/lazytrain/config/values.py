"""Turning a config value into its key's declared type, and the one-line error when it is not one.

Strings from the command line and YAML 1.1 quirks (`1e-5` read as a string) become numbers, sizes such as `70GB`
become bytes (keys ending in `_bytes`), `true`/`off` become booleans; the schema's `__post_init__` calls
`convert` first and `need` for each range check.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from functools import cache
from typing import Any, Literal, Union

from lazytrain.errors import LazyTrainError
from lazytrain.units import parse_bytes


class ConfigValueError(LazyTrainError):
    """A value of the wrong type or out of range; the loader names the key as the user spelled it (`--lr`)."""

    def __init__(self, key: str, value: Any, tail: str) -> None:
        self.key, self.value, self.tail = key, value, tail
        super().__init__(f"{key} = {value!r}{tail}")

    def spelled(self, spelling: str) -> ConfigValueError:
        """The same error under the spelling the user wrote: `--steps 0 ...` or `steps = 0 ...`."""
        sep = " " if spelling.startswith("--") else " = "
        error = ConfigValueError(spelling, self.value, self.tail)
        error.args = (f"{spelling}{sep}{self.value!r}{self.tail}",)
        return error


def need(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigValueError(key, value, f" is invalid: it must be {rule}")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def convert(section: Any) -> None:
    """Turn each field's value into its declared type (in place), or raise one line naming key, value, type."""
    declared = hints(type(section))
    for f in fields(section):
        value = getattr(section, f.name)
        object.__setattr__(section, f.name, _value(f.name, value, declared[f.name]))


@cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(key: str, value: Any, hint: Any) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
        if type(None) in options:
            return None
    for option in options:
        if option is type(None):
            continue
        converted = _as(key, value, option)
        if converted is not _NO:
            return converted
    raise ConfigValueError(key, value, f": expected {_type_name(hint)}")


_NO = object()


def _as(key: str, value: Any, option: Any) -> Any:
    """`value` as `option` (a type or a Literal), or _NO when it is not one."""
    if typing.get_origin(option) is Literal:
        choices = typing.get_args(option)
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        if key == "optimizer" and value in ("fp32", "hybrid"):  # older names, mapped in OptimConfig
            return value
        return _NO
    if option is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        return True if text in _TRUE else False if text in _FALSE else _NO
    if isinstance(value, bool):  # never read True as 1
        return _NO
    if option is int:
        if key.endswith("_bytes") and isinstance(value, int | float | str):
            try:
                return parse_bytes(value, what=key)
            except LazyTrainError as err:  # "cannot read 'lots' as a size" / "is negative"
                raise ConfigValueError(key, value, ": " + str(err).split(": ", 1)[1].replace(f"{value!r} ", "")
                                       ) from None
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip().replace("_", ""))
        except ValueError:
            return _NO
    if option is float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            return _NO
    if option is str:
        return value if isinstance(value, str) else _NO
    raise AssertionError(f"no conversion for {option!r}")


def _type_name(hint: Any) -> str:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    names = []
    for option in options:
        if typing.get_origin(option) is Literal:
            names.append("one of " + ", ".join(map(str, typing.get_args(option))))
        elif option is type(None):
            names.append("none")
        else:
            names.append({int: "an integer", float: "a number", bool: "true/false", str: "a string"}[option])
    return " or ".join(names)
