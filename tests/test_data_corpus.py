"""The byte tokenizer, the embedded corpora and the seeded batch iterator of `lazytrain train`."""

from __future__ import annotations

import random

import pytest

from lazytrain.data.corpus import (
    MIN_DOCSTRING_CHARS,
    ByteTokenizer,
    TokenData,
    load_documents,
    stdlib_docstrings,
    zen_of_python,
)
from lazytrain.errors import LazyTrainError

torch = pytest.importorskip("torch")

RNG = random.Random(20261202)


def _random_text(n: int) -> str:
    """Fresh text each run (seeded) mixing ASCII, accented letters, CJK and an emoji: 1-4 byte UTF-8."""
    alphabet = "abcdefghij XYZ\n\t.,;" + "éüßø" + "日本語" + "\U0001f600"
    return "".join(RNG.choice(alphabet) for _ in range(n))


def test_tokenizer_round_trips_any_text_and_drops_specials():
    tok = ByteTokenizer()
    text = _random_text(RNG.randrange(50, 200))
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    with_specials = [tok.bos_id, *ids, tok.eos_id, tok.pad_id]
    assert tok.decode(torch.tensor(with_specials)) == text
    assert tok.vocab_size == 259 and len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3


def test_zen_is_the_decoded_text():
    zen = zen_of_python()
    assert zen.startswith("The Zen of Python, by Tim Peters")
    assert "Beautiful is better than ugly." in zen


def test_stdlib_corpus_is_prose_and_deterministic():
    docs = stdlib_docstrings()
    assert sum(len(d) for d in docs) > 200_000  # ~0.8 MB on CPython 3.11
    assert all(len(d) >= MIN_DOCSTRING_CHARS for d in docs)
    assert docs == stdlib_docstrings()


def test_token_data_from_file_splits_train_and_held_out(tmp_path):
    text = _random_text(RNG.randrange(2000, 3000))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    tok = ByteTokenizer()
    data = TokenData.from_corpus(str(path), tok, val_fraction=0.1)
    stream = torch.cat([data.train, data.val])
    assert stream.tolist() == tok.encode(text) + [tok.eos_id]
    assert len(data.val) == int(len(stream) * 0.1)


def test_batches_are_seeded_windows_of_the_train_split():
    tok = ByteTokenizer()
    data = TokenData.from_corpus("zen", tok)
    batch, seq = RNG.randrange(2, 6), RNG.randrange(8, 40)
    seed = RNG.randrange(1000)
    first = next(data.batches(batch, seq, seed))
    again = next(data.batches(batch, seq, seed))
    other = next(data.batches(batch, seq, seed + 1))
    input_ids, labels = first
    assert input_ids.shape == (batch, seq) and input_ids.dtype == torch.int64
    assert torch.equal(input_ids, labels)  # HF convention: the model shifts
    assert torch.equal(input_ids, again[0]) and not torch.equal(input_ids, other[0])
    train = data.train.tolist()
    for row in input_ids.tolist():  # every row is a contiguous window of the train stream
        assert any(train[s:s + seq] == row for s in range(len(train) - seq + 1))


def test_fixed_batches_come_from_the_held_out_split_and_repeat():
    tok = ByteTokenizer()
    data = TokenData.from_corpus("zen", tok, val_fraction=0.2)
    seq = RNG.randrange(8, 30)
    a = data.fixed_batches(3, 2, seq, seed=5)
    b = data.fixed_batches(3, 2, seq, seed=5)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    val = data.val.tolist()
    for input_ids, _ in a:
        for row in input_ids.tolist():
            assert any(val[s:s + seq] == row for s in range(len(val) - seq + 1))


def test_errors_name_the_knob(tmp_path):
    data = TokenData.from_corpus("zen", ByteTokenizer())
    with pytest.raises(LazyTrainError, match="--seq-len"):
        next(data.batches(2, len(data.train) + 1, seed=0))
    with pytest.raises(LazyTrainError, match="--corpus"):
        load_documents(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    with pytest.raises(LazyTrainError, match="UTF-8"):
        load_documents(str(bad))
