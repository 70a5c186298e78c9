"""What a dataset name means: a local file or folder, an entry of LLaMA-Factory's `dataset_info.json`, or a dataset
already in the local HF datasets cache. Pure Python (json, pathlib): `lazytrain train` resolves every name here,
before torch or datasets is imported, and refuses a name that means nothing in one line.

`dataset_info.json` (LLaMA-Factory's registry, in `dataset_dir`): each entry has `file_name` (a file or folder
relative to `dataset_dir`) or `hf_hub_url` (a dataset id, read from the local HF cache), `formatting`
(alpaca, default; sharegpt; openai = messages), `columns` (the rows' column for each role: alpaca's `prompt`,
`query`, `response`, `history`, `system`; sharegpt's `messages`, `system`), `tags` (sharegpt's role and content
keys and the role names: `role_tag`, `content_tag`, `user_tag`, `assistant_tag`, `system_tag`, ...), `split`,
`subset` and `num_samples` (rows drawn at random). Entries for what LazyTrain does not train on (`ranking`
pairs, images, videos, audios, tools, `script_url`, `ms_hub_url` alone) are refused by name. A `file_name` stays
inside `dataset_dir` (no `..`, not absolute), and every local path is a regular file or a folder: a FIFO, socket or
device is refused before anything opens it (a FIFO's open() waits for a writer forever).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError

DATASET_INFO = "dataset_info.json"
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
FORMATTING = {"alpaca": "alpaca", "sharegpt": "sharegpt", "openai": "messages"}  # LF's name -> our dataset_format
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
_NOT_TRAINED = ("images", "videos", "audios", "tools", "chosen", "rejected", "kto_tag")


@dataclass(frozen=True)
class Source:
    """One dataset to read: a local `path` (file or save_to_disk folder) or a `hub_id` of the HF cache, with how its
    rows are laid out (`formatting` None = detected from the columns) and LLaMA-Factory's column and tag names."""

    name: str  # as the user named it
    path: Path | None = None
    hub_id: str | None = None
    subset: str | None = None
    split: str = "train"
    formatting: str | None = None  # alpaca, sharegpt, messages, prompt_completion, text; None = auto
    columns: dict[str, str | None] = field(default_factory=dict)
    tags: dict[str, str | None] = field(default_factory=dict)
    num_samples: int | None = None

    def describe(self) -> dict[str, Any]:
        """What identifies the rows this source gives (for the tokenized cache's key)."""
        where: dict[str, Any] = {"hub_id": self.hub_id, "subset": self.subset, "split": self.split}
        if self.path is not None:
            stat = self.path.stat()
            files = sorted(self.path.rglob("*")) if self.path.is_dir() else [self.path]
            where = {"path": str(self.path.resolve()), "files": [
                (str(f.relative_to(self.path)) if self.path.is_dir() else f.name, f.stat().st_size,
                 f.stat().st_mtime_ns) for f in files if f.is_file()], "mtime": stat.st_mtime_ns}
        return {**where, "formatting": self.formatting, "columns": self.columns, "tags": self.tags,
                "num_samples": self.num_samples}


BUILT_IN = ("math", "stdlib", "zen")


def check_names(dataset: str, eval_dataset: str | None, dataset_dir: str) -> None:
    """Every name of `dataset` and `eval_dataset` means something (the cheapest check, and the root cause when it
    fails: later checks of the model and tokenizer they would be read with would name a symptom instead)."""
    for key, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        if value is None:
            continue
        names = tuple(n.strip() for n in value.split(",") if n.strip())
        single = [n for n in names if n in BUILT_IN or n.endswith(".txt")]
        if single and len(names) > 1:
            raise LazyTrainError(f"{key} {value}: {single[0]} is a dataset of its own (math, stdlib, zen and .txt "
                                 "corpora are not mixed); list SFT datasets only")
        if not single and (missing := uncached(resolve(names, dataset_dir, key))):
            command = f"python -c \"import datasets; datasets.load_dataset('{missing[0]}')\""
            raise LazyTrainError(f"{key} {missing[0]} is not in the local HF datasets cache; nothing is downloaded "
                                 f"during a run: download it once with {command}")
        if single and single[0].endswith(".txt"):
            check_file_or_folder(Path(single[0]), key)


