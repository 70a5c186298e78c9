"""Training data: tokenizers, the embedded corpora, SFT formats and chat templates, the batch loader.

Modules (import the one you need; `sft` and `tokenizer` pull in `datasets` / `transformers`):
- `corpus`: the 259-id byte tokenizer and the embedded text corpora (stdlib docstrings, the Zen of Python).
- `loader`: `Example`, `Batch`, `Loader` — fixed-shape batches, packing or padding, exact resume.

The corpus names are re-exported here for code that still does `from lazytrain.data import ByteTokenizer`.
"""

from lazytrain.data.corpus import (
    CORPORA,
    MIN_DOCSTRING_CHARS,
    ByteTokenizer,
    TokenData,
    load_documents,
    stdlib_docstrings,
    zen_of_python,
)
from lazytrain.data.loader import IGNORE_INDEX, Batch, Example, Loader, eval_batches, step_num_tokens

__all__ = [
    "CORPORA", "IGNORE_INDEX", "MIN_DOCSTRING_CHARS", "Batch", "ByteTokenizer", "Example", "Loader", "TokenData",
    "eval_batches", "load_documents", "stdlib_docstrings", "step_num_tokens", "zen_of_python",
]
