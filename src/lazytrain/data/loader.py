"""Tokenized examples into fixed-shape batches: packing or padding, per-epoch shuffles, exact resume.

Every batch is exactly (batch_size, seq_len) because the plan and the device arena are sized for that shape.

- Packing (`packing=True`): examples are laid end to end into rows of `seq_len`; an example that does not fit
  the rest of a row starts the next row (examples are never split). `position_ids` restart at 0 at every
  example, so attention never crosses examples, and the first token of every example has label -100 (it would
  be predicted from the previous example's last token). A row's unused tail is padding: one more segment with
  its own positions from 0 and labels -100. `attention_mask` is None.
- Padding (`packing=False`): one example per row, right-padded with `pad_token_id`; `attention_mask` is 1 on
  the example's tokens, 0 on padding; `position_ids` is None.

The example order is a stream: epoch 0's permutation, then epoch 1's, ... each drawn from `(seed, epoch)`
alone, so every example is seen once per epoch (shuffled without replacement) and the loader's whole state is
two integers (`epoch`, `position`); a batch may hold the last examples of one epoch and the first of the next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lazytrain.errors import LazyTrainError

IGNORE_INDEX = -100  # the label of a token that carries no loss (the Hugging Face / PyTorch convention)


@dataclass
class Example:
    """One tokenized example. `labels` align with `input_ids` (the model shifts them); -100 = no loss."""

    input_ids: list[int]
    labels: list[int]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise LazyTrainError(f"an example has {len(self.input_ids)} input ids but {len(self.labels)} labels")
        if not self.input_ids:
            raise LazyTrainError("an example has no tokens")


@dataclass
class Batch:
    """One micro-batch, exactly (B, T) = (batch_size, seq_len), int64 on the host."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 on ignored tokens
    attention_mask: torch.Tensor | None  # (B, T) 1 = token, 0 = right padding; None when packed
    position_ids: torch.Tensor | None  # (B, T) restarting at 0 per packed example; None when padded
    num_tokens: int  # labels that carry loss after the shift: (labels[:, 1:] != -100).sum()
    num_examples: int  # examples in this batch (packed rows hold several)


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss once the model shifts labels by one (position 0's label is never predicted)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def step_num_tokens(batches: Sequence[Batch]) -> int:
    """The loss normalizer of an optimizer step: loss-carrying tokens over all of its micro-batches."""
    return sum(b.num_tokens for b in batches)


def _rows_to_batch(rows: list[list[Example]], *, seq_len: int, packing: bool, pad_token_id: int) -> Batch:
    """Lay out `rows` (each a list of examples that fit in `seq_len` together) as one Batch."""
    input_ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int64) if packing else None
    attention_mask = None if packing else torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for r, row in enumerate(rows):
        start = 0
        for ex in row:
            n = len(ex.input_ids)
            input_ids[r, start:start + n] = torch.tensor(ex.input_ids)
            labels[r, start:start + n] = torch.tensor(ex.labels)
            if packing:
                labels[r, start] = IGNORE_INDEX  # predicted from the previous example: no loss across examples
                position_ids[r, start:start + n] = torch.arange(n)
            else:
                attention_mask[r, :n] = 1
            start += n
        if not packing and not row:  # a filler row (eval's last batch): attends to itself so no row is all-masked
            attention_mask[r] = 1
        if packing and start < seq_len:  # the padded tail is a segment of its own
            position_ids[r, start:] = torch.arange(seq_len - start)
    return Batch(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids,
                 num_tokens=count_loss_tokens(labels), num_examples=sum(len(row) for row in rows))


def _check_lengths(examples: Sequence[Example], seq_len: int) -> None:
    longest = max(len(ex.input_ids) for ex in examples)
    if longest > seq_len:
        raise LazyTrainError(
            f"an example has {longest} tokens, more than seq_len {seq_len}; set cutoff_len <= {seq_len} "
            "(examples are truncated to cutoff_len when they are tokenized)"
        )


