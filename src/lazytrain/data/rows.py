"""Reading a dataset's rows and checking each one before anything else sees it: one error boundary per input kind.

Files are read here, not by pyarrow's JSON reader: a jsonl line that is not UTF-8, not JSON or not an object (a
`null` line crashed pyarrow with SIGSEGV) is refused in one line naming the file and the line; parquet, arrow and
`save_to_disk` folders come typed from pyarrow / datasets (memory-mapped, no cache folder written); a hub id is read
from the local HF datasets cache only. Nothing is written to the system temp dir.

Every row is then checked against its format and turned into one canonical row (`CANONICAL` columns, the same
types for every format and dataset), so that several datasets concatenate and pyarrow only ever sees one schema:
- `alpaca`: instruction (+ input), output, optional system and history ([instruction, response] pairs);
- `sharegpt`: a list of {from, value} turns (human / gpt / system; LLaMA-Factory's tags rename them);
- `messages`: a list of {role, content} (system, user, assistant; OpenAI / TRL);
- `prompt_completion`: prompt and completion, both strings (no template) or both lists of messages;
- `text`: plain language modelling.
A row of the wrong shape (`"history": "x"`, a turn that is a string) is a one-line error naming the row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lazytrain.data.sources import Source
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    import datasets

FORMATS: tuple[str, ...] = ("alpaca", "sharegpt", "messages", "prompt_completion", "text")
Row = dict[str, Any]
Message = dict[str, str]
# One schema for every format: kind chat (messages through the chat template), text (every token trained) or
# completion (prompt + completion strings, the loss on the completion).
CANONICAL = ("kind", "messages", "text", "prompt", "completion")
ROLES = ("system", "user", "assistant")
MAX_ERROR_VALUE = 80
# A jsonl line is read up to this many bytes: 64 MiB of text is millions of tokens, far beyond any cutoff_len, and
# a file without line breaks is refused after reading this much, not after holding all of it (twice, decoded).
MAX_LINE_BYTES = 64 << 20


# =====================================================================================================
# reading
# =====================================================================================================
def read_rows(source: Source, *, max_samples: int | None = None, seed: int = 0) -> list[Row]:
    """The raw rows of one source (dicts), LLaMA-Factory's num_samples drawn at random and max_samples cut (the
    first rows, as LLaMA-Factory takes them)."""
    if source.hub_id is not None:
        rows = _hub_rows(source)
    else:
        assert source.path is not None
        rows = _path_rows(source.path, source.split)
    if not rows:
        raise LazyTrainError(f"dataset {source.name} has no rows; it needs at least one")
    if source.num_samples is not None:
        import numpy as np  # numpy is light; it is here only for this draw

        rng = np.random.default_rng([seed, 2])
        order = rng.permutation(len(rows)).tolist()
        while len(order) < source.num_samples:  # more than there are: repeat rows at random, as LLaMA-Factory
            order += rng.choice(len(rows), size=min(len(rows), source.num_samples - len(order))).tolist()
        rows = [rows[i] for i in order[:source.num_samples]]
    return rows[:max_samples] if max_samples is not None else rows


def _path_rows(path: Path, split: str) -> list[Row]:
    if path.is_dir():
        return _saved_rows(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or (suffix == ".json" and _first_char(path) == "{"):
        return _jsonl_rows(path)
    if suffix == ".json":
        return _json_rows(path)
    if suffix in (".parquet", ".arrow"):
        return _table_rows(path)
    if suffix == ".txt":
        return _txt_rows(path)
    raise LazyTrainError(f"dataset file {path}: unknown extension {path.suffix!r}; use .json, .jsonl, .parquet, "
                         ".arrow or .txt (or a save_to_disk folder)")


def _txt_rows(path: Path) -> list[Row]:
    """One document a line, as datasets' text loader reads a LLaMA-Factory .txt dataset (blank lines skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise LazyTrainError(f"dataset file {path}: not UTF-8 text (byte {err.start}); save the file as "
                             "UTF-8") from None
    return [{"text": line} for line in lines if line.strip()]


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head[:1].decode("latin-1")


