"""Training data for `lazytrain train`: a byte-level tokenizer, an embedded corpus, seeded batches.

No downloads: the default corpus ("stdlib") is the English prose that ships with every Python —
the docstrings of the standard library's top-level modules, read with `ast` from the running
interpreter's own source files (nothing is imported, so no module side effects). It is about
0.8 MB on CPython 3.11. "zen" is the Zen of Python (about 0.8 kB, the same text in every Python
version), for tiny debug runs and golden tests. Any other value is a path to a UTF-8 text file.

The tokenizer maps bytes to ids 0..255 and adds three specials (BOS, EOS, PAD), so any text
round-trips exactly and the vocabulary is 259 ids.
"""

from __future__ import annotations

import ast
import codecs
import importlib.util
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.config import CORPORA
from lazytrain.data.loader import IGNORE_INDEX
from lazytrain.data.sources import check_file_or_folder
from lazytrain.errors import LazyTrainError

MIN_DOCSTRING_CHARS = 80  # shorter docstrings ("Return x.") are mostly noise for a language model


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS=256, EOS=257, PAD=258."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Bytes back to text; specials are dropped, invalid UTF-8 (a cut multi-byte char) is replaced."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# ---- corpora ----------------------------------------------------------------------------------
def stdlib_docstrings() -> list[str]:
    """Docstrings (modules, classes, functions) of the stdlib's top-level `*.py` files, in file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a broken or odd file in a patched install is not worth failing a demo for
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    documents.append(doc)
    if not documents:
        raise LazyTrainError(
            f"no standard-library sources found under {stdlib} (a stripped Python install?); "
            "pass --corpus PATH to a text file instead"
        )
    return documents


def zen_of_python() -> str:
    """The Zen of Python, decoded from `this.py` without importing it (importing prints it)."""
    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise LazyTrainError("the stdlib module 'this' is missing; pass --corpus PATH to a text file instead")
    source = Path(spec.origin).read_text(encoding="utf-8")
    # `this.py` is `s = """<rot13 text>"""` followed by code that decodes and prints it; read only the literal.
    first = ast.parse(source).body[0]
    if not isinstance(first, ast.Assign) or not isinstance(first.value, ast.Constant):
        raise LazyTrainError(f"{spec.origin} does not start with the Zen's text; pass --corpus PATH instead")
    return codecs.decode(first.value.value, "rot13")


def load_documents(corpus: str) -> list[str]:
    """The documents of a corpus: "stdlib", "zen" or a path to a UTF-8 text file (one document)."""
    if corpus == "stdlib":
        return stdlib_docstrings()
    if corpus == "zen":
        return [zen_of_python()]
    path = Path(corpus)
    check_file_or_folder(path, "corpus")
    try:
        return [path.read_text(encoding="utf-8")]
    except FileNotFoundError:
        raise LazyTrainError(
            f"corpus {corpus!r} is neither a built-in corpus ({', '.join(CORPORA)}) nor an existing file; "
            "set --corpus"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise LazyTrainError(f"corpus file {path} cannot be read as UTF-8 text: {err}") from None


# ---- token stream and batches -----------------------------------------------------------------
@dataclass(frozen=True)
class TokenData:
    """A corpus as one token stream (documents joined by EOS), split into train and held-out parts."""

    train: torch.Tensor  # (N_train,) int64 token ids
    val: torch.Tensor  # (N_val,) int64 token ids; the last `val_fraction` of the stream

    @classmethod
    def from_corpus(cls, corpus: str, tokenizer: ByteTokenizer, val_fraction: float = 0.05) -> TokenData:
        if not 0.0 <= val_fraction < 1.0:
            raise LazyTrainError(f"val_fraction must be in [0, 1), got {val_fraction}")
        ids: list[int] = []
        for doc in load_documents(corpus):
            ids.extend(tokenizer.encode(doc))
            ids.append(tokenizer.eos_id)
        tokens = torch.tensor(ids, dtype=torch.int64)
        num_val = int(len(tokens) * val_fraction)
        return cls(train=tokens[: len(tokens) - num_val], val=tokens[len(tokens) - num_val :])

    def check_fits(self, seq_len: int, split: str = "train") -> None:
        size = len(getattr(self, split))
        if size < seq_len:
            raise LazyTrainError(
                f"the {split} split has {size} tokens, fewer than one sequence of --seq-len {seq_len}; "
                "lower --seq-len or use a larger --corpus"
            )

    def batches(self, batch_size: int, seq_len: int, seed: int,
                split: str = "train") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (input_ids, labels), each (batch_size, seq_len): random windows drawn by a seeded generator.

        Labels equal the inputs (the Hugging Face convention: the model shifts them by one inside its loss).
        """
        self.check_fits(seq_len, split)
        tokens = getattr(self, split)
        generator = torch.Generator().manual_seed(seed)
        offsets = torch.arange(seq_len)
        while True:
            starts = torch.randint(0, len(tokens) - seq_len + 1, (batch_size,), generator=generator)
            input_ids = tokens[starts[:, None] + offsets]  # (B, T)
            yield input_ids, input_ids.clone()

    def fixed_batches(self, num_batches: int, batch_size: int, seq_len: int, seed: int,
                      split: str = "val") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same `num_batches` random batches every call (the calibration's probe batch)."""
        stream = self.batches(batch_size, seq_len, seed, split)
        return [next(stream) for _ in range(num_batches)]

    def num_held_out_windows(self, seq_len: int) -> int:
        """How many windows `held_out_batches` lays the held-out split out in."""
        n = len(self.val)
        return 0 if n < seq_len else n // seq_len + (n % seq_len > 0)

    def held_out_batches(self, batch_size: int, seq_len: int, max_windows: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole held-out split: consecutive windows of `seq_len` (the last one ends at the split's end, its
        tokens scored before carry no label), `batch_size` windows a batch, the last batch filled with rows that
        carry no label. An eval loss over the whole split (or its first `max_windows`), the same every call."""
        tokens, n = self.val, len(self.val)
        if n < seq_len:
            return []
        starts = list(range(0, n - seq_len + 1, seq_len))
        tail = n - (starts[-1] + seq_len)  # tokens after the last whole window
        if tail:
            starts.append(n - seq_len)
        if max_windows is not None and max_windows < len(starts):
            starts, tail = starts[:max_windows], 0
        if not starts:
            return []
        offsets = torch.arange(seq_len)
        windows = tokens[torch.tensor(starts)[:, None] + offsets]  # (W, T)
        labels = windows.clone()
        if tail:
            labels[-1, : seq_len - tail] = IGNORE_INDEX  # already scored in the window before
        batches = []
        for first in range(0, len(starts), batch_size):
            ids, lab = windows[first:first + batch_size], labels[first:first + batch_size]
            fill = batch_size - len(ids)
            if fill:
                ids = torch.cat([ids, ids[:1].expand(fill, -1)])
                lab = torch.cat([lab, torch.full((fill, seq_len), IGNORE_INDEX, dtype=lab.dtype)])
            batches.append((ids, lab))
        return batches
