"""Supervised fine-tuning data: local files -> rows -> conversations -> tokenized `Example`s with response-only labels.

Formats (LLaMA-Factory's conventions; `auto` picks one from the columns):
- `alpaca`: `instruction`, `output`, optional `input` (appended to the instruction after a newline),
  `system` and `history` (earlier `[instruction, output]` pairs).
- `sharegpt`: `conversations` (or `messages`), a list of `{"from", "value"}` with `from` in human / gpt /
  system (also user / assistant); optional `system` column.
- `messages`: `messages` (or `conversations`), a list of `{"role", "content"}` (OpenAI / TRL).
- `prompt_completion`: `prompt`, `completion`; strings are joined as they are (no template, the loss on the
  completion), lists of messages go through the chat template.
- `text`: `text`, plain language modelling (every token carries loss).

A conversation is rendered with the tokenizer's chat template (`apply_chat_template`), or the named
`template` (templates.py), which wins when given. The assistant spans come from rendering prefixes: the text up
to an assistant turn (with the generation prompt) and the text through it; each piece is tokenized on its own,
as at inference time the prompt is. Labels are -100 everywhere but in assistant spans (their content and the
template's end-of-turn marker), unless `train_on_prompt`. EOS ends every example: an assistant turn that
already ends with the tokenizer's EOS keeps it (trailing whitespace after it is dropped), otherwise EOS is
appended. Examples longer than `cutoff_len` are truncated (counted); rows with no assistant turn, and
examples left with no loss-carrying token, are skipped (counted).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np

from lazytrain.data.loader import IGNORE_INDEX, Example
from lazytrain.data.templates import TEMPLATES
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMATS: tuple[str, ...] = ("alpaca", "sharegpt", "messages", "prompt_completion", "text")
Message = dict[str, str]
Row = dict[str, object]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


# ---- files ----------------------------------------------------------------------------------------
def load_rows(path: str | Path) -> list[Row]:
    """The rows of a local json / jsonl / parquet / arrow file (or a `save_to_disk` folder), via HF `datasets`."""
    path = Path(path)
    if path.is_dir():
        if not any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json")):
            raise LazyTrainError(f"dataset {path} is a folder but not one written by datasets' save_to_disk (no "
                                 "dataset_info.json or dataset_dict.json); set dataset to a json, jsonl, parquet or "
                                 "arrow file, or such a folder")
        table = datasets.load_from_disk(str(path), keep_in_memory=True)
        if isinstance(table, datasets.DatasetDict):
            table = table["train"] if "train" in table else next(iter(table.values()))
        return _non_empty(table.to_list(), path)
    if not path.is_file():
        raise LazyTrainError(f"dataset file {path} does not exist; set dataset to a json, jsonl, parquet or arrow "
                             "file (or a folder written by datasets' save_to_disk)")
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise LazyTrainError(f"dataset file {path}: unknown extension {path.suffix!r}; use one of "
                             f"{', '.join(FILE_BUILDERS)}")
    if not path.read_bytes().strip():
        raise LazyTrainError(f"dataset file {path} is empty; it needs at least one row")
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="lazytrain-datasets-") as cache_dir:  # leave no cache behind
        try:
            table = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir,
                                          keep_in_memory=True)
        except Exception as err:  # noqa: BLE001 - pyarrow/json raise many types; all mean "cannot parse this file"
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise LazyTrainError(f"dataset file {path} cannot be read as {builder}: {reason}") from None
        return _non_empty(table.to_list(), path)


def _non_empty(rows: list[Row], path: Path) -> list[Row]:
    if not rows:
        raise LazyTrainError(f"dataset file {path} has no rows; it needs at least one")
    return rows


# ---- formats ----------------------------------------------------------------------------------------
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


REQUIRED_COLUMNS = {"alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion"),
                    "text": ("text",)}


def _check_columns(rows: Sequence[Row], fmt: str) -> None:
    columns = set(rows[0])
    if fmt in ("sharegpt", "messages"):
        ok = bool(columns & {"messages", "conversations"})
        need = "messages or conversations"
    else:
        ok = set(REQUIRED_COLUMNS[fmt]) <= columns
        need = " and ".join(REQUIRED_COLUMNS[fmt])
    if not ok:
        raise LazyTrainError(f"dataset_format {fmt} needs the column(s) {need}, but the rows have "
                             f"{', '.join(sorted(columns))}; set dataset_format (or auto)")


def _text(value: object) -> str:
    return "" if value is None else str(value)  # a column missing from some rows of a file reads as None


def to_messages(row: Row, fmt: str) -> list[Message]:
    """A conversation from one row of a chat format (alpaca, sharegpt, messages, list-valued prompt_completion)."""
    if fmt == "alpaca":
        messages = [{"role": "system", "content": _text(row["system"])}] if row.get("system") else []
        for prompt, response in row.get("history") or []:
            messages += [{"role": "user", "content": _text(prompt)}, {"role": "assistant", "content": _text(response)}]
        instruction = _text(row["instruction"]) + (f"\n{row['input']}" if row.get("input") else "")
        messages.append({"role": "user", "content": instruction})
        if row["output"] is not None:  # a row without output has no response to learn: skipped
            messages.append({"role": "assistant", "content": _text(row["output"])})
        return messages
    if fmt == "prompt_completion":
        return [*row["prompt"], *row["completion"]]
    turns = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    if not isinstance(turns, list):
        raise LazyTrainError(f"a {fmt} row has no list of turns: {json.dumps(row, default=str)[:120]}")
    messages = [{"role": "system", "content": _text(row["system"])}] if row.get("system") else []
    for turn in turns:
        if fmt == "sharegpt":
            role = SHAREGPT_ROLES.get(str(turn.get("from")))
            if role is None:
                raise LazyTrainError(f"sharegpt turn with from={turn.get('from')!r}; expected one of "
                                     f"{', '.join(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": _text(turn.get("value"))})
        else:
            messages.append({"role": _text(turn.get("role")), "content": _text(turn.get("content"))})
    return messages


# ---- tokenization ---------------------------------------------------------------------------------
def use_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> None:
    """Give the tokenizer the named chat template (so checkpoints save it with the tokenizer), or check that it
    has its own."""
    if template is not None:
        if template not in TEMPLATES:
            raise LazyTrainError(f"unknown template {template!r}; use one of {', '.join(TEMPLATES)} or none to use "
                                 "the tokenizer's chat template")
        tokenizer.chat_template = TEMPLATES[template]
    elif not tokenizer.chat_template:
        raise LazyTrainError(f"the tokenizer has no chat template; set template to one of {', '.join(TEMPLATES)}")


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def conversation_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, is_assistant) pieces whose concatenation is the whole.

    An assistant piece is the turn as the template writes it after the generation prompt: its content and
    end-of-turn marker. Raises when the template is not prefix-stable (then no span can be told apart).
    """
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (prompt.startswith(done) and through.startswith(prompt)):
            raise LazyTrainError(
                "the chat template renders a conversation's beginning differently once it goes on (it is not "
                f"prefix-stable), so the assistant spans cannot be found; set template to one of {', '.join(TEMPLATES)}"
            )
        pieces += [(prompt[len(done):], False), (through[len(prompt):], True)]
        done = through
    if messages[-1]["role"] != "assistant":  # a trailing turn after the last response
        whole = _render(tokenizer, messages, generation_prompt=False)
        pieces.append((whole[len(done):], False))
    return [(text, is_assistant) for text, is_assistant in pieces if text]