class Loader:
    """Endless fixed-shape batches over `examples`, shuffled without replacement per epoch from `seed`.

    `next(loader)` (or `loader.next()`) gives one Batch; `take(n)` gives an optimizer step's n micro-batches
    (`step_num_tokens` of them is the step's loss normalizer, known before any of them runs).
    `state_dict()` / `load_state_dict()` make a resumed run see exactly the batches the uninterrupted run saw.
    """

    def __init__(self, examples: Sequence[Example], *, batch_size: int, seq_len: int, packing: bool,
                 pad_token_id: int, seed: int) -> None:
        if not examples:
            raise LazyTrainError("the training set has no examples; check the dataset file and dataset_format")
        if batch_size < 1 or seq_len < 2:
            raise LazyTrainError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        _check_lengths(examples, seq_len)
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.epoch = 0  # the epoch of the next example to be taken
        self.position = 0  # its index in that epoch's permutation
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def _peek(self) -> Example:
        return self.examples[self._order[self.position]]

    def _advance(self) -> None:
        self.position += 1
        if self.position == len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)

    def next(self) -> Batch:
        rows = self._next_rows()
        return _rows_to_batch(rows, seq_len=self.seq_len, packing=self.packing, pad_token_id=self.pad_token_id)

    def _next_rows(self) -> list[list[Example]]:
        """The examples of the next batch, row by row (the layout alone, no tensors)."""
        rows: list[list[Example]] = []
        for _ in range(self.batch_size):
            row, used = [self._peek()], len(self._peek().input_ids)
            self._advance()
            while self.packing and used + len(self._peek().input_ids) <= self.seq_len:
                row.append(self._peek())
                used += len(row[-1].input_ids)
                self._advance()
            rows.append(row)
        return rows

    __next__ = next

    def __iter__(self) -> Iterator[Batch]:
        return self

    def take(self, num_batches: int) -> list[Batch]:
        """The next `num_batches` batches: one optimizer step's micro-batches."""
        return [self.next() for _ in range(num_batches)]

    def batches_for_epochs(self, epochs: float) -> int:
        """Batches from the start until `epochs` passes over the examples are taken (the last batch may run into
        the next epoch): what `num_train_epochs` turns into. Lays out a fresh loader's rows; builds no tensor."""
        fresh = Loader(self.examples, batch_size=self.batch_size, seq_len=self.seq_len, packing=self.packing,
                       pad_token_id=self.pad_token_id, seed=self.seed)
        count = 0
        while fresh.epoch + fresh.position / len(fresh.examples) < epochs:
            fresh._next_rows()
            count += 1
        return count

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, object], batches_drawn: int) -> None:
        """Continue from the checkpoint's position, which must fit the `batches_drawn` its step took (step x
        gradient_accumulation_steps): each batch takes batch_size examples, or with packing up to seq_len a row."""
        keys = ("epoch", "position", "seed", "num_examples")
        if sorted(state) != sorted(keys) or not all(isinstance(state[k], int) and not isinstance(state[k], bool)
                                                    for k in keys):
            raise LazyTrainError(f"the checkpoint's data position {str(state)[:120]} is not one of a dataset "
                                 f"(integers {', '.join(keys)}); the checkpoint is damaged")
        epoch, position = int(state["epoch"]), int(state["position"])  # type: ignore[call-overload]
        if state["seed"] != self.seed or state["num_examples"] != len(self.examples):
            raise LazyTrainError(
                f"the checkpoint's data position is for {state['num_examples']} examples with seed {state['seed']}, "
                f"but this run has {len(self.examples)} examples with seed {self.seed}; resume with the same "
                "dataset and seed"
            )
        taken = epoch * len(self.examples) + position
        most = batches_drawn * self.batch_size * (self.seq_len if self.packing else 1)
        if not 0 <= position < len(self.examples) or not batches_drawn * self.batch_size <= taken <= most:
            raise LazyTrainError(f"the checkpoint's data position (epoch {epoch}, example {position}) does not fit "
                                 f"the {batches_drawn} batches of {self.batch_size} rows its step drew (step x "
                                 "gradient_accumulation_steps); the checkpoint is damaged, or the batch size or "
                                 "gradient_accumulation_steps changed: resume with the checkpoint's")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(self.epoch)


def eval_rows(examples: Sequence[Example], *, seq_len: int, packing: bool) -> list[list[Example]]:
    """Every example once, in order, as rows of at most `seq_len` tokens (packed end to end, or one a row)."""
    if examples:
        _check_lengths(examples, seq_len)
    rows: list[list[Example]] = []
    used = 0
    for ex in examples:
        if packing and rows and used + len(ex.input_ids) <= seq_len:
            rows[-1].append(ex)
            used += len(ex.input_ids)
        else:
            rows.append([ex])
            used = len(ex.input_ids)
    return rows


def eval_batches(examples: Sequence[Example], *, batch_size: int, seq_len: int, packing: bool,
                 pad_token_id: int, max_rows: int | None = None) -> list[Batch]:
    """Every example once (or those of the first `max_rows` rows), in order, as fixed-shape batches (a
    held-out loss comparable across steps). The last batch is filled up with all-padding rows (no loss), so every
    batch keeps the planned shape."""
    rows = eval_rows(examples, seq_len=seq_len, packing=packing)[:max_rows]
    batches = []
    for first in range(0, len(rows), batch_size):
        chunk = rows[first:first + batch_size]
        batches.append(_rows_to_batch(chunk + [[]] * (batch_size - len(chunk)), seq_len=seq_len, packing=packing,
                                      pad_token_id=pad_token_id))
    return batches