def _jsonl_rows(path: Path) -> list[Row]:
    """One JSON object a line (a .json file whose text starts with `{` is read the same way: JSON lines)."""
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise LazyTrainError(f"dataset file {path} line {number} is longer than {MAX_LINE_BYTES} bytes (no "
                                     "line break within them); each line must be one JSON object of at most that")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise LazyTrainError(f"dataset file {path} line {number}: not UTF-8 text (byte {err.start}); save "
                                     "the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise LazyTrainError(f"dataset file {path} line {number}: not JSON ({err.msg}); each line must be "
                                     "one JSON object") from None
            if not isinstance(row, dict):
                raise LazyTrainError(f"dataset file {path} line {number}: {_shown(row)} is not a JSON object; each "
                                     "line must be one object of columns")
            rows.append(row)
    return rows


def _json_rows(path: Path) -> list[Row]:
    """A JSON array of objects (LLaMA-Factory's files)."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise LazyTrainError(f"dataset file {path}: not UTF-8 text (byte {err.start}); save the file as UTF-8"
                             ) from None
    except json.JSONDecodeError as err:
        raise LazyTrainError(f"dataset file {path}: not JSON ({err.msg} at line {err.lineno}); expected an array of "
                             "objects, or one object a line (.jsonl)") from None
    if not isinstance(data, list):
        raise LazyTrainError(f"dataset file {path}: expected an array of objects, got {type(data).__name__}")
    for number, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise LazyTrainError(f"dataset file {path} row {number}: {_shown(row)} is not an object; every row must "
                                 "be an object of columns")
    return data


def _table_rows(path: Path) -> list[Row]:
    """A parquet file or an arrow file (datasets' own format), memory-mapped: typed columns, no cache written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            table = pq.read_table(path)
        else:
            with pa.memory_map(str(path)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowException) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise LazyTrainError(f"dataset file {path} cannot be read as {path.suffix[1:]}: {reason}") from None
    return table.to_pylist()


def _saved_rows(path: Path, split: str) -> list[Row]:
    """A folder written by datasets' save_to_disk (a Dataset, or a DatasetDict: `split`, else its first split)."""
    if not any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
        raise LazyTrainError(f"dataset {path} is a folder but not one written by datasets' save_to_disk (no "
                             "dataset_info.json, dataset_dict.json or state.json); set dataset to a json, jsonl, "
                             "parquet or arrow file, or such a folder")
    import datasets

    try:
        table = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as err:
        raise LazyTrainError(f"dataset {path}: cannot be read by datasets.load_from_disk ({_first_line(err)})"
                             ) from None
    if isinstance(table, datasets.DatasetDict):
        table = table[split] if split in table else next(iter(table.values()))
    return table.to_list()


def _hub_rows(source: Source) -> list[Row]:
    """A dataset id from the local HF datasets cache alone (offline: nothing is downloaded)."""
    import datasets

    table = _cached_hub_dataset(datasets, source)
    return table.to_list()


def _cached_hub_dataset(datasets: Any, source: Source) -> datasets.Dataset:
    """datasets in offline mode for this one call (environment and its config flags restored after)."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    previous = [os.environ.get(n) for n in names], [getattr(datasets.config, n) for n in names]
    for name in names:
        os.environ[name] = "1"
        setattr(datasets.config, name, True)
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # not its "using the latest cached version" warnings
    try:
        return datasets.load_dataset(source.hub_id, source.subset, split=source.split)
    except Exception:  # noqa: BLE001 - offline misses raise many types; each means "not in the cache"
        command = f"python -c \"import datasets; datasets.load_dataset('{source.hub_id}')\""
        raise LazyTrainError(f"dataset {source.name}: {source.hub_id} is not in the local HF datasets cache "
                             f"({datasets.config.HF_DATASETS_CACHE}); nothing is downloaded during a run: download it "
                             f"once with {command}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        for name, env, flag in zip(names, *previous, strict=True):
            setattr(datasets.config, name, flag)
            if env is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = env


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= MAX_ERROR_VALUE else text[:MAX_ERROR_VALUE - 3] + "..."


# =====================================================================================================
# checking and turning rows into canonical rows
# =====================================================================================================
def detect_format(rows: Sequence[Row]) -> str:
    """The format of rows from their columns (and, for a list of turns, the turns' keys)."""
    columns = set(rows[0])
    for name in ("messages", "conversations"):
        turns = rows[0].get(name)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            if {"role", "content"} <= set(turns[0]):
                return "messages"
            if {"from", "value"} <= set(turns[0]):
                return "sharegpt"
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise LazyTrainError(
        f"cannot tell the dataset format from its columns ({', '.join(sorted(columns))}); expected instruction+output "
        "(alpaca), conversations (sharegpt), messages, prompt+completion or text; set dataset_format"
    )


def canonical_rows(rows: Sequence[Row], source: Source, dataset_format: str) -> tuple[list[Row], str]:
    """Every row checked and turned into a canonical row; the format used (the source's, the config's, or the one
    the columns say). A row that does not fit the format is refused naming the row and what is wrong."""
    if dataset_format == "text" and source.formatting == "alpaca":  # LF's stage pt: the prompt (+ query) column
        fmt = "text"
    else:
        fmt = source.formatting or (detect_format(rows) if dataset_format == "auto" else dataset_format)
    if fmt not in FORMATS:
        raise LazyTrainError(f"unknown dataset_format {fmt!r}; use auto or one of {', '.join(FORMATS)}")
    _check_columns(rows[0], fmt, source)
    convert = {"alpaca": _alpaca, "sharegpt": _sharegpt, "messages": _messages, "prompt_completion": _completion,
               "text": _text_row}[fmt]
    out = []
    for number, row in enumerate(rows, start=1):
        try:
            out.append(convert(row, source))
        except _BadRow as err:
            raise LazyTrainError(f"dataset {source.name} row {number} ({fmt}): {err}") from None
    return out, fmt


class _BadRow(Exception):
    """What is wrong with one row (the caller names the dataset and the row)."""


def _check_columns(row: Row, fmt: str, source: Source) -> None:
    cols = source.columns
    if fmt == "alpaca" or (fmt == "text" and source.formatting == "alpaca"):
        need = [cols.get("prompt") or "instruction"]
    elif fmt in ("sharegpt", "messages"):
        need = [cols["messages"]] if "messages" in cols else []
        if not need and not ({"messages", "conversations"} & set(row)):
            need = ["messages or conversations"]
    elif fmt == "prompt_completion":
        need = ["prompt", "completion"]
    else:
        need = ["text"]
    missing = [c for c in need if c not in row]
    if missing:
        raise LazyTrainError(f"dataset {source.name}: format {fmt} needs the column(s) {', '.join(map(str, missing))}, "
                             f"but the rows have {', '.join(sorted(row)) or 'none'}; set dataset_format (or the "
                             "dataset_info.json columns)")


def _string(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _BadRow(f"{what} is {_shown(value)}, expected a string")
    return value


def _chat(messages: list[Message]) -> Row:
    return {"kind": "chat", "messages": messages, "text": "", "prompt": "", "completion": ""}


def _alpaca(row: Row, source: Source) -> Row:
    cols = {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
            "system": "system", **{k: v for k, v in source.columns.items() if v is not None}}
    system = _string(row.get(cols["system"]), cols["system"])
    messages = [{"role": "system", "content": system}] if system else []
    history = row.get(cols["history"])
    if history is not None:
        if not isinstance(history, list):
            raise _BadRow(f"{cols['history']} is {_shown(history)}, expected a list of [instruction, response] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise _BadRow(f"{cols['history']}[{i}] is {_shown(pair)}, expected [instruction, response] (two "
                              "strings)")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = _string(row.get(cols["prompt"]), cols["prompt"])
    query = _string(row.get(cols["query"]), cols["query"])
    messages.append({"role": "user", "content": "\n".join(part for part in (prompt, query) if part)})
    response = row.get(cols["response"])
    if response is not None:  # a row without a response has nothing to learn: skipped when tokenized
        messages.append({"role": "assistant", "content": _string(response, cols["response"])})
    return _chat(messages)


def _turns(row: Row, source: Source, default_key: str) -> list[Any]:
    key = source.columns.get("messages") or next((k for k in ("messages", "conversations") if row.get(k) is not None),
                                                 default_key)
    turns = row.get(key)
    if not isinstance(turns, list):
        raise _BadRow(f"{key} is {_shown(turns)}, expected a list of turns")
    return turns


def _sharegpt(row: Row, source: Source) -> Row:
    tags = source.tags or {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                           "observation_tag": "observation", "function_tag": "function_call",
                           "system_tag": "system"}
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system",
             "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    tools = {tags.get("observation_tag"), tags.get("function_tag")} - {None}
    system_column = source.columns.get("system") or "system"
    system = _string(row.get(system_column), system_column)
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(_turns(row, source, "conversations")):
        if not isinstance(turn, dict):
            raise _BadRow(f"turn {i + 1} is {_shown(turn)}, expected an object with {role_tag} and {content_tag}")
        tag = turn.get(role_tag)
        if tag in tools:
            raise _BadRow(f"turn {i + 1} is a tool turn ({role_tag} {tag!r}); LazyTrain trains on conversations of "
                          "system, user and assistant turns")
        if tag not in roles:
            raise _BadRow(f"turn {i + 1} has {role_tag} {_shown(tag)}; expected one of {', '.join(map(str, roles))}")
        messages.append({"role": roles[tag], "content": _string(turn.get(content_tag), f"turn {i + 1} {content_tag}")})
    return _chat(messages)


def _message_list(turns: Iterable[Any], what: str) -> list[Message]:
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRow(f"{what} turn {i + 1} is {_shown(turn)}, expected an object with role and content")
        role = turn.get("role")
        if role not in ROLES:
            raise _BadRow(f"{what} turn {i + 1} has role {_shown(role)}; expected one of {', '.join(ROLES)}")
        messages.append({"role": role, "content": _string(turn.get("content"), f"{what} turn {i + 1} content")})
    return messages


def _messages(row: Row, source: Source) -> Row:
    system_column = source.columns.get("system") or "system"
    system = _string(row.get(system_column), system_column)
    messages = [{"role": "system", "content": system}] if system else []
    return _chat(messages + _message_list(_turns(row, source, "messages"), "a"))


def _completion(row: Row, source: Source) -> Row:
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"kind": "completion", "messages": [], "text": "", "prompt": prompt, "completion": completion}
    if isinstance(prompt, list) and isinstance(completion, list):
        return _chat(_message_list(prompt, "prompt") + _message_list(completion, "completion"))
    raise _BadRow(f"prompt {_shown(prompt)} and completion {_shown(completion)} must both be strings or both lists "
                  "of messages")


def _text_row(row: Row, source: Source) -> Row:
    """A document: the `text` column, or a dataset_info.json entry's prompt (and query) column, joined by a newline
    as LF joins them."""
    if source.formatting == "alpaca":
        names = [source.columns.get("prompt") or "instruction", source.columns.get("query") or "input"]
        text = "\n".join(part for part in (_string(row.get(n), n) for n in names) if part)
    else:
        text = _string(row.get("text"), "text")
    return {"kind": "text", "messages": [], "text": text, "prompt": "", "completion": ""}