@dataclass
class Layout:
    """One row as text pieces before tokenization (pieces are tokenized on their own, all rows in one batch)."""

    texts: list[str]
    trained: list[bool]  # per piece: its tokens carry loss
    templated: bool  # the chat template wrote the specials (BOS) itself; else the tokenizer adds them
    append_eos: bool  # the last piece does not already end with EOS


def layout_row(tokenizer: PreTrainedTokenizerBase, row: Row, fmt: str, *, train_on_prompt: bool) -> Layout | None:
    """The pieces of one row; None for a conversation with no assistant turn.

    Nothing after the last trained piece is kept (a template's trailing newline): EOS ends the example. When
    the last trained piece already ends with EOS (ChatML with EOS `<|im_end|>`), whitespace after it is dropped
    and no second EOS is appended.
    """
    if fmt == "text":
        pieces, templated = [(str(row["text"]), True)], False
    elif fmt == "prompt_completion" and isinstance(row["prompt"], str):
        pieces, templated = [(row["prompt"], False), (str(row["completion"]), True)], False
    else:
        messages = to_messages(row, fmt)
        if not any(m["role"] == "assistant" for m in messages):
            return None
        pieces, templated = conversation_pieces(tokenizer, messages), True
    last = max(i for i, (_, trained) in enumerate(pieces) if trained)
    texts = [text for text, _ in pieces[: last + 1]]
    trained = [trained or train_on_prompt for _, trained in pieces[: last + 1]]
    eos = tokenizer.eos_token
    ends_with_eos = bool(eos) and texts[-1].rstrip().endswith(eos)
    if ends_with_eos:
        texts[-1] = texts[-1].rstrip()
    return Layout(texts=texts, trained=trained, templated=templated, append_eos=not ends_with_eos)


