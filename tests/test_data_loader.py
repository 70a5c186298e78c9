"""The batch loader: packing and padding layouts, per-epoch shuffles, exact resume (`lazytrain.data.loader`)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lazytrain.data.loader import IGNORE_INDEX, Example, Loader, eval_batches, step_num_tokens
from lazytrain.errors import LazyTrainError

RNG = random.Random()
PAD = 0


def _examples(n: int, *, max_len: int, seed: int) -> list[Example]:
    """Fresh random examples; token ids 1.. (0 is the pad id), each example's first id unique (its name),
    labels -100 on a random prompt prefix (as SFT makes them)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, max_len)
        ids = [1000 + i] + [rng.randint(1, 999) for _ in range(length - 1)]
        prompt = rng.randint(0, length - 1)
        out.append(Example(input_ids=ids, labels=[IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _segments(row_positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed segment: a new one starts where position_ids == 0."""
    starts = (row_positions == 0).nonzero().flatten().tolist() + [len(row_positions)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def test_packing_restarts_positions_and_masks_each_examples_first_label():
    examples = _examples(40, max_len=12, seed=RNG.randrange(2**30))
    by_name = {ex.input_ids[0]: ex for ex in examples}
    loader = Loader(examples, batch_size=3, seq_len=32, packing=True, pad_token_id=PAD, seed=RNG.randrange(2**30))
    seen = []
    while len(seen) < len(examples):
        batch = loader.next()
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (3, 32)
        assert batch.attention_mask is None and batch.input_ids.dtype == torch.int64
        assert batch.num_tokens == int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        for r in range(3):
            for start, end in _segments(batch.position_ids[r]):
                assert batch.position_ids[r, start:end].tolist() == list(range(end - start))
                ids, labels = batch.input_ids[r, start:end].tolist(), batch.labels[r, start:end].tolist()
                if ids[0] in by_name:  # a packed example: its tokens, its labels but the first
                    ex = by_name[ids[0]]
                    assert ids == ex.input_ids and labels == [IGNORE_INDEX] + ex.labels[1:]
                    seen.append(ids[0])
                else:  # the row's padded tail: last segment, no loss
                    assert end == 32 and set(ids) == {PAD} and set(labels) == {IGNORE_INDEX}
        assert batch.num_examples == sum(1 for r in range(3) for s, _ in _segments(batch.position_ids[r])
                                         if batch.input_ids[r, s].item() in by_name)
    assert sorted(seen[:len(examples)]) == sorted(by_name)  # the first epoch: every example exactly once


def test_packing_fills_rows_greedily_without_splitting_examples():
    lengths = [5, 4, 3, 6, 2]
    examples = [Example(input_ids=[7] * n, labels=[7] * n) for n in lengths]
    loader = Loader(examples, batch_size=1, seq_len=10, packing=True, pad_token_id=PAD, seed=0)
    order = [lengths[i] for i in loader._permutation(0)]
    rows = []
    while sum(len(r) for r in rows) < len(lengths):
        batch = loader.next()
        rows.append([e - s for s, e in _segments(batch.position_ids[0]) if batch.input_ids[0, s] != PAD])
    expected, row = [], []  # greedy: an example that does not fit starts the next row
    for n in order:
        if sum(row) + n > 10:
            expected.append(row)
            row = []
        row.append(n)
    expected.append(row)
    assert rows[:len(expected)] == expected


def test_padding_one_example_per_row_with_attention_mask():
    examples = _examples(10, max_len=9, seed=RNG.randrange(2**30))
    by_name = {ex.input_ids[0]: ex for ex in examples}
    loader = Loader(examples, batch_size=2, seq_len=9, packing=False, pad_token_id=PAD, seed=RNG.randrange(2**30))
    for _ in range(5):
        batch = loader.next()
        assert batch.position_ids is None and batch.attention_mask.shape == (2, 9) and batch.num_examples == 2
        for r in range(2):
            ex = by_name[batch.input_ids[r, 0].item()]
            n = len(ex.input_ids)
            assert batch.attention_mask[r].tolist() == [1] * n + [0] * (9 - n)
            assert batch.input_ids[r].tolist() == ex.input_ids + [PAD] * (9 - n)
            assert batch.labels[r].tolist() == ex.labels + [IGNORE_INDEX] * (9 - n)
        assert batch.num_tokens == sum(
            sum(label != IGNORE_INDEX for label in by_name[batch.input_ids[r, 0].item()].labels[1:]) for r in range(2))


def test_shuffles_without_replacement_per_epoch_and_differently_each_epoch():
    n = 24
    examples = _examples(n, max_len=6, seed=RNG.randrange(2**30))
    loader = Loader(examples, batch_size=4, seq_len=6, packing=False, pad_token_id=PAD, seed=RNG.randrange(2**30))
    epochs = []
    for epoch in range(3):
        assert loader.epoch == epoch
        names = [name for b in loader.take(n // 4) for name in b.input_ids[:, 0].tolist()]
        assert sorted(names) == sorted(ex.input_ids[0] for ex in examples)  # each example exactly once
        epochs.append(names)
    assert loader.epoch == 3
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(1000, 1000 + n))
    same_seed = Loader(examples, batch_size=4, seq_len=6, packing=False, pad_token_id=PAD, seed=loader.seed)
    assert [name for b in same_seed.take(n // 4) for name in b.input_ids[:, 0].tolist()] == epochs[0]


@pytest.mark.parametrize("packing", [True, False])
def test_resume_from_state_dict_gives_the_same_following_batches(packing):
    examples = _examples(30, max_len=10, seed=RNG.randrange(2**30))
    kwargs = dict(batch_size=3, seq_len=16, packing=packing, pad_token_id=PAD, seed=RNG.randrange(2**30))
    uninterrupted = Loader(examples, **kwargs)
    drawn = RNG.randint(3, 14)
    uninterrupted.take(drawn)  # stop mid-epoch (or in a later one)
    state = uninterrupted.state_dict()
    expected = uninterrupted.take(25)  # crosses at least one epoch boundary
    resumed = Loader(examples, **kwargs)
    resumed.load_state_dict(dict(state), drawn)
    for want, got in zip(expected, resumed.take(25), strict=True):
        assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.labels, got.labels)
        assert want.num_tokens == got.num_tokens
    assert resumed.state_dict() == uninterrupted.state_dict()


@pytest.mark.parametrize("packing", [True, False])
def test_a_data_position_that_does_not_fit_the_step_is_refused(packing):
    """The position must fit the batches the checkpoint's step drew: each takes batch_size examples, with packing at
    most seq_len a row. An epoch of 10**30, another step's position or a value that is no integer is refused."""
    examples = _examples(30, max_len=10, seed=RNG.randrange(2**30))
    kwargs = dict(batch_size=3, seq_len=16, packing=packing, pad_token_id=PAD, seed=7)
    drawn = RNG.randint(3, 14)
    loader = Loader(examples, **kwargs)
    loader.take(drawn)
    state = loader.state_dict()
    Loader(examples, **kwargs).load_state_dict(dict(state), drawn)  # its own step: fits
    for bad, batches in (({**state, "epoch": 10**30}, drawn), (state, drawn + 40), ({**state, "position": "3"}, drawn),
                         ({**state, "epoch": True}, drawn), ({"epoch": 0}, drawn)):
        with pytest.raises(LazyTrainError, match="the checkpoint's data position") as err:
            Loader(examples, **kwargs).load_state_dict(dict(bad), batches)
        assert "\n" not in str(err.value)


def test_step_num_tokens_is_known_before_running_the_micro_batches():
    loader = Loader(_examples(20, max_len=8, seed=RNG.randrange(2**30)), batch_size=2, seq_len=8, packing=True,
                    pad_token_id=PAD, seed=1)
    micro = loader.take(4)
    assert step_num_tokens(micro) == sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in micro) > 0


@pytest.mark.parametrize("packing", [True, False])
def test_eval_batches_cover_every_example_once_in_full_shape(packing):
    examples = _examples(11, max_len=7, seed=RNG.randrange(2**30))
    batches = eval_batches(examples, batch_size=4, seq_len=8, packing=packing, pad_token_id=PAD)
    assert all(b.input_ids.shape == (4, 8) for b in batches)
    assert sum(b.num_examples for b in batches) == len(examples)
    if not packing:
        assert len(batches) == 3 and batches[-1].attention_mask[3].all()  # filler rows attend to themselves
        assert (batches[-1].labels[3:] == IGNORE_INDEX).all()


def test_bad_inputs_are_one_line_errors():
    examples = _examples(5, max_len=5, seed=0)
    with pytest.raises(LazyTrainError, match="no examples"):
        Loader([], batch_size=1, seq_len=8, packing=True, pad_token_id=PAD, seed=0)
    with pytest.raises(LazyTrainError, match="cutoff_len"):
        Loader(examples + [Example([1] * 9, [1] * 9)], batch_size=1, seq_len=8, packing=True, pad_token_id=PAD,
               seed=0)
    loader = Loader(examples, batch_size=1, seq_len=8, packing=True, pad_token_id=PAD, seed=0)
    with pytest.raises(LazyTrainError, match="same dataset and seed"):
        loader.load_state_dict({"epoch": 0, "position": 1, "seed": 1, "num_examples": 5}, 1)
    with pytest.raises(LazyTrainError, match="labels"):
        Example([1, 2], [1])


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("epochs", [0.3, 1.0, 2.5, 1e6])
def test_num_train_epochs_become_steps_as_the_hf_trainer_counts_them(packing, epochs):
    """ceil(epochs x max(1, batches of one epoch // gradient_accumulation_steps)), from one epoch's layout: a
    million epochs cost what one does (a huge `num_train_epochs` once spun in a loop over every batch)."""
    import time

    from lazytrain.config import load_job_config
    from lazytrain.job.resolve import steps_for_epochs

    gen = torch.Generator().manual_seed(11)
    examples = []
    for _ in range(37):
        ids = torch.randint(0, 50, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        examples.append(Example(input_ids=ids, labels=[-100] + ids[1:]))
    loader = Loader(examples, batch_size=3, seq_len=12, packing=packing, pad_token_id=0, seed=4)
    fresh = Loader(examples, batch_size=3, seq_len=12, packing=packing, pad_token_id=0, seed=4)
    per_epoch = 0
    while fresh.epoch == 0:  # the batches that start in the first epoch
        fresh.next()
        per_epoch += 1
    job = load_job_config(dict(model="qwen2.5-7b", num_train_epochs=epochs, gradient_accumulation_steps=2))
    assert job.optim.max_steps == -1  # a user's model: HF's default, the epochs decide
    t0 = time.perf_counter()
    steps = steps_for_epochs(job, loader).optim.max_steps
    assert time.perf_counter() - t0 < 1.0
    assert steps == math.ceil(epochs * max(1, per_epoch // 2))
