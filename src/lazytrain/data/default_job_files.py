"""What `lazytrain train` with no arguments fine-tunes, made offline: a small HF model directory and a math SFT set.

`prepare_default_job(directory, shapes=...)` writes
- `model/`: a BPE tokenizer trained on the math set's text and the Zen of Python (digits split, ChatML chat
  template; a few seconds), and a Llama `config.json` + `generation_config.json` of the given shapes with
  the tokenizer's vocabulary and an untied head. No weights: the model loader's `init: random` builds them.
- `math_train.jsonl`, `math_eval.jsonl`: `messages` rows from `math.py` (held-out questions never in train).
The directory is reused as it is when its recipe (`recipe.json`) matches, so the tokenizer is trained once
per directory; it is written under a temporary name and renamed, so a killed run leaves none half-made (and the
next preparation removes the temporary a killed one left).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig, LlamaConfig

from lazytrain.data.corpus import zen_of_python
from lazytrain.data.math import math_problems
from lazytrain.data.sft import Row
from lazytrain.data.tokenizer import train_bpe_tokenizer
from lazytrain.errors import LazyTrainError
from lazytrain.writes import remove_dead_temporaries

RECIPE_VERSION = 1  # bump when what this module writes changes, so cached directories are remade
VOCAB_SIZE = 1024  # an upper bound: BPE stops earlier when the texts run out of merges (~660 ids)


@dataclass(frozen=True)
class DefaultJob:
    """Paths of a prepared default job."""

    model_dir: Path  # tokenizer files + config.json + generation_config.json (no weights)
    train_file: Path  # messages jsonl
    eval_file: Path  # messages jsonl, the held-out problems exact match is measured on


def _write_jsonl(path: Path, rows: list[Row]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[Row]:
    """Rows of a jsonl file written here (no `datasets` round trip: the eval problems, as they were made)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_model_dir(path: Path, *, shapes: dict[str, int], texts: list[str], max_position_embeddings: int) -> None:
    """A tokenizer trained on `texts` and a Llama config sized to its vocabulary, saved as an HF directory."""
    tokenizer = train_bpe_tokenizer(texts, vocab_size=VOCAB_SIZE)
    tokenizer.save_pretrained(str(path))
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, **shapes)
    config.save_pretrained(str(path))
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=False).save_pretrained(str(path))


def prepare_default_job(directory: str | Path, *, shapes: dict[str, int], num_train: int = 4000,
                        num_heldout: int = 200, max_operand: int = 9, max_position_embeddings: int = 1024,
                        seed: int = 0) -> DefaultJob:
    """Make (or reuse) the default job's model directory and data files under `directory`."""
    directory = Path(directory)
    recipe = dict(version=RECIPE_VERSION, shapes=shapes, num_train=num_train, num_heldout=num_heldout,
                  max_operand=max_operand, max_position_embeddings=max_position_embeddings, seed=seed)
    job = DefaultJob(model_dir=directory / "model", train_file=directory / "math_train.jsonl",
                     eval_file=directory / "math_eval.jsonl")
    recipe_file = directory / "recipe.json"
    if recipe_file.exists() and json.loads(recipe_file.read_text()) == recipe:
        return job
    if directory.exists() and any(directory.iterdir()) and not recipe_file.exists():
        raise LazyTrainError(f"{directory} is not empty and holds no default job (no recipe.json); choose another "
                             "directory for the default job's model and data")
    train, heldout = math_problems(num_train, num_heldout, seed=seed, max_operand=max_operand)
    texts = [f"{m['role']}\n{m['content']}" for row in train for m in row["messages"]] + [zen_of_python()]
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    remove_dead_temporaries(directory.parent, directory.name)  # what a killed preparation left
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "model").mkdir(parents=True)
    write_model_dir(staging / "model", shapes=shapes, texts=texts, max_position_embeddings=max_position_embeddings)
    _write_jsonl(staging / job.train_file.name, train)
    _write_jsonl(staging / job.eval_file.name, heldout)
    (staging / recipe_file.name).write_text(json.dumps(recipe, indent=1) + "\n")
    if recipe_file.exists() and json.loads(recipe_file.read_text()) == recipe:  # another process made it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        return job
    shutil.rmtree(directory, ignore_errors=True)  # an older recipe's directory (checked above: ours)
    staging.rename(directory)
    return job