def encode_layouts(tokenizer: PreTrainedTokenizerBase, layouts: Sequence[Layout]) -> list[Example]:
    """Tokenize every piece of every layout (two batched calls: with and without the tokenizer's specials)."""
    with_specials = [(r, 0) for r, lay in enumerate(layouts) if not lay.templated]
    plain = [(r, i) for r, lay in enumerate(layouts) for i in range(len(lay.texts))
             if lay.templated or i > 0]
    ids: dict[tuple[int, int], list[int]] = {}
    for keys, add_special_tokens in ((with_specials, True), (plain, False)):
        if keys:
            encoded = tokenizer([layouts[r].texts[i] for r, i in keys], add_special_tokens=add_special_tokens)
            ids.update(zip(keys, encoded["input_ids"], strict=True))
    examples = []
    for r, lay in enumerate(layouts):
        input_ids: list[int] = []
        labels: list[int] = []
        for i, trained in enumerate(lay.trained):
            input_ids += ids[r, i]
            labels += ids[r, i] if trained else [IGNORE_INDEX] * len(ids[r, i])
        if lay.append_eos:
            input_ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
        examples.append(Example(input_ids=input_ids, labels=labels))
    return examples


@dataclass
class SftData:
    """Tokenized examples and what happened on the way, for the trainer's log."""

    examples: list[Example]
    dataset_format: str
    num_rows: int
    num_truncated: int = 0  # examples cut to cutoff_len
    num_skipped: int = 0  # rows with no assistant turn, or no loss-carrying token left after truncation
    val: list[Example] = field(default_factory=list)  # held-out examples (val_size or an eval file)

    def summary(self) -> str:
        tokens = sum(len(ex.input_ids) for ex in self.examples)
        return (f"{self.dataset_format}: {len(self.examples):,} train / {len(self.val):,} held-out examples, "
                f"{tokens:,} train tokens; {self.num_truncated} truncated to cutoff_len, {self.num_skipped} skipped")


def tokenize_rows(rows: Sequence[Row], tokenizer: PreTrainedTokenizerBase, *, dataset_format: str = "auto",
                  template: str | None = None, train_on_prompt: bool = False, cutoff_len: int) -> SftData:
    """Rows of one format -> Examples of at most `cutoff_len` tokens, each with at least one loss token."""
    if not rows:
        raise LazyTrainError("the dataset has no rows; it needs at least one")
    fmt = detect_format(rows) if dataset_format == "auto" else dataset_format
    if fmt not in FORMATS:
        raise LazyTrainError(f"unknown dataset_format {fmt!r}; use auto or one of {', '.join(FORMATS)}")
    _check_columns(rows, fmt)
    needs_template = fmt in ("alpaca", "sharegpt", "messages") or (
        fmt == "prompt_completion" and not isinstance(rows[0]["prompt"], str))
    if needs_template:
        use_template(tokenizer, template)
    data = SftData(examples=[], dataset_format=fmt, num_rows=len(rows))
    layouts = [layout_row(tokenizer, row, fmt, train_on_prompt=train_on_prompt) for row in rows]
    data.num_skipped = sum(lay is None for lay in layouts)
    for example in encode_layouts(tokenizer, [lay for lay in layouts if lay is not None]):
        if len(example.input_ids) > cutoff_len:
            data.num_truncated += 1
            example = Example(example.input_ids[:cutoff_len], example.labels[:cutoff_len])
        if all(label == IGNORE_INDEX for label in example.labels[1:]):
            data.num_skipped += 1
            continue
        data.examples.append(example)
    if not data.examples:
        raise LazyTrainError(f"none of the {len(rows)} rows gives an example with a response token within "
                             f"cutoff_len {cutoff_len}; raise cutoff_len or check the dataset")
    return data


def split_off(examples: list[Example], val_size: float | int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): `val_size` as a fraction in (0, 1) or a count of examples, drawn at random from `seed`."""
    count = round(val_size * len(examples)) if isinstance(val_size, float) and val_size < 1 else int(val_size)
    if not 1 <= count < len(examples):
        raise LazyTrainError(f"val_size {val_size} leaves {count} of {len(examples)} examples held out; it must "
                             "leave at least one for each side")
    held_out = set(np.random.default_rng([seed, 1]).choice(len(examples), size=count, replace=False).tolist())
    return ([ex for i, ex in enumerate(examples) if i not in held_out],
            [ex for i, ex in enumerate(examples) if i in held_out])


def load_sft(dataset: str | Path, tokenizer: PreTrainedTokenizerBase, *, dataset_format: str = "auto",
             template: str | None = None, train_on_prompt: bool = False, cutoff_len: int,
             val_size: float | int | None = None, eval_dataset: str | Path | None = None, seed: int = 0) -> SftData:
    """A dataset file tokenized for training, with its held-out part (an eval file wins over val_size)."""
    kwargs = dict(dataset_format=dataset_format, template=template, train_on_prompt=train_on_prompt,
                  cutoff_len=cutoff_len)
    data = tokenize_rows(load_rows(dataset), tokenizer, **kwargs)
    if eval_dataset is not None:
        held_out = tokenize_rows(load_rows(eval_dataset), tokenizer, **kwargs)
        data.val = held_out.examples
        data.num_truncated += held_out.num_truncated
        data.num_skipped += held_out.num_skipped
    elif val_size:
        data.examples, data.val = split_off(data.examples, val_size, seed)
    return data