def check_file_or_folder(path: Path, key: str = "dataset") -> None:
    """`path`, when it exists, is a regular file or a folder (after symlinks): anything else is refused before it is
    opened (a FIFO blocks open() until a writer comes, a device reads forever)."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing or unreadable: the reader says so in its own words
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device" if (
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else "special file"
        raise LazyTrainError(f"{key} {path} is not a regular file or folder (a {kind}); name a dataset file or "
                             "folder, or copy the data into one")


def uncached(sources: list[Source]) -> list[str]:
    """The hub ids among `sources` with no folder in the local HF caches (datasets' `owner___name`, the hub's
    `datasets--owner--name`): read from disk, without importing datasets, so the first pass can name them."""
    home = _hf_home()
    roots = {Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser(): "{}___{}",
             Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser(): "datasets--{}--{}"}
    missing = []
    for source in sources:
        if source.hub_id is None or source.hub_id.count("/") != 1:
            continue
        owner, name = source.hub_id.split("/")
        if not any((root / pattern.format(owner, name)).is_dir() for root, pattern in roots.items()):
            missing.append(source.hub_id)
    return missing


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()


def registry_dir(dataset_dir: str) -> Path:
    """`dataset_dir`; LF's `REMOTE:owner/name` (a dataset repository holding dataset_info.json) is its snapshot in
    the local HF hub cache, the newest: nothing is downloaded during a run."""
    if not dataset_dir.startswith("REMOTE:"):
        return Path(dataset_dir)
    repo = dataset_dir.removeprefix("REMOTE:").strip("/")
    hub = Path(os.environ.get("HF_HUB_CACHE", _hf_home() / "hub")).expanduser()
    snapshots = sorted((hub / f"datasets--{repo.replace('/', '--')}" / "snapshots").glob("*/"),
                       key=lambda p: p.stat().st_mtime)
    if not snapshots:
        raise LazyTrainError(f"dataset_dir {dataset_dir}: {repo} is not in the local HF hub cache ({hub}); nothing is "
                             f"downloaded during a run: download it once with hf download {repo} --repo-type dataset, "
                             "or set dataset_dir to a local folder")
    return snapshots[-1]


def resolve(names: tuple[str, ...], dataset_dir: str, key: str = "dataset") -> list[Source]:
    """Each name as a Source: an existing path first, then a `dataset_info.json` entry, then an id for the HF
    cache (a name of the form `owner/name` or one that is none of the others; whether it is cached is known only
    when it is read). A name that can be none of them is refused naming what was looked for."""
    dataset_dir = str(registry_dir(dataset_dir))
    info = _dataset_info(Path(dataset_dir))
    sources = []
    for name in names:
        path = Path(name)
        if path.is_dir() and _is_registry(path):
            listed = ", ".join(sorted(_dataset_info(path) or {})[:4])
            raise LazyTrainError(f"{key} {name} is a LLaMA-Factory data folder (its dataset_info.json names "
                                 f"datasets, e.g. {listed}); set dataset_dir: {name} and {key} to names in it")
        if path.exists():
            check_file_or_folder(path, key)
            sources.append(Source(name=name, path=path))
        elif info is not None and name in info:
            sources.append(_entry(name, info[name], Path(dataset_dir), key))
        elif _looks_like_a_hub_id(name):
            sources.append(Source(name=name, hub_id=name))
        else:
            where = f"nor a name in {Path(dataset_dir) / DATASET_INFO}" if info is not None else (
                f"and {Path(dataset_dir) / DATASET_INFO} does not exist (set dataset_dir)")
            raise LazyTrainError(f"{key} {name}: no such file or folder, {where}; set {key} to a json, jsonl, "
                                 f"parquet or arrow file, a save_to_disk folder, a dataset_info.json name, an HF "
                                 f"dataset id in the local cache (owner/name), or one of {', '.join(BUILT_IN)}")
    return sources


def _is_registry(folder: Path) -> bool:
    """A folder whose dataset_info.json is LLaMA-Factory's registry (not one written by save_to_disk)."""
    if (folder / "state.json").exists() or (folder / "dataset_dict.json").exists():
        return False
    try:
        info = _dataset_info(folder)
    except LazyTrainError:
        return False
    return bool(info) and all(isinstance(v, dict) and ({"file_name", "hf_hub_url", "script_url", "ms_hub_url",
                                                         "om_hub_url", "cloud_file_name"} & set(v))
                              for v in info.values())


