"""Loading a JobConfig: YAML files (flat or nested by section), `key=value` words and flags, in that order.

Every key is read to its canonical name (`lr` and `optim.lr` -> `learning_rate`); a key of LLaMA-Factory or the HF
Trainer goes through their table (foreign.py); a built-in model shape gets the default job's values
(default_job.yaml) for the keys the job leaves out. Every problem of the whole config -- unreadable files,
duplicate YAML keys, unknown keys, refused foreign keys, values of the wrong type or out of range -- is collected
and raised at once (ConfigErrors, one line each); a bad value's line names the key as the user spelled it.
Nothing here imports torch: a config error costs well under a second.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lazytrain.config import foreign
from lazytrain.config.schema import KEYS, SECTION_OF, SECTIONS, JobConfig
from lazytrain.config.values import ConfigErrors, ConfigValueError, TooManyDigits, raise_all
from lazytrain.costmodel.model import BUILT_IN_SHAPES
from lazytrain.errors import LazyTrainError

# Older and alternative spellings of keys (the flags before the schema, torchtitan/LLaMA-Factory names).
ALIASES: dict[str, str] = {
    "model_name_or_path": "model", "corpus": "dataset", "seq_len": "cutoff_len",
    "batch_size": "per_device_train_batch_size", "lr": "learning_rate", "steps": "max_steps",
    "grad_accum": "gradient_accumulation_steps", "rule": "planner", "plan": "plan_file",
    "time_limit": "time_limit_s", "mip_gap": "mip_rel_gap", "gpu_mem_cap": "gpu_mem_cap_bytes",
    "cpu_act_budget": "cpu_act_bytes", "nvme_act_budget": "nvme_act_bytes", "cpu_mem": "cpu_mem_bytes",
}
DEFAULT_JOB_FILE = Path(__file__).with_name("default_job.yaml")
# A default-job value gives way when the job sets the key it would override (HF semantics: max_steps > 0 wins over
# num_train_epochs, warmup_steps over warmup_ratio; the schedule's kwargs belong to its type).
DEFAULT_JOB_GIVES_WAY = {"max_steps": "num_train_epochs", "warmup_steps": "warmup_ratio",
                         "lr_scheduler_kwargs": "lr_scheduler_type"}


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
    """Hints by string similarity, strict enough not to point at an unrelated key (foreign keys never get here)."""
    word = key.replace("-", "_")
    near = difflib.get_close_matches(word, valid, n=3, cutoff=0.75)
    best = difflib.SequenceMatcher(None, word, near[0]).ratio() if near else 0
    near = [n for n in near if difflib.SequenceMatcher(None, word, n).ratio() >= best - 0.03]  # ties: all of them
    hint = f"did you mean {' or '.join(map(repr, near))}?" if near else "see `lazytrain train --help` or docs/config.md"
    return LazyTrainError(f"{source}: unknown {what} {key!r}; {hint}")


class _Flat:
    """Flat canonical keys gathered from every source, with how each was spelled and every problem met."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.spellings: dict[str, str] = {}
        self.problems: list[LazyTrainError] = []
        self.notes: list[str] = []
        self.refusals: list[LazyTrainError] = []  # foreign keys refused (a subset of problems)
        self.methods: dict[str, LazyTrainError] = {}  # a method LazyTrain does not do (or "stage") -> its line
        self.origin: dict[str, str] = {}  # our key -> the foreign key whose translation set it

    def add(self, values: Mapping[str, Any], source: str, *, flags: bool = False) -> None:
        """A flat or nested mapping of one source (a later source wins key by key); a key given twice within one
        source is refused. `flags`: the keys are command-line flags (errors spell them `--key`)."""
        if not isinstance(values, Mapping):
            self.problems.append(LazyTrainError(f"{source}: expected a mapping of keys to values, got "
                                                f"{type(values).__name__}"))
            return
        items: list[tuple[str, Any]] = []
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, Mapping):  # nested by section (`model` is also a key)
                items += [(f"{key}.{inner}", inner_value) for inner, inner_value in value.items()]
            else:
                items.append((str(key), value))
        # what the job sets so far, for foreign keys that depend on others (eval_strategy on eval_steps, ...)
        given = {**self.values, **{k.rpartition(".")[2].replace("-", "_"): v for k, v in items}}
        mine: dict[str, Any] = {}
        for key, value in items:
            for name, converted, spelled, origin in self._canonical(key, value, source, given, flags):
                if name in mine:
                    self.problems.append(LazyTrainError(f"{source}: {name} is given twice ({spelled!r} and an "
                                                        "earlier spelling); keep one"))
                    continue
                mine[name] = converted
                self.spellings[name] = spelled
                if origin:
                    self.origin[name] = origin
        for name, value in foreign.precision(given).items():
            mine.setdefault(name, value)
        # a foreign key given again (`deepspeed=null` on the command line) replaces what it set before
        again = {key.rpartition(".")[2].replace("-", "_") for key, _ in items}
        for name in [n for n, origin in self.origin.items() if origin in again and n not in mine]:
            self.values.pop(name, None)
            del self.origin[name]
        self.values.update(mine)

    def _canonical(self, key: str, value: Any, source: str, given: Mapping[str, Any], flags: bool
                   ) -> list[tuple[str, Any, str, str | None]]:
        """[(our key, value, as spelled, the foreign key it came from or None)] for one key as written: ours, an
        alias, or a foreign key's translation."""
        bare = key.strip().replace("-", "_").rpartition(".")[2]
        spelled = key if not flags else f"--{key.replace('_', '-')}"
        self.notes = [n for n in self.notes if not n.startswith(f"{bare}: ")]  # given again: its new value speaks
        try:
            translated = foreign.translate(bare, value, given) if bare not in SECTION_OF or bare in foreign.TABLE \
                else None
        except foreign.Refused as err:
            origin = foreign.TABLE[bare].source if bare in foreign.TABLE else foreign.OTHER_KEYS[bare]
            origin = {foreign.LF: "a LLaMA-Factory", foreign.HF: "an HF Trainer"}.get(origin,
                                                                                       "a LLaMA-Factory and HF Trainer")
            problem = LazyTrainError(f"{source}: {bare} = {value!r} ({origin} key): {err}")
            if err.method is not None:
                self.methods.setdefault("stage" if bare == "stage" else err.method, LazyTrainError(
                    f"{source}: {bare} = {value!r} asks for {err.method}, which LazyTrain does not do: {err}"))
            self.problems.append(problem)
            self.refusals.append(problem)
            return []
        if translated is not None:
            ours, note = translated
            if note:
                self.notes.append(f"{bare}: {note}")
            return [(name, v, spelled, bare) for name, v in ours.items()]
        try:
            return [(canonical_key(key, source), value, spelled, None)]
        except LazyTrainError as err:
            self.problems.append(err)
            return []

    def method_problems(self) -> list[LazyTrainError]:
        """When the config asks for a training method LazyTrain does not do, that one line (the stage's first: a
        DPO run on images is refused as DPO) and the problems that are no foreign key's: the method's own
        settings, and what they make of the rest, would only bury it."""
        if not self.methods:
            return []
        first = self.methods.get("stage") or next(iter(self.methods.values()))
        return [first, *(p for p in self.problems if p not in self.refusals)]


