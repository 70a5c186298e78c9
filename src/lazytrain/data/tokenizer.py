"""Tokenizers: a model directory's own (`AutoTokenizer`, local files only), or a small byte-level BPE trained here.

The trained one is what the default job and the tests use, since nothing may be downloaded: GPT-2-style
byte-level BPE (any text round-trips), every digit its own token (as Llama 3 and Qwen2 split them, so numbers
are spelled digit by digit), ChatML special tokens and the ChatML chat template; it saves as the usual
Hugging Face files (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) that
`AutoTokenizer.from_pretrained` loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lazytrain.data.templates import CHATML
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"  # also the document separator of plain-text training data
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"  # ends every assistant turn of the ChatML template, so generation stops there


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local model directory; a missing pad token becomes the EOS token."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise LazyTrainError(
            f"no usable tokenizer in {model_dir} ({reason}); the model directory needs its tokenizer files "
            "(tokenizer.json or tokenizer.model with tokenizer_config.json)"
        ) from None
    if tokenizer.eos_token_id is None:
        raise LazyTrainError(f"the tokenizer in {model_dir} has no EOS token; set eos_token in its "
                             "tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding carries no loss and no attention: any id will do
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most `vocab_size` ids (fewer when the texts run out of merges),
    digits split individually, ChatML special tokens and chat template. Deterministic for the same texts."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise LazyTrainError(f"vocab_size {vocab_size} is too small: byte-level BPE needs 256 byte tokens plus "
                             f"{len(SPECIAL_TOKENS)} special tokens")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   chat_template=CHATML)
