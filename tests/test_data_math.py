"""The embedded math SFT set, final-number extraction, exact match and the default job's model directory."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lazytrain.data.default_job_files import prepare_default_job, read_jsonl
from lazytrain.data.math import (
    MAX_NEW_TOKENS,
    exact_match,
    extract_final_number,
    generate_answers,
    math_problems,
    reference_answer,
    score,
)
from lazytrain.data.sft import load_sft
from lazytrain.errors import LazyTrainError

RNG = random.Random()
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_problems_are_seeded_correct_and_held_out_questions_are_new():
    seed, max_operand = RNG.randrange(2**30), RNG.randint(5, 30)
    train, heldout = math_problems(300, 40, seed=seed, max_operand=max_operand)
    assert (train, heldout) == math_problems(300, 40, seed=seed, max_operand=max_operand)
    assert len(heldout) == 40
    assert not {r["messages"][0]["content"] for r in heldout} & {r["messages"][0]["content"] for r in train}
    for row in train + heldout:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        a, op, b, c = re.search(r"(\d+) ([+-]) (\d+) = (\d+)\.", assistant["content"]).groups()
        assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert assistant["content"].endswith(f"The answer is {c}.") and a in user["content"]
        assert max(int(a), int(b)) <= max_operand


def test_extract_final_number():
    assert extract_final_number("so 3 + 4 = 7. The answer is 7.") == "7"
    assert extract_final_number("The answer is 12 and then 5") == "12"
    assert extract_final_number("The answer is: -1,234.") == "-1234"
    assert extract_final_number("it is 3.0") == "3"
    assert extract_final_number("no digits here") is None and extract_final_number("The answer is") is None


def test_reference_answers_score_one_and_wrong_ones_zero():
    _, heldout = math_problems(10, 30, seed=RNG.randrange(2**30))
    assert score([reference_answer(r) for r in heldout], heldout) == 1.0
    wrong = [f"The answer is {int(extract_final_number(reference_answer(r))) + 1}" for r in heldout]
    assert score(wrong, heldout) == 0.0
    assert score(["The answer is 5"] * 2, heldout[:2]) == sum(
        extract_final_number(reference_answer(r)) == "5" for r in heldout[:2]) / 2


def test_default_job_dir_loads_with_auto_classes_and_is_cached(tmp_path):
    job = prepare_default_job(tmp_path / "job", shapes=SHAPES, num_train=200, num_heldout=20, seed=1)
    config = AutoConfig.from_pretrained(job.model_dir)
    tok = AutoTokenizer.from_pretrained(job.model_dir)
    assert config.vocab_size == len(tok) and not config.tie_word_embeddings and config.hidden_size == 32
    assert config.eos_token_id == tok.eos_token_id and tok.chat_template
    assert not list(job.model_dir.glob("*.safetensors"))  # weights come from the model loader's random init
    stamp = (job.model_dir / "tokenizer.json").stat().st_mtime_ns
    assert prepare_default_job(tmp_path / "job", shapes=SHAPES, num_train=200, num_heldout=20, seed=1) == job
    assert (job.model_dir / "tokenizer.json").stat().st_mtime_ns == stamp  # not retrained
    data = load_sft(job.train_file, tok, cutoff_len=128, eval_dataset=job.eval_file)
    assert len(data.examples) == 200 and len(data.val) == 20 and data.num_truncated == 0
    assert read_jsonl(job.eval_file) == math_problems(200, 20, seed=1)[1]
    train_rows = read_jsonl(job.train_file)  # every solution (and its EOS) fits the generation budget
    assert max(len(tok(reference_answer(r), add_special_tokens=False).input_ids) for r in train_rows) < MAX_NEW_TOKENS
    prepare_default_job(tmp_path / "job", shapes=SHAPES, num_train=100, num_heldout=20, seed=1)  # a new recipe
    assert json.loads((tmp_path / "job" / "recipe.json").read_text())["num_train"] == 100
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(LazyTrainError, match="not empty"):
        prepare_default_job(tmp_path / "other", shapes=SHAPES)


def _random_model_and_problems(tmp_path, *, num_train: int, seed: int):
    """The default job's tokenizer, a freshly random model of its config, and its 6 held-out problems."""
    job = prepare_default_job(tmp_path / "job", shapes=SHAPES, num_train=num_train, num_heldout=6, seed=seed)
    tok = AutoTokenizer.from_pretrained(job.model_dir)
    torch.manual_seed(RNG.randrange(2**30))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(job.model_dir))
    return tok, model, read_jsonl(job.eval_file)


def test_exact_match_runs_greedy_generation_through_a_tiny_random_model(tmp_path):
    tok, model, problems = _random_model_and_problems(tmp_path, num_train=100, seed=2)
    value = exact_match(model, tok, problems, max_new_tokens=6, batch_size=4)
    assert 0.0 <= value <= 1.0 and model.training and tok.padding_side == "right"



def test_batched_left_padded_generation_equals_one_problem_at_a_time(tmp_path):
    """Left padding must not change a greedy answer: prompts of different lengths, batched or alone."""
    tok, model, problems = _random_model_and_problems(tmp_path, num_train=50, seed=4)
    prompts = [tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in problems]
    lengths = {len(tok(prompt).input_ids) for prompt in prompts}
    assert len(lengths) > 1  # the batch really is padded
    alone = [generate_answers(model, tok, [row], max_new_tokens=8)[0] for row in problems]
    assert generate_answers(model, tok, problems, max_new_tokens=8, batch_size=len(problems)) == alone
