"""SFT data: formats, auto-detection, chat templates, response-only labels, truncation, splits, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pytest
from checks import one_line

from lazytrain.data.corpus import zen_of_python
from lazytrain.data.loader import IGNORE_INDEX, Example
from lazytrain.data.sft import load_rows, load_sft, split_off, tokenize_rows
from lazytrain.data.templates import infer_seqlen
from lazytrain.data.tokenizer import train_bpe_tokenizer
from lazytrain.errors import LazyTrainError

RNG = random.Random()
CONVERSATION = [  # two turns; the expected renderings below are written out by hand
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! 12"},
    {"role": "user", "content": "And 3+4?"},
    {"role": "assistant", "content": "7"},
]


@pytest.fixture(scope="module")
def tokenizer_factory():
    texts = [zen_of_python(), "Hi there Hello And user assistant Instruction Response 0123456789"]
    return lambda: train_bpe_tokenizer(texts, vocab_size=400)  # fresh each call: tests change its template


def _runs(tokenizer, example: Example) -> list[tuple[str, bool]]:
    """The example as maximal runs of (decoded text, carries loss)."""
    runs: list[tuple[list[int], bool]] = []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        trained = label != IGNORE_INDEX
        if trained:
            assert label == token
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(token)
        else:
            runs.append(([token], trained))
    return [(tokenizer.decode(ids), trained) for ids, trained in runs]


def test_chat_template_labels_exactly_the_assistant_spans(tokenizer_factory):
    tok = tokenizer_factory()  # its own ChatML template; EOS = <|im_end|>, so no second EOS is appended
    [example] = tokenize_rows([{"messages": CONVERSATION}], tok, cutoff_len=512).examples
    assert _runs(tok, example) == [
        ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", False),
        ("Hello! 12<|im_end|>\n", True),
        ("<|im_start|>user\nAnd 3+4?<|im_end|>\n<|im_start|>assistant\n", False),
        ("7<|im_end|>", True),
    ]


def test_named_templates_label_exactly_the_assistant_spans(tokenizer_factory):
    tok = tokenizer_factory()
    tok.chat_template = None
    [alpaca] = tokenize_rows([{"messages": CONVERSATION}], tok, template="alpaca", cutoff_len=512).examples
    assert _runs(tok, alpaca) == [  # LLaMA-Factory's: its default system prompt, EOS and a blank line trained
        ("Below is an instruction that describes a task. Write a response that appropriately completes the "
         "request.\n\n### Instruction:\nHi there\n\n### Response:\n", False),
        ("Hello! 12<|im_end|>\n\n", True),
        ("### Instruction:\nAnd 3+4?\n\n### Response:\n", False),
        ("7<|im_end|>\n\n", True),
    ]
    tok.chat_template = None
    [llama3] = tokenize_rows([{"messages": CONVERSATION}], tok, template="llama3", cutoff_len=512).examples
    assert _runs(tok, llama3) == [  # <|eot_id|> replaces the tokenizer's EOS (LF's replace_eos): no second one
        ("<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant"
         "<|end_header_id|>\n\n", False),
        ("Hello! 12<|eot_id|>", True),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd 3+4?<|eot_id|><|start_header_id|>assistant"
         "<|end_header_id|>\n\n", False),
        ("7<|eot_id|>", True),
    ]
    assert tok.eos_token == "<|eot_id|>"


def test_train_on_prompt_trains_every_token(tokenizer_factory):
    tok = tokenizer_factory()
    [example] = tokenize_rows([{"messages": CONVERSATION}], tok, train_on_prompt=True, cutoff_len=512).examples
    assert example.labels == example.input_ids


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _random_words(n: int) -> str:
    return " ".join(RNG.choice(["one", "two", "Hi", "there", "12", "7", "is", "the"]) for _ in range(n))


def test_each_format_loads_from_jsonl_and_is_detected(tmp_path, tokenizer_factory):
    tok = tokenizer_factory()
    q, a, q0, a0, sys_prompt, extra = (_random_words(RNG.randint(1, 6)) for _ in range(6))
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    cases = {  # format: (row, the same conversation as messages)
        "alpaca": ({"instruction": q, "input": extra, "output": a, "system": sys_prompt, "history": [[q0, a0]]},
                   [{"role": "system", "content": sys_prompt}, {"role": "user", "content": q0},
                    {"role": "assistant", "content": a0}, {"role": "user", "content": f"{q}\n{extra}"},
                    {"role": "assistant", "content": a}]),
        "sharegpt": ({"conversations": [{"from": "system", "value": sys_prompt}, {"from": "human", "value": q},
                                        {"from": "gpt", "value": a}]},
                     [{"role": "system", "content": sys_prompt}, *messages]),
        "messages": ({"messages": messages}, messages),
        "prompt_completion": ({"prompt": [messages[0]], "completion": [messages[1]]}, messages),
    }
    for fmt, (row, conversation) in cases.items():
        data = load_sft(_write(tmp_path / f"{fmt}.jsonl", [row]), tok, cutoff_len=512)
        assert data.dataset_format == fmt and data.num_rows == 1
        assert data.examples == tokenize_rows([{"messages": conversation}], tok, cutoff_len=512).examples, fmt

    data = load_sft(_write(tmp_path / "pc.jsonl", [{"prompt": q, "completion": " " + a}]), tok, cutoff_len=512)
    prompt_ids, completion_ids = tok(q).input_ids, tok(" " + a).input_ids  # raw strings: no template
    assert data.examples == [Example(prompt_ids + completion_ids + [tok.eos_token_id],
                                     [IGNORE_INDEX] * len(prompt_ids) + completion_ids + [tok.eos_token_id])]
    data = load_sft(_write(tmp_path / "text.jsonl", [{"text": q}]), tok, cutoff_len=512)
    assert data.dataset_format == "text" and data.examples == [Example(tok(q).input_ids + [tok.eos_token_id],
                                                                       tok(q).input_ids + [tok.eos_token_id])]


def test_rows_missing_a_column_read_as_none_are_skipped_or_empty(tmp_path, tokenizer_factory):
    tok = tokenizer_factory()
    rows = [{"instruction": "Hi there", "input": "12", "output": "7"}, {"instruction": "Hi there"}]
    data = load_sft(_write(tmp_path / "a.jsonl", rows), tok, cutoff_len=512)  # datasets fills output: None
    assert data.dataset_format == "alpaca" and len(data.examples) == 1 and data.num_skipped == 1
    assert "None" not in tok.decode(data.examples[0].input_ids)


def test_parquet_arrow_and_json_files_give_the_same_rows(tmp_path):
    rows = [{"instruction": _random_words(3), "output": _random_words(2)} for _ in range(5)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "d.parquet", tmp_path / "saved", arrow, tmp_path / "d.json"):
        assert load_rows(path) == rows, path


def test_truncation_and_skips_are_counted(tokenizer_factory):
    tok = tokenizer_factory()
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:1]},  # no assistant turn: skipped
            {"messages": [{"role": "user", "content": "Hi there " * 40}, {"role": "assistant", "content": "7"}]}]
    full = tokenize_rows(rows[:1], tok, cutoff_len=512).examples[0]
    first_response = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    cutoff = first_response + 2  # inside the first response
    data = tokenize_rows(rows, tok, cutoff_len=cutoff)
    assert data.num_truncated == 2 and data.num_skipped == 1
    # LLaMA-Factory's cut (infer_seqlen): the first pair shares the cutoff between its prompt and its response
    response_end = next(i for i in range(first_response, len(full.labels)) if full.labels[i] == IGNORE_INDEX)
    keep_prompt, keep_response = infer_seqlen(first_response, response_end - first_response, cutoff)
    kept = list(range(keep_prompt)) + list(range(first_response, first_response + keep_response))
    assert data.examples[0] == Example([full.input_ids[i] for i in kept], [full.labels[i] for i in kept])
    # a prompt longer than the cutoff is cut from its end and the short response ("7" and EOS) kept whole
    long = tokenize_rows(rows[2:], tok, cutoff_len=512).examples[0]
    assert data.examples[1] == Example(long.input_ids[:cutoff - 2] + long.input_ids[-2:],
                                       long.labels[:cutoff - 2] + long.labels[-2:])
    assert tok.decode(long.input_ids[-2:]) == "7<|im_end|>" and long.labels[-2:] == long.input_ids[-2:]


def test_val_split_by_fraction_or_count_is_disjoint_and_seeded():
    examples = [Example([i, i + 1], [i, i + 1]) for i in range(50)]
    seed = RNG.randrange(2**30)
    train, val = split_off(examples, 0.1, seed)
    assert len(val) == 5 and len(train) == 45 and sorted(train + val, key=lambda e: e.input_ids) == examples
    assert split_off(examples, 0.1, seed) == (train, val)
    assert len(split_off(examples, 7, seed)[1]) == 7
    with pytest.raises(LazyTrainError, match="val_size"):
        split_off(examples, 50, seed)


def test_eval_file_is_the_held_out_set(tmp_path, tokenizer_factory):
    tok = tokenizer_factory()
    train = _write(tmp_path / "t.jsonl", [{"messages": CONVERSATION}] * 3)
    held_out = _write(tmp_path / "e.jsonl", [{"messages": CONVERSATION[:2]}] * 2)
    data = load_sft(train, tok, cutoff_len=512, eval_dataset=held_out, val_size=0.5)
    assert len(data.examples) == 3 and len(data.val) == 2


def test_bad_inputs_are_one_line_errors(tmp_path, tokenizer_factory):
    tok = tokenizer_factory()
    cases = [
        (lambda: load_rows(tmp_path / "missing.jsonl"), "does not exist"),
        (lambda: load_rows(_write(tmp_path / "empty.jsonl", [])), "is empty"),
        (lambda: load_rows(tmp_path), "is a folder but not one written by datasets' save_to_disk"),
        (lambda: load_sft(_write(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}]), tok, cutoff_len=64),
         r"columns \(answer, question\).*dataset_format"),
        (lambda: tokenize_rows([{"question": "q"}], tok, dataset_format="alpaca", cutoff_len=64),
         "needs the column.*instruction.*have question"),
        (lambda: tokenize_rows([{"conversations": [{"from": "bot", "value": "x"}]}], tok, cutoff_len=64),
         'row 1 \\(sharegpt\\): turn 1 has from "bot"; expected one of'),
        (lambda: tokenize_rows([{"messages": CONVERSATION}], tok, template="qwen2_vl", cutoff_len=64),
         "template qwen2_vl is a vision / audio template"),
    ]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    cases.append((lambda: load_rows(tmp_path / "bad.jsonl"), "line 1: not JSON"))
    for call, message in cases:
        with pytest.raises(LazyTrainError, match=message) as err:
            call()
        one_line(str(err.value))
    tok.chat_template = None
    with pytest.raises(LazyTrainError, match="no chat template; set template to the model's LLaMA-Factory"):
        tokenize_rows([{"messages": CONVERSATION}], tok, cutoff_len=64)
    with pytest.raises(LazyTrainError, match="template 'qwen4' is not one of LLaMA-Factory's templates"):
        tokenize_rows([{"messages": CONVERSATION}], tok, template="qwen4", cutoff_len=64)
    # plain text needs no template
    assert tokenize_rows([{"text": "Hi there"}], tok, cutoff_len=64).examples


CHATML_WITH_GENERATION_TAGS = (  # ChatML marking the assistant spans for transformers' own mask
    "{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_masks_equal_transformers_assistant_tokens_mask_on_random_conversations(tokenizer_factory):
    """An independent check: `apply_chat_template(return_assistant_tokens_mask=True)` on a template with
    {% generation %} tags marks the same tokens (ours stop at the final EOS, without its trailing newline)."""
    tok = tokenizer_factory()
    tok.chat_template = CHATML_WITH_GENERATION_TAGS
    for _ in range(10):
        messages = [{"role": "system", "content": _random_words(RNG.randint(1, 5))}] if RNG.random() < 0.5 else []
        for _ in range(RNG.randint(1, 4)):
            messages += [{"role": "user", "content": _random_words(RNG.randint(1, 8))},
                         {"role": "assistant", "content": _random_words(RNG.randint(1, 8))}]
        [example] = tokenize_rows([{"messages": messages}], tok, cutoff_len=4096).examples
        reference = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert example.input_ids == reference["input_ids"][:-1]
        assert [label != IGNORE_INDEX for label in example.labels] == [
            bool(m) for m in reference["assistant_masks"][:-1]]
