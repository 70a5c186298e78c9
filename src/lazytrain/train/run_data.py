"""The run's data: what `dataset` names, turned into the loader, the held-out batches and the tokenizer.

- `math` (the default): the embedded MetaMathQA-like set, which job/resolve.py has already turned into the
  default job's model directory and files (`lazytrain.data.default_job_files`: a BPE tokenizer trained on the set,
  digits split, ChatML template, a Llama config of the built-in shape, a seeded random init). Exact match of
  the final number is measured on its held-out problems (`exact_match_file`).
- `stdlib`, `zen` or a `.txt` file: the byte-level corpus of the built-in shapes (random windows, loss on every
  token), as before SFT data existed.
- any other path: an SFT file (json/jsonl/parquet/arrow) in `dataset_format`, tokenized with the model
  directory's tokenizer and its chat template (or `template`); loss on assistant turns only unless
  `train_on_prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from lazytrain.config import JobConfig
from lazytrain.costmodel.model import BUILT_IN_SHAPES
from lazytrain.data.corpus import ByteTokenizer, TokenData
from lazytrain.data.default_job_files import read_jsonl
from lazytrain.data.loader import IGNORE_INDEX, Batch, Loader, count_loss_tokens, eval_batches, eval_rows
from lazytrain.data.sft import Row, SftData, Tokenization, load_sft
from lazytrain.data.sources import check_names
from lazytrain.data.tokenizer import load_tokenizer
from lazytrain.distributed.batches import check_batches_drawn
from lazytrain.errors import LazyTrainError
from lazytrain.paths import cache_dir
from lazytrain.runtime.weights import resolve_model

MATH = "math"  # the embedded math SFT set
MATH_EVAL_PROBLEMS = 64  # held-out problems exact match is measured on (greedy decoding of each)


@dataclass
class RunData:
    batches: Loader | CorpusBatches
    eval_set: list[Batch]
    probe: tuple[torch.Tensor, torch.Tensor]  # one (input_ids, labels) of the run's shape, for calibration
    tokenizer: PreTrainedTokenizerBase | None  # None: the byte tokenizer of the built-in corpora
    vocab_size: int
    summary: str
    math_eval: list[Row]  # held-out problems for exact match (empty unless dataset is math)


def load_data(job: JobConfig, world_size: int = 1, exact_match_file: Path | None = None) -> RunData:
    """The data of a resolved job (job/resolve.py: `dataset: math` is already the default job's files).
    world_size: data parallelism; the training and held-out batches are global ones of B x world_size rows
    (each rank keeps its own rows: the single process's batches), the probe batch stays per device.
    exact_match_file: held-out problems whose final number is checked by greedy decoding (`math_eval`)."""
    dataset, seed = job.data.dataset, job.runtime.seed
    data_seed = seed if job.runtime.data_seed is None else job.runtime.data_seed  # the batch order and the split
    batch_size, seq_len = job.data.per_device_train_batch_size, job.data.cutoff_len
    check_data_files(job)  # the root cause first: a file that is not there, before what it would be read with
    if not job.data.masked:  # a byte-level corpus: full rows, no mask
        return _corpus_data(job, world_size)
    if dataset == MATH:
        raise LazyTrainError("dataset math names the default job's files: resolve the job first "
                             "(lazytrain.job.resolve.with_math_dataset)")
    math_eval = read_jsonl(exact_match_file)[:MATH_EVAL_PROBLEMS] if exact_match_file is not None else []
    if job.model.model in BUILT_IN_SHAPES:
        raise LazyTrainError(f"dataset {dataset}: model {job.model.model} is a built-in shape with the byte tokenizer "
                             "only; give a model directory with its tokenizer (or dataset math, stdlib or zen)")
    source = resolve_model(job.model.model)
    if source.directory is None:
        raise LazyTrainError(f"model {job.model.model}: an SFT dataset needs a model directory with its tokenizer")
    tokenizer = load_tokenizer(source.directory)
    d = job.data
    how = Tokenization(cutoff_len=seq_len, train_on_prompt=d.train_on_prompt, template=d.template,
                       num_proc=d.preprocessing_num_workers, batch_size=d.preprocessing_batch_size,
                       cache_dir=cache_dir() / "tokenized", overwrite_cache=d.overwrite_cache,
                       group_texts=d.packing and d.dataset_format == "text")
    sft = load_sft(d.dataset, tokenizer, dataset_format=d.dataset_format, cutoff_len=seq_len, val_size=d.val_size,
                   eval_dataset=d.eval_dataset, seed=data_seed, max_samples=d.max_samples,
                   mix_strategy=d.mix_strategy, interleave_probs=d.interleave_probs, dataset_dir=d.dataset_dir,
                   how=how)
    loader = Loader(sft.examples, batch_size=batch_size * world_size, seq_len=seq_len, packing=d.packing,
                    pad_token_id=tokenizer.pad_token_id, seed=data_seed)
    rows = eval_rows(sft.val, seq_len=seq_len, packing=d.packing)
    kept = eval_rows_kept(job, len(rows), world_size)
    eval_set = eval_batches(sft.val, batch_size=batch_size * world_size, seq_len=seq_len, packing=d.packing,
                            pad_token_id=tokenizer.pad_token_id, max_rows=kept)
    eval_note = _eval_note(job, kept, len(rows), sum(len(r) for r in rows[:kept]), len(sft.val), "examples")
    probe = Loader(sft.examples, batch_size=batch_size, seq_len=seq_len, packing=d.packing,
                   pad_token_id=tokenizer.pad_token_id, seed=seed + 2).next()
    return RunData(batches=loader, eval_set=eval_set, probe=(probe.input_ids, probe.labels),
                   tokenizer=tokenizer, vocab_size=len(tokenizer),
                   summary=f"dataset  {dataset} ({sft.summary()})" + eval_note
                   + ("" if dataset == MATH else first_example(tokenizer, sft)),
                   math_eval=math_eval)


def first_example(tokenizer: PreTrainedTokenizerBase, sft: SftData) -> str:
    """The first training example as LLaMA-Factory prints it before training: the whole text with its special
    tokens, then the tokens that carry loss (the default job's own data prints nothing)."""
    if not sft.examples or sft.template == "":
        return ""
    example = sft.examples[0]
    trained = [t for t in example.labels if t != IGNORE_INDEX]
    return (f"\ninputs:\n{tokenizer.decode(example.input_ids, skip_special_tokens=False)}"
            f"\nlabels:\n{tokenizer.decode(trained, skip_special_tokens=False)}")


def eval_rows_kept(job: JobConfig, num_rows: int, world_size: int) -> int:
    """Held-out rows each evaluation scores: all of them, or eval_batches batches of per_device_eval_batch_size
    rows per rank."""
    cap = job.metrics.eval_batches
    if cap is None:
        return num_rows
    per_batch = (job.data.per_device_eval_batch_size or job.data.per_device_train_batch_size) * world_size
    return min(num_rows, cap * per_batch)


def _eval_note(job: JobConfig, kept: int, num_rows: int, kept_items: int, num_items: int, what: str) -> str:
    """The line that says when eval_batches cuts the held-out set (nothing when it does not)."""
    if kept >= num_rows or job.metrics.eval_batches == 0:
        return ""
    return (f"\neval     eval_batches {job.metrics.eval_batches} scores {kept_items:,} of the {num_items:,} held-out "
            f"{what} ({kept} of {num_rows} rows); remove eval_batches to score them all")


def check_data_files(job: JobConfig) -> None:
    """The names `dataset` and `eval_dataset` give mean something (data/sources.py)."""
    check_names(job.data.dataset, job.data.eval_dataset, job.data.dataset_dir)


def _corpus_data(job: JobConfig, world_size: int) -> RunData:
    seed, batch_size, seq_len = job.runtime.seed, job.data.per_device_train_batch_size, job.data.cutoff_len
    data_seed = seed if job.runtime.data_seed is None else job.runtime.data_seed
    tokenizer = ByteTokenizer()
    data = TokenData.from_corpus(job.data.dataset, tokenizer)
    data.check_fits(seq_len, "train")
    windows = data.num_held_out_windows(seq_len)
    kept = eval_rows_kept(job, windows, world_size)
    eval_set = [_batch(*b) for b in data.held_out_batches(batch_size * world_size, seq_len, max_windows=kept)]
    eval_note = _eval_note(job, kept, windows, kept, windows, f"windows of {seq_len} tokens")
    probe = data.fixed_batches(1, batch_size, seq_len, seed=seed + 2, split="train")[0]
    return RunData(batches=CorpusBatches(data, batch_size * world_size, seq_len, seed=data_seed),
                   eval_set=eval_set,
                   probe=probe, tokenizer=None, vocab_size=tokenizer.vocab_size,
                   summary=f"corpus   {job.data.dataset}: {len(data.train):,} train / {len(data.val):,} held-out "
                           "tokens (bytes)" + eval_note, math_eval=[])


class CorpusBatches:
    """A text corpus as a resumable batch source: seeded random windows; its state is how many it gave."""

    def __init__(self, data: TokenData, batch_size: int, seq_len: int, seed: int) -> None:
        self._stream = data.batches(batch_size, seq_len, seed=seed)
        self.consumed = 0

    def next(self) -> Batch:
        self.consumed += 1
        return _batch(*next(self._stream))

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, object], batches_drawn: int) -> None:
        """Draw up to the checkpoint's position, which must be the `batches_drawn` its step took (step x
        gradient_accumulation_steps): a position from a damaged or edited data.json is never walked to."""
        if set(state) != {"consumed"}:
            raise LazyTrainError(f"the checkpoint's data position {str(state)[:120]} is not a text corpus's "
                                 "(consumed batches); the checkpoint is damaged")
        check_batches_drawn(state, batches_drawn)
        for _ in range(batches_drawn - self.consumed):
            self.next()


def _batch(input_ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """A batch of corpus windows; a window is an example when it carries a label (an eval batch's filler rows
    do not)."""
    scored = int((labels[:, 1:] != IGNORE_INDEX).any(dim=1).sum())
    return Batch(input_ids=input_ids, labels=labels, attention_mask=None, position_ids=None,
                 num_tokens=count_loss_tokens(labels), num_examples=scored)
