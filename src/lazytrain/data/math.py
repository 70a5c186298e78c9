"""An embedded MetaMathQA-like SFT set (short word problems, answers ending "The answer is N") and exact match.

MetaMathQA is what the paper fine-tunes on and judges its optimizer by (exact match of the final number). This
is its offline stand-in, sized for the default job: one-step addition and subtraction of small numbers in a
handful of phrasings, each solution a one-line chain of reasoning that restates the numbers, so a ~12 M
parameter model learns the format and much of the arithmetic in a few minutes on a CPU. Rows are `messages`
rows (user question, assistant solution), generated from a seed: the same seed gives the same set.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lazytrain.data.sft import Row

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe")
THINGS = ("apples", "books", "coins", "cards", "pens", "shells", "stamps", "marbles")

# (question, solution) per operation; {c} is the result. Each solution restates the numbers, then computes.
ADD = (
    ("{name} has {a} {thing}. {name} gets {b} more. How many {thing} does {name} have now?",
     "{name} starts with {a} {thing} and gets {b} more, so {a} + {b} = {c}."),
    ("There are {a} {thing} in a box. {name} puts in {b} more. How many {thing} are in the box?",
     "The box has {a} {thing} and {b} more go in, so {a} + {b} = {c}."),
    ("{name} found {a} {thing} on Monday and {b} {thing} on Tuesday. How many {thing} did {name} find?",
     "{name} found {a} and then {b}, so {a} + {b} = {c}."),
)
SUB = (
    ("{name} has {a} {thing}. {name} gives away {b}. How many {thing} does {name} have left?",
     "{name} starts with {a} {thing} and gives away {b}, so {a} - {b} = {c}."),
    ("There are {a} {thing} on a table. {name} takes {b} of them. How many {thing} are still on the table?",
     "The table has {a} {thing} and {b} are taken, so {a} - {b} = {c}."),
    ("{name} had {a} {thing} and lost {b}. How many {thing} does {name} have now?",
     "{name} had {a} and lost {b}, so {a} - {b} = {c}."),
)
ANSWER_PREFIX = "The answer is"
MAX_NEW_TOKENS = 48  # generation budget for exact match: solutions take at most 37 tokens of the default tokenizer
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def make_problem(rng: random.Random, max_operand: int) -> Row:
    """One problem as a `messages` row (user question, assistant solution ending "The answer is N")."""
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        question, solution = rng.choice(ADD)
        c = a + b
    else:
        a, b = max(a, b), min(a, b)
        question, solution = rng.choice(SUB)
        c = a - b
    values = dict(name=rng.choice(NAMES), thing=rng.choice(THINGS), a=a, b=b, c=c)
    return {"messages": [
        {"role": "user", "content": question.format(**values)},
        {"role": "assistant", "content": f"{solution.format(**values)} {ANSWER_PREFIX} {c}."},
    ]}


def math_problems(num_train: int, num_heldout: int, *, seed: int = 0,
                  max_operand: int = 9) -> tuple[list[Row], list[Row]]:
    """(train, held-out) problems; no held-out question appears in the training set."""
    rng = random.Random(seed)
    train = [make_problem(rng, max_operand) for _ in range(num_train)]
    seen = {row["messages"][0]["content"] for row in train}
    heldout: list[Row] = []
    for _ in range(100 * num_heldout + 100):  # bounded: a tiny max_operand has few distinct questions
        if len(heldout) == num_heldout:
            break
        row = make_problem(rng, max_operand)
        if row["messages"][0]["content"] not in seen:
            seen.add(row["messages"][0]["content"])
            heldout.append(row)
    return train, heldout


def extract_final_number(text: str) -> str | None:
    """The number after the last "The answer is" (else the last number in the text), without thousands commas."""
    tail = text.rsplit(ANSWER_PREFIX, 1)[1] if ANSWER_PREFIX in text else text
    numbers = re.findall(_NUMBER, tail)
    if not numbers:
        return None
    number = (numbers[0] if ANSWER_PREFIX in text else numbers[-1]).replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def reference_answer(row: Row) -> str:
    """The row's assistant solution (its last message)."""
    return str(row["messages"][-1]["content"])


def score(predictions: Sequence[str], problems: Sequence[Row]) -> float:
    """Fraction of predictions whose final number equals the reference solution's."""
    if not problems:
        return 0.0
    hits = sum(extract_final_number(p) is not None and extract_final_number(p) == extract_final_number(
        reference_answer(row)) for p, row in zip(predictions, problems, strict=True))
    return hits / len(problems)


@torch.no_grad()
def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[Row], *,
                     max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 32) -> list[str]:
    """Greedy completions of each problem's prompt (its messages but the last, through the chat template)."""
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues at the right
    was_training = model.training
    model.eval()
    answers = []
    try:
        for first in range(0, len(problems), batch_size):
            prompts = [tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
                       for row in problems[first:first + batch_size]]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return answers


def exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[Row], *,
                max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 32) -> float:
    """Fraction of problems whose greedy answer ends in the reference's final number (the paper's metric)."""
    answers = generate_answers(model, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return score(answers, problems)
