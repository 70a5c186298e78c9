"""Loading a JobConfig: YAML files (flat or nested by section), `key=value` words and flags, in that order.

Every key is read to its canonical name (`lr` and `optim.lr` -> `learning_rate`); an unknown key is a one-line
error naming the nearest known one; a bad value's error names the key as the user spelled it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lazytrain.config.schema import KEYS, SECTION_OF, SECTIONS, JobConfig
from lazytrain.config.values import ConfigValueError
from lazytrain.errors import LazyTrainError

# Older and alternative spellings of keys (the flags before the schema, torchtitan/LLaMA-Factory names).
ALIASES: dict[str, str] = {
    "model_name_or_path": "model", "corpus": "dataset", "seq_len": "cutoff_len",
    "batch_size": "per_device_train_batch_size", "lr": "learning_rate", "steps": "max_steps",
    "grad_accum": "gradient_accumulation_steps", "rule": "planner", "plan": "plan_file",
    "time_limit": "time_limit_s", "mip_gap": "mip_rel_gap", "gpu_mem_cap": "gpu_mem_cap_bytes",
    "cpu_act_budget": "cpu_act_bytes", "nvme_act_budget": "nvme_act_bytes", "cpu_mem": "cpu_mem_bytes",
}


def canonical_key(key: str, source: str = "config") -> str:
    """`lr` -> `learning_rate`, `optim.lr` -> `learning_rate`; an unknown key is refused naming the nearest."""
    name = key.strip().replace("-", "_")
    section, _, rest = name.rpartition(".")
    if section and section not in SECTIONS:
        raise _unknown(section, list(SECTIONS), source, "section")
    name = ALIASES.get(rest, rest)
    if name not in SECTION_OF:
        raise _unknown(key, [*KEYS, *ALIASES], source, "key")
    if section and SECTION_OF[name] != section:
        raise LazyTrainError(f"{source}: {key!r}: {name} belongs to section {SECTION_OF[name]!r}, not {section!r}")
    return name


def _unknown(key: str, valid: Sequence[str], source: str, what: str) -> LazyTrainError:
    near = difflib.get_close_matches(key.replace("-", "_"), valid, n=1, cutoff=0.5)
    hint = f"did you mean {near[0]!r}?" if near else "see `lazytrain train --help` or docs/config.md"
    return LazyTrainError(f"{source}: unknown {what} {key!r}; {hint}")


def _flatten(values: Mapping[str, Any], source: str, spellings: dict[str, str] | None = None) -> dict[str, Any]:
    """Flat canonical keys from a flat or nested mapping; a key given twice (e.g. `lr` and `learning_rate`) is
    refused. `spellings` collects {canonical key: the key as written}."""
    if not isinstance(values, Mapping):
        raise LazyTrainError(f"{source}: expected a mapping of keys to values, got {type(values).__name__}")
    flat: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        name = canonical_key(str(key), source)
        if name in flat:
            raise LazyTrainError(f"{source}: {name} is given twice ({key!r} and an earlier spelling); keep one")
        flat[name] = value
        if spellings is not None:
            spellings[name] = str(key)

    for key, value in values.items():
        if key in SECTIONS and isinstance(value, Mapping):  # nested by section (`model` is also a key)
            for inner, inner_value in value.items():
                put(f"{key}.{inner}", inner_value)
        else:
            put(str(key), value)
    return flat



def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping; an unreadable or malformed one is a one-line error."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise LazyTrainError(f"config file {path}: cannot read it ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise LazyTrainError(f"config file {path}: not valid YAML{where}; fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LazyTrainError(f"config file {path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def parse_override(word: str) -> tuple[str, Any]:
    """`learning_rate=1e-5` -> ("learning_rate", "1e-5"); the value stays text (the schema converts it)."""
    key, sep, value = word.partition("=")
    if not sep or not key.strip():
        raise LazyTrainError(f"{word!r}: expected key=value (e.g. learning_rate=1e-5) or a .yaml config file")
    return canonical_key(key, "override"), value.strip()


def load_job_config(*sources: str | Path | Mapping[str, Any], overrides: Sequence[str] = (),
                    flags: Mapping[str, Any] | None = None) -> JobConfig:
    """The JobConfig from YAML files or mappings (in order), then `key=value` overrides, then flags
    ({flag as typed, e.g. `--lr`: value}). A bad value's error names the key as the user spelled it."""
    flat: dict[str, Any] = {}
    spellings: dict[str, str] = {}
    for source in sources:
        if isinstance(source, Mapping):
            flat.update(_flatten(source, "config", spellings))
        else:
            flat.update(_flatten(read_yaml(source), f"config file {source}", spellings))
    for word in overrides:
        key, value = parse_override(word)
        flat[key] = value
        spellings[key] = word.partition("=")[0].strip()
    flag_values = _flatten({flag.removeprefix("--"): v for flag, v in (flags or {}).items()}, "flags")
    flat.update(flag_values)
    spellings.update({canonical_key(flag.removeprefix("--")): flag for flag in flags or {}})
    try:
        return JobConfig.build(flat)
    except ConfigValueError as err:
        raise err.spelled(spellings.get(err.key, err.key)) from None


def job_config_from_dict(values: Mapping[str, Any], source: str = "config") -> JobConfig:
    """From a flat (`learning_rate: 1e-5`) or nested (`optim: {learning_rate: 1e-5}`) mapping, or a mix."""
    return JobConfig.build(_flatten(values, source))