def _looks_like_a_hub_id(name: str) -> bool:
    """`owner/name` (one slash, no file suffix): what a hub id looks like; a path that does not exist is refused."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.endswith(FILE_SUFFIXES) and not name.startswith((".", "~"))


def _dataset_info(dataset_dir: Path) -> dict[str, Any] | None:
    path = dataset_dir / DATASET_INFO
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LazyTrainError(f"{path}: cannot be read as JSON ({str(err).splitlines()[0]}); fix the file") from None
    if not isinstance(info, dict):
        raise LazyTrainError(f"{path}: expected an object of dataset names, got {type(info).__name__}")
    return info


def _entry(name: str, entry: Any, dataset_dir: Path, key: str) -> Source:
    """A dataset_info.json entry as a Source; what LazyTrain does not train on is refused by name."""
    where = f"{dataset_dir / DATASET_INFO} entry {name!r}"
    if not isinstance(entry, dict):
        raise LazyTrainError(f"{where}: expected an object, got {type(entry).__name__}")
    if entry.get("ranking"):
        raise LazyTrainError(f"{where}: ranking (preference) data is for reward modelling / DPO, which LazyTrain "
                             "does not implement; use an SFT dataset")
    columns = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise LazyTrainError(f"{where}: columns and tags must be objects")
    media = [c for c in _NOT_TRAINED if columns.get(c)]
    if media:
        raise LazyTrainError(f"{where}: its {', '.join(media)} columns are not trained by LazyTrain (text SFT only); "
                             "use a dataset without them")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTING:
        raise LazyTrainError(f"{where}: formatting {formatting!r}; expected one of {', '.join(FORMATTING)}")
    defaults = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    unknown = sorted(set(columns) - set(defaults))
    if unknown:
        raise LazyTrainError(f"{where}: unknown {formatting} column role(s) {', '.join(unknown)}; expected "
                             f"{', '.join(defaults)}")
    if formatting == "alpaca" and tags:
        raise LazyTrainError(f"{where}: tags are for sharegpt formatting; remove them")
    unknown = sorted(set(tags) - set(SHAREGPT_TAGS))
    if unknown:
        raise LazyTrainError(f"{where}: unknown tag(s) {', '.join(unknown)}; expected {', '.join(SHAREGPT_TAGS)}")
    num_samples = entry.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or isinstance(num_samples, bool)
                                    or not 1 <= num_samples <= 2**40):
        raise LazyTrainError(f"{where}: num_samples {num_samples!r}; expected an integer >= 1")
    common = dict(name=name, formatting=FORMATTING[formatting], columns={**defaults, **columns},
                  tags={**SHAREGPT_TAGS, **tags} if formatting != "alpaca" else {},
                  split=str(entry.get("split", "train")), subset=entry.get("subset"), num_samples=num_samples)
    if "file_name" in entry:
        file_name = Path(str(entry["file_name"]))
        if file_name.is_absolute() or ".." in file_name.parts:
            raise LazyTrainError(f"{where}: file_name {entry['file_name']} is outside {dataset_dir}; file names are "
                                 "relative to dataset_dir and stay in it: move the file there")
        path = dataset_dir / file_name
        check_file_or_folder(path, f"{where}: file_name")
        if not path.exists():
            raise LazyTrainError(f"{where}: file_name {entry['file_name']} is not in {dataset_dir}; put the file "
                                 "there or fix file_name")
        return Source(path=path, **common)
    if "hf_hub_url" in entry:
        return Source(hub_id=str(entry["hf_hub_url"]), **common)
    raise LazyTrainError(f"{where}: LazyTrain reads file_name (a local file) or hf_hub_url (a dataset in the local HF "
                         "cache); script_url, ms_hub_url, om_hub_url and cloud_file_name are not read")
