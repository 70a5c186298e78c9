"""Each rank's share of the global batch, resumable: the same global batches as one process.

One process with `per_device_train_batch_size x world_size` draws global batch k from the seeded order; here
every rank draws the same global batch k from the same seeded order (the order costs nothing next to a step)
and keeps its rows `rank * B : (rank + 1) * B`. So the ranks together see exactly the single process's batches,
and the position in the order (the source's state) is the same on every rank: one state resumes them all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from lazytrain.data.loader import Batch, count_loss_tokens
from lazytrain.distributed.ranks import Ranks
from lazytrain.errors import LazyTrainError


class BatchSource(Protocol):
    def next(self) -> Batch: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state: dict[str, object], batches_drawn: int) -> None: ...


class RankBatches:
    """Rows `rank * batch_size : (rank + 1) * batch_size` of every global batch of `source`."""

    def __init__(self, source: BatchSource, ranks: Ranks, batch_size: int) -> None:
        self.source = source
        self.ranks = ranks
        self.rows = slice(ranks.rank * batch_size, (ranks.rank + 1) * batch_size)

    def next(self) -> Batch:
        return self.rows_of(self.source.next())

    def rows_of(self, batch: Batch) -> Batch:
        """This rank's rows of a global batch (training, or held-out: the ranks evaluate a global batch together)."""
        rows = [None if t is None else t[self.rows].contiguous()
                for t in (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)]
        input_ids, labels, attention_mask, position_ids = rows
        return replace(batch, input_ids=input_ids, labels=labels, attention_mask=attention_mask,
                       position_ids=position_ids, num_tokens=count_loss_tokens(labels),
                       num_examples=input_ids.shape[0] if position_ids is None else int((position_ids == 0).sum()))

    def state_dict(self) -> dict[str, object]:
        return {**self.source.state_dict(), "world_size": self.ranks.world_size}

    def load_state_dict(self, state: dict[str, object], batches_drawn: int) -> None:
        check_world_size(state, self.ranks.world_size)
        self.source.load_state_dict({k: v for k, v in state.items() if k != "world_size"}, batches_drawn)


def check_batches_drawn(data_state: dict[str, object], batches_drawn: int) -> None:
    """A text corpus's position (`consumed`: batches given) is the batches the checkpoint's step drew (step x
    gradient_accumulation_steps): checked as the checkpoint is read, before anything is built, since walking to it
    draws every one of them. A dataset's position (epoch, example) is its loader's to check: it needs the data."""
    if "consumed" not in data_state:
        return
    consumed = data_state["consumed"]
    if consumed != batches_drawn or isinstance(consumed, bool) or set(data_state) - {"consumed", "world_size"}:
        raise LazyTrainError(f"the checkpoint's data position {str(data_state)[:120]} is not the {batches_drawn} "
                             "batches its step drew (step x gradient_accumulation_steps); the checkpoint is damaged, "
                             "or gradient_accumulation_steps changed: resume with the checkpoint's")


def check_world_size(data_state: dict[str, object], world_size: int) -> None:
    """Refuse to resume a checkpoint of another world size (its data position counts other global batches)."""
    saved = int(data_state.get("world_size", 1))  # type: ignore[call-overload]
    if saved != world_size:
        raise LazyTrainError(f"the checkpoint was written by a run of {saved} rank(s) and this run has {world_size}; "
                             f"resume with torchrun --nproc_per_node {saved} (the data order and the global batch "
                             "depend on the world size)")
