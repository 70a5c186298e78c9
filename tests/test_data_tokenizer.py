"""The trained BPE tokenizer and loading a model directory's tokenizer (`lazytrain.data.tokenizer`)."""

from __future__ import annotations

import random

import pytest
from checks import one_line
from transformers import AutoTokenizer

from lazytrain.data.corpus import zen_of_python
from lazytrain.data.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer, train_bpe_tokenizer
from lazytrain.errors import LazyTrainError

RNG = random.Random()


def _random_text(n: int) -> str:
    """Fresh text with digit runs, words, punctuation, newlines and multi-byte characters."""
    pieces = ["Beautiful", " is", " better", " 2026", "7", " 31415", "\n", "  ", ".", "é", "日本", "\U0001f600", "x1y2"]
    return "".join(RNG.choice(pieces) for _ in range(n))


def test_trained_tokenizer_round_trips_through_auto_tokenizer_with_digits_split(tmp_path):
    trained = train_bpe_tokenizer([zen_of_python(), "1234567890 " * 20, "100 200 300"], vocab_size=500)
    assert len(trained) <= 500
    trained.save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == len(trained) and tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.chat_template == trained.chat_template and "<|im_start|>" in tok.chat_template
    for _ in range(5):
        text = _random_text(RNG.randint(5, 40))
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
        digit_tokens = [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
        assert all(len(t.lstrip("Ġ")) == 1 for t in digit_tokens), digit_tokens  # one digit per token
        assert tok.convert_ids_to_tokens(tok("1234", add_special_tokens=False).input_ids) == ["1", "2", "3", "4"]
    specials = tok("<|im_start|>user<|im_end|>", add_special_tokens=False).input_ids
    assert specials[0] == tok.convert_tokens_to_ids("<|im_start|>") and specials[-1] == tok.eos_token_id


def test_load_tokenizer_from_a_model_dir_and_its_errors(tmp_path):
    trained = train_bpe_tokenizer([zen_of_python()], vocab_size=300)
    trained.save_pretrained(str(tmp_path / "model"))
    tok = load_tokenizer(tmp_path / "model")
    assert tok.pad_token_id is not None and tok.eos_token_id == trained.eos_token_id
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(LazyTrainError, match="no usable tokenizer") as err:
            load_tokenizer(where)
        one_line(str(err.value))
    with pytest.raises(LazyTrainError, match="too small"):
        train_bpe_tokenizer(["x"], vocab_size=100)