# =====================================================================================================
# YAML files: duplicate keys refused, an integer too long to parse named
# =====================================================================================================
class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that records duplicate keys (PyYAML keeps the last silently) and integers too long for
    Python to parse (it raises ValueError beyond 4300 digits) instead of failing on them."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[str, int]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                self.duplicates.append((key, key_node.start_mark.line + 1))
            if isinstance(key, str):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(node.value)
        digits = sum(c.isdigit() for c in text)
        if digits > 30:
            return TooManyDigits(digits)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping; an unreadable or malformed one, or one with a key given twice,
    is refused (every duplicate named with its line)."""
    data, duplicates = _read_yaml(Path(path))
    raise_all(duplicates)
    return data


def _read_yaml(path: Path) -> tuple[dict[str, Any], list[LazyTrainError]]:
    """The mapping (the last of duplicate keys kept, so the file's other problems can still be found) and one
    problem per duplicate key."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else "not UTF-8 text"
        raise LazyTrainError(f"config file {path}: cannot read it ({reason})") from None
    loader = None
    try:
        loader = _Loader(text)  # (its reader already refuses control characters, a NUL byte)
        data = loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        if isinstance(err, yaml.reader.ReaderError):
            where = f" (control character #x{err.character:04x} at character {err.position})"
        raise LazyTrainError(f"config file {path}: not valid YAML{where}; fix the file") from None
    finally:
        if loader is not None:
            loader.dispose()
    duplicates = [LazyTrainError(f"config file {path}: {key!r} is given twice (again at line {line}); YAML would keep "
                                 "the last silently: keep one") for key, line in loader.duplicates]
    if data is None:
        return {}, duplicates
    if not isinstance(data, dict):
        raise LazyTrainError(f"config file {path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data, duplicates


def parse_override(word: str) -> tuple[str, Any]:
    """`learning_rate=1e-5` -> ("learning_rate", "1e-5"); the value stays text (the schema converts it)."""
    key, sep, value = word.partition("=")
    if not sep or not key.strip():
        raise LazyTrainError(f"{word!r}: expected key=value (e.g. learning_rate=1e-5) or a .yaml config file")
    return key.strip(), value.strip()


# =====================================================================================================
# the job
# =====================================================================================================
def load_job_config(*sources: str | Path | Mapping[str, Any], overrides: Sequence[str] = (),
                    flags: Mapping[str, Any] | None = None, notes: list[str] | None = None) -> JobConfig:
    """The JobConfig from YAML files or mappings (in order), then `key=value` overrides, then flags
    ({flag as typed, e.g. `--lr`: value}). Every problem is raised at once; a bad value's line names the key as
    the user spelled it. `notes`: collects the lines foreign keys accepted without effect ask to print."""
    flat = _Flat()
    for source in sources:
        if isinstance(source, Mapping):
            flat.add(source, "config")
            continue
        try:
            data, duplicates = _read_yaml(Path(source))
        except LazyTrainError as err:
            flat.problems.append(err)
            continue
        flat.problems += duplicates
        flat.add(data, f"config file {source}")
    words: dict[str, Any] = {}
    for word in overrides:
        try:
            key, value = parse_override(word)
        except LazyTrainError as err:
            flat.problems.append(err)
            continue
        words[key] = value
    flat.add(words, "override")
    flat.add({flag.removeprefix("--").replace("-", "_"): v for flag, v in (flags or {}).items()}, "flags",
             flags=True)
    raise_all(flat.method_problems())
    values = with_default_job(flat.values)
    try:
        job = JobConfig.build(values)
    except ConfigErrors as err:
        flat.problems += [_spelled(p, flat.spellings) for p in err.problems]
        job = None
    except LazyTrainError as err:
        flat.problems.append(_spelled(err, flat.spellings))
        job = None
    raise_all(flat.problems)
    assert job is not None
    if notes is not None:  # each once (a key given in several sources notes the same)
        unused = job.finetune.ignored()  # another finetuning type's keys: ignored, as LLaMA-Factory does
        if unused:
            flat.notes.append(f"finetuning_type {job.finetune.finetuning_type} leaves {', '.join(unused)} unused")
        notes += [note for note in dict.fromkeys(flat.notes) if note not in notes]
    return job


def with_default_job(values: Mapping[str, Any]) -> dict[str, Any]:
    """The job's values, plus the default job's tuned ones (default_job.yaml) for the keys it leaves out when its
    model is a built-in shape; any other model keeps the schema's (the HF Trainer's) defaults."""
    model = values.get("model", SECTIONS["model"]().model)
    if model not in BUILT_IN_SHAPES:
        return dict(values)
    default_job = yaml.safe_load(DEFAULT_JOB_FILE.read_text())
    merged = dict(values)
    for key, value in default_job.items():
        if key not in values and DEFAULT_JOB_GIVES_WAY.get(key) not in values:
            merged[key] = value
    return merged


def _spelled(problem: LazyTrainError, spellings: Mapping[str, str]) -> LazyTrainError:
    if isinstance(problem, ConfigValueError):
        return problem.spelled(spellings.get(problem.key, problem.key))
    return problem


def job_config_from_dict(values: Mapping[str, Any], source: str = "config") -> JobConfig:
    """From a flat (`learning_rate: 1e-5`) or nested (`optim: {learning_rate: 1e-5}`) mapping, or a mix, as
    written to train_config.json (every key there, so the default job adds nothing)."""
    return load_job_config(values)
