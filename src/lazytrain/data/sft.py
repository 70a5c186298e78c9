"""Supervised fine-tuning data: datasets -> checked canonical rows -> tokenized `Example`s with response-only labels.

The datasets of `dataset` (files, LLaMA-Factory's dataset_info.json names, HF cache ids: sources.py) are read and
checked row by row (rows.py), mixed (`concat`, or HF datasets' `interleave_datasets` by `interleave_probs`), and
tokenized through `datasets.map` (`preprocessing_num_workers` processes, `preprocessing_batch_size` rows a call)
into a cache folder keyed by everything the tokens depend on: a resumed run, a second rank and the next run with
the same data and tokenizer read the tokens back instead of tokenizing again (`overwrite_cache` forces it). A
cache folder is written under a name of its own (`.<key>.tmp-<pid>`) and renamed when complete; one a killed
process left behind is removed by the next run.

A conversation is encoded with LLaMA-Factory's template when `template` names one, into LF's own ids and labels,
its cutoff shared between prompt and response turn by turn (templates.py); without `template`, it is rendered with
the tokenizer's chat template (`apply_chat_template`). There the assistant spans come from rendering prefixes: the
text up to an assistant turn (with the generation prompt) and the text through it; each piece is tokenized on its
own, as at inference time the prompt is. Labels are -100 everywhere but in assistant spans (their content and the
template's end-of-turn marker), unless `train_on_prompt`. EOS ends every example: an assistant turn that already
ends with the tokenizer's EOS keeps it (trailing whitespace after it is dropped), otherwise EOS is appended.
Examples longer than `cutoff_len` are cut as LLaMA-Factory cuts them, (prompt, response) pair by pair with its
`infer_seqlen` (counted); rows with no assistant turn, and examples left with no loss-carrying token, are skipped
(counted).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from lazytrain.config.schema import names_in
from lazytrain.data.loader import IGNORE_INDEX, Example
from lazytrain.data.rows import CANONICAL, FORMATS, Message, Row, canonical_rows, read_rows
from lazytrain.data.sources import Source, resolve
from lazytrain.data.templates import Template, infer_seqlen, lf_template
from lazytrain.errors import LazyTrainError
from lazytrain.writes import alive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["FORMATS", "Row", "SftData", "load_rows", "load_sft", "split_off", "tokenize_rows"]

UNCUT = 2**31  # the cutoff of documents that group_texts lays end to end (none is cut)
CACHE_VERSION = 2  # bump when the tokenization below changes what it writes
FEATURES = datasets.Features({
    "kind": datasets.Value("string"),
    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "text": datasets.Value("string"), "prompt": datasets.Value("string"), "completion": datasets.Value("string"),
})


# =====================================================================================================
# rendering and tokenizing one batch of canonical rows
# =====================================================================================================
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
                "prefix-stable), so the assistant spans cannot be found; set template to the model's LLaMA-Factory "
                "template name (qwen, llama3, mistral, gemma, ...)"
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
    responses: list[bool]  # per piece: an assistant turn or a completion (what the cutoff shares with its prompt)
    templated: bool  # the chat template wrote the specials (BOS) itself; else the tokenizer adds them
    append_eos: bool  # the last piece does not already end with EOS


def layout_row(tokenizer: PreTrainedTokenizerBase, row: Row, *, train_on_prompt: bool) -> Layout | None:
    """The pieces of one canonical row; None for a conversation with no assistant turn.

    Nothing after the last trained piece is kept (a template's trailing newline): EOS ends the example. When
    the last trained piece already ends with EOS (ChatML with EOS `<|im_end|>`), whitespace after it is dropped
    and no second EOS is appended.
    """
    if row["kind"] == "text":
        pieces, templated = [(row["text"], True)], False
    elif row["kind"] == "completion":
        pieces, templated = [(row["prompt"], False), (row["completion"], True)], False
    else:
        messages = row["messages"]
        if not any(m["role"] == "assistant" for m in messages):
            return None
        pieces, templated = conversation_pieces(tokenizer, messages), True
    if not any(trained for _, trained in pieces):  # an empty response rendered as nothing
        return None
    last = max(i for i, (_, trained) in enumerate(pieces) if trained)
    texts = [text for text, _ in pieces[: last + 1]]
    responses = [response for _, response in pieces[: last + 1]]
    trained = [response or train_on_prompt for response in responses]
    eos = tokenizer.eos_token
    ends_with_eos = bool(eos) and texts[-1].rstrip().endswith(eos)
    if ends_with_eos:
        texts[-1] = texts[-1].rstrip()
    return Layout(texts=texts, trained=trained, responses=responses, templated=templated,
                  append_eos=not ends_with_eos)


def encode_layouts(tokenizer: PreTrainedTokenizerBase, layouts: Sequence[Layout], cutoff_len: int | None = None
                   ) -> list[tuple[Example, bool]]:
    """Tokenize every piece of every layout (two batched calls: with and without the tokenizer's specials); with
    `cutoff_len`, an example longer than it is cut as LLaMA-Factory cuts one (`cut_pairs`; True: it was)."""
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
        pieces = [(ids[r, i], trained, response) for i, (trained, response)
                  in enumerate(zip(lay.trained, lay.responses, strict=True))]
        if lay.append_eos:  # EOS ends the last response
            last_ids, trained, response = pieces[-1]
            pieces[-1] = ([*last_ids, tokenizer.eos_token_id], trained, response)
        examples.append(cut_pairs(pieces, cutoff_len))
    return examples


def cut_pairs(pieces: Sequence[tuple[list[int], bool, bool]], cutoff_len: int | None) -> tuple[Example, bool]:
    """One example from its pieces (ids, trained, is a response); longer than `cutoff_len`, each (prompt, response)
    pair in turn gets what LF's `infer_seqlen` gives it of the budget left (a short response is kept and its prompt
    cut from the end; a short prompt kept and its response cut; else both in proportion), until none is left."""
    pairs: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = [([], [])]
    for piece_ids, trained, response in pieces:
        tokens = [(t, t if trained else IGNORE_INDEX) for t in piece_ids]
        if response:
            pairs[-1][1].extend(tokens)
            pairs.append(([], []))
        else:
            pairs[-1][0].extend(tokens)
    kept: list[tuple[int, int]] = []
    total = sum(len(p) + len(r) for p, r in pairs)
    for prompt, response in pairs:
        if cutoff_len is not None and total > cutoff_len:
            if len(kept) >= cutoff_len:
                break
            prompt_len, response_len = infer_seqlen(len(prompt), len(response), cutoff_len - len(kept))
            prompt, response = prompt[:prompt_len], response[:response_len]
        kept += prompt + response
    example = Example(input_ids=[t for t, _ in kept], labels=[label for _, label in kept])
    return example, cutoff_len is not None and total > cutoff_len


def tokenize_batch(batch: dict[str, list[Any]], *, tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool,
                   cutoff_len: int, template: str | None = None) -> dict[str, list[Any]]:
    """datasets.map's function: a batch of canonical rows -> input_ids, labels (at most cutoff_len tokens),
    truncated, skipped (no assistant turn, or no loss-carrying token left; its ids empty). `template`: LF's
    template that encodes the conversations (None: the tokenizer's chat template)."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    lf = lf_template(template) if template is not None else None
    by_lf = [lf is not None and row["kind"] == "chat" for row in rows]
    layouts = [None if lf_row else layout_row(tokenizer, row, train_on_prompt=train_on_prompt)
               for row, lf_row in zip(rows, by_lf, strict=True)]
    encoded = iter(encode_layouts(tokenizer, [lay for lay in layouts if lay is not None], cutoff_len))
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "truncated": [], "skipped": []}
    for row, lay, lf_row in zip(rows, layouts, by_lf, strict=True):
        if lf_row:
            assert lf is not None
            example, truncated = _lf_example(lf, tokenizer, row, cutoff_len, train_on_prompt)
        else:
            example, truncated = next(encoded) if lay is not None else (None, False)
        if example is not None:
            example = Example(example.input_ids[:cutoff_len], example.labels[:cutoff_len])
        skipped = example is None or all(label == IGNORE_INDEX for label in example.labels[1:])
        out["input_ids"].append([] if skipped else example.input_ids)
        out["labels"].append([] if skipped else example.labels)
        out["truncated"].append(truncated)
        out["skipped"].append(skipped)
    return out


def _lf_example(lf: Template, tokenizer: PreTrainedTokenizerBase, row: Row, cutoff_len: int,
                train_on_prompt: bool) -> tuple[Example | None, bool]:
    encoded = lf.encode(tokenizer, row["messages"], cutoff_len=cutoff_len, train_on_prompt=train_on_prompt)
    if encoded is None:
        return None, False
    input_ids, labels, truncated = encoded
    return Example(input_ids=input_ids, labels=labels), truncated


# =====================================================================================================
# the data of a run
# =====================================================================================================
@dataclass
class SftData:
    """Tokenized examples and what happened on the way, for the trainer's log."""

    examples: list[Example]
    dataset_format: str
    num_rows: int
    num_truncated: int = 0  # examples cut to cutoff_len
    num_skipped: int = 0  # rows with no assistant turn, or no loss-carrying token left after truncation
    val: list[Example] = field(default_factory=list)  # held-out examples (val_size or an eval dataset)
    template: str = ""  # which chat template rendered the conversations (empty: none needed)
    cached: bool = False  # the tokens were read back from the cache

    def summary(self) -> str:
        tokens = sum(len(ex.input_ids) for ex in self.examples)
        return (f"{self.dataset_format}: {len(self.examples):,} train / {len(self.val):,} held-out examples, "
                f"{tokens:,} train tokens; {self.num_truncated} truncated to cutoff_len, {self.num_skipped} skipped"
                + ("; tokens from the cache" if self.cached else "")
                + (f"; template: {self.template}" if self.template else ""))


@dataclass(frozen=True)
class Tokenization:
    """How rows become tokens (everything the tokenized cache depends on besides the rows)."""

    cutoff_len: int
    train_on_prompt: bool = False
    template: str | None = None
    num_proc: int | None = None
    batch_size: int = 1000
    cache_dir: Path | None = None  # None: tokenize in memory, cache nothing
    overwrite_cache: bool = False
    group_texts: bool = False  # plain text: the documents end to end, cut in blocks of cutoff_len (LF's pt packing)


def load_rows(path: str | Path) -> list[Row]:
    """The rows of one local file or save_to_disk folder, as read (for tests and tools)."""
    path = Path(path)
    if not path.exists():
        raise LazyTrainError(f"dataset file {path} does not exist; set dataset to a json, jsonl, parquet or arrow "
                             "file (or a folder written by datasets' save_to_disk)")
    if path.is_file() and not path.read_bytes().strip():
        raise LazyTrainError(f"dataset file {path} is empty; it needs at least one row")
    return read_rows(Source(name=str(path), path=path))


def tokenize_rows(rows: Sequence[Row], tokenizer: PreTrainedTokenizerBase, *, dataset_format: str = "auto",
                  template: str | None = None, train_on_prompt: bool = False, cutoff_len: int) -> SftData:
    """Rows of one format -> Examples of at most `cutoff_len` tokens, each with at least one loss token (in
    memory, no cache)."""
    if not rows:
        raise LazyTrainError("the dataset has no rows; it needs at least one")
    canonical, fmt = canonical_rows(rows, Source(name="rows"), dataset_format)
    table = datasets.Dataset.from_list(canonical, features=FEATURES)
    how = Tokenization(cutoff_len=cutoff_len, train_on_prompt=train_on_prompt, template=template)
    return _tokenize(table, tokenizer, how, fmt, key=None)


def load_sft(dataset: str | Path | Sequence[Source], tokenizer: PreTrainedTokenizerBase, *,
             dataset_format: str = "auto", template: str | None = None, train_on_prompt: bool = False,
             cutoff_len: int, val_size: float | int | None = None,
             eval_dataset: str | Path | Sequence[Source] | None = None, seed: int = 0,
             max_samples: int | None = None, mix_strategy: str = "concat",
             interleave_probs: Sequence[float] | None = None, dataset_dir: str = "data",
             how: Tokenization | None = None) -> SftData:
    """The datasets tokenized for training, with the held-out part: an eval dataset, else `val_size` of the
    training examples (a fraction or a count), else none."""
    how = how or Tokenization(cutoff_len=cutoff_len, train_on_prompt=train_on_prompt, template=template)
    data = _load(dataset, tokenizer, how, dataset_format=dataset_format, seed=seed, max_samples=max_samples,
                 mix_strategy=mix_strategy, interleave_probs=interleave_probs, dataset_dir=dataset_dir,
                 key="dataset")
    if eval_dataset is not None:
        held_out = _load(eval_dataset, tokenizer, how, dataset_format=dataset_format, seed=seed,
                         max_samples=max_samples, mix_strategy="concat", interleave_probs=None,
                         dataset_dir=dataset_dir, key="eval_dataset")
        data.val = held_out.examples
        data.num_truncated += held_out.num_truncated
        data.num_skipped += held_out.num_skipped
    elif val_size:
        data.examples, data.val = split_off(data.examples, val_size, seed)
    return data


def _load(dataset: str | Path | Sequence[Source], tokenizer: PreTrainedTokenizerBase, how: Tokenization, *,
          dataset_format: str, seed: int, max_samples: int | None, mix_strategy: str,
          interleave_probs: Sequence[float] | None, dataset_dir: str, key: str) -> SftData:
    sources = (resolve(names_in(str(dataset)), dataset_dir, key) if isinstance(dataset, str | Path)
               else list(dataset))
    if interleave_probs is not None and len(interleave_probs) != len(sources):
        raise LazyTrainError(f"interleave_probs has {len(interleave_probs)} weights for {len(sources)} datasets; give "
                             "one per dataset")
    tables, formats, described = [], [], []
    for source in sources:
        canonical, fmt = canonical_rows(read_rows(source, max_samples=max_samples, seed=seed), source,
                                        dataset_format)
        tables.append(datasets.Dataset.from_list(canonical, features=FEATURES))
        formats.append(fmt)
        described.append(source.describe())
    if len(tables) == 1:
        table = tables[0]
    elif mix_strategy == "concat":
        table = datasets.concatenate_datasets(tables)
    else:
        weights = None if interleave_probs is None else [p / sum(interleave_probs) for p in interleave_probs]
        table = datasets.interleave_datasets(tables, probabilities=weights, seed=seed, stopping_strategy=(
            "first_exhausted" if mix_strategy == "interleave_under" else "all_exhausted"))
    key_of = {"sources": described, "dataset_format": dataset_format, "max_samples": max_samples,
              "mix": mix_strategy, "probs": list(interleave_probs or []), "seed": seed}
    return _tokenize(table, tokenizer, how, "+".join(dict.fromkeys(formats)), key=key_of)


def _tokenize(table: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, how: Tokenization, fmt: str,
              key: dict[str, Any] | None) -> SftData:
    """Tokenize `table` (through the cache when `how.cache_dir` is set and `key` names the rows) into SftData."""
    note = _use_template(tokenizer, how.template, table)
    grouped = how.group_texts and set(table.unique("kind")) == {"text"}
    kwargs = dict(tokenizer=tokenizer, train_on_prompt=how.train_on_prompt,
                  cutoff_len=UNCUT if grouped else how.cutoff_len, template=how.template)
    datasets.disable_progress_bars()
    cached = False
    if how.cache_dir is None or key is None:
        tokens = table.map(tokenize_batch, batched=True, batch_size=how.batch_size, fn_kwargs=kwargs,
                           remove_columns=list(CANONICAL), keep_in_memory=True, new_fingerprint="in-memory")
    else:
        fingerprint = _fingerprint(key, tokenizer, how)
        tokens, cached = _cached_map(table, fingerprint, how, kwargs)
    data = SftData(examples=[], dataset_format=fmt, num_rows=len(table), template=note, cached=cached)
    columns = tokens.data
    data.num_truncated = sum(columns.column("truncated").to_pylist())
    skipped = columns.column("skipped").to_pylist()
    data.num_skipped = sum(skipped)
    for ids, labels, skip in zip(columns.column("input_ids").to_pylist(), columns.column("labels").to_pylist(),
                                 skipped, strict=True):
        if not skip:
            data.examples.append(Example(input_ids=ids, labels=labels))
    if grouped:
        tokens = sum(len(ex.input_ids) for ex in data.examples)
        data.examples = group_texts(data.examples, how.cutoff_len)
        if not data.examples:
            raise LazyTrainError(f"the {len(table)} documents hold {tokens:,} tokens, less than one block of "
                                 f"cutoff_len {how.cutoff_len}; lower cutoff_len or give more text")
    if not data.examples:
        raise LazyTrainError(f"none of the {len(table)} rows gives an example with a response token within "
                             f"cutoff_len {how.cutoff_len}; raise cutoff_len or check the dataset")
    return data


def group_texts(examples: list[Example], block_len: int) -> list[Example]:
    """The documents end to end (each ends with EOS), cut in blocks of `block_len` tokens, the remainder dropped:
    LLaMA-Factory's pretraining with packing (as HF's run_clm); a block attends across the documents in it."""
    ids = [t for ex in examples for t in ex.input_ids]
    labels = [t for ex in examples for t in ex.labels]
    return [Example(ids[i:i + block_len], labels[i:i + block_len])
            for i in range(0, len(ids) - block_len + 1, block_len)]


def _use_template(tokenizer: PreTrainedTokenizerBase, template: str | None, table: datasets.Dataset) -> str:
    """Fix the tokenizer as LF's template `template` wants it (saved with every checkpoint; LF does so for plain
    text too: its EOS ends each document); what renders the conversations ("" when no row is a conversation)."""
    if template is not None:
        lf_template(template).fix_tokenizer(tokenizer)
    if "chat" not in set(table.unique("kind")):
        return ""
    if template is not None:
        return f"LLaMA-Factory's {template} template"
    if not tokenizer.chat_template:
        raise LazyTrainError("the tokenizer has no chat template; set template to the model's LLaMA-Factory template "
                             "name (qwen, llama3, mistral, gemma, chatml, alpaca, default, empty, ...)")
    return "the tokenizer's own chat template"


def _fingerprint(key: dict[str, Any], tokenizer: PreTrainedTokenizerBase, how: Tokenization) -> str:
    """What the tokens depend on: the rows (sources, their files' sizes and times, how they were chosen), the
    tokenizer (its vocabulary and merges, specials, chat template) and the tokenization."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    described = {**key, "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
                 "specials": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token],
                 "chat_template": tokenizer.chat_template, "cutoff_len": how.cutoff_len,
                 "train_on_prompt": how.train_on_prompt, "template": how.template, "group_texts": how.group_texts,
                 "version": CACHE_VERSION}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cached_map(table: datasets.Dataset, fingerprint: str, how: Tokenization, kwargs: dict[str, Any]
                ) -> tuple[datasets.Dataset, bool]:
    """The tokens from `cache_dir/<fingerprint>/`, or tokenized into `.<fingerprint>.tmp-<pid>/` and renamed there
    once complete (a killed run leaves only its tmp folder, which the next run removes)."""
    assert how.cache_dir is not None
    root = how.cache_dir
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_tmp(root)
    final = root / fingerprint
    if final.is_dir() and not how.overwrite_cache:
        return _read_tokens(final), True
    tmp = root / f".{fingerprint}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        table.map(tokenize_batch, batched=True, batch_size=how.batch_size, fn_kwargs=kwargs,
                  remove_columns=list(CANONICAL), num_proc=how.num_proc, cache_file_name=str(tmp / "tokens.arrow"),
                  load_from_cache_file=False, new_fingerprint=fingerprint)
        for leftover in tmp.glob("tmp*"):  # datasets' own temporary files (none once it finished)
            leftover.unlink()
        if final.exists():  # overwrite_cache, or another process finished first
            shutil.rmtree(final, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:  # another process renamed its copy in between: use that one
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _read_tokens(final), False


def _read_tokens(folder: Path) -> datasets.Dataset:
    files = sorted(folder.glob("tokens*.arrow"))  # one file, or one per worker (tokens_00000_of_00004, ...)
    if not files:
        raise LazyTrainError(f"the tokenized cache {folder} holds no tokens; remove it (or set overwrite_cache)")
    parts = [datasets.Dataset.from_file(str(f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def remove_dead_tmp(root: Path) -> None:
    """Remove `.*.tmp-<pid>` folders whose process is gone (a run killed while it tokenized)."""
    for tmp in root.glob(".*.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def split_off(examples: list[Example], val_size: float | int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): `val_size` as a fraction in (0, 1) or a count of examples, drawn at random from `seed`."""
    count = round(val_size * len(examples)) if isinstance(val_size, float) and val_size < 1 else int(val_size)
    if not 1 <= count < len(examples):
        raise LazyTrainError(f"val_size {val_size} leaves {count} of {len(examples)} examples held out; it must "
                             "leave at least one for each side")
    held_out = set(np.random.default_rng([seed, 1]).choice(len(examples), size=count, replace=False).tolist())
    return ([ex for i, ex in enumerate(examples) if i not in held_out],
            [ex for i, ex in enumerate(examples) if i in held_out])
