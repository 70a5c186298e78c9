"""LLaMA-Factory's templates encode a conversation into LF's own ids and labels.

tests/data/lf_templates/golden.json holds, for every text template of LF's data/template.py, the input_ids and
labels LF's `SupervisedDatasetProcessor._encode_data_example` made (LF's code run once, off-line, with the
tokenizer in that folder; labels written as one character per position: `.` ignored, `=` the input id trained,
`e` EOS trained in its place), for four conversations: one turn with and without a system message, two turns with
one, and two turns cut by cutoff_len 24. Each is checked here on the same tokenizer with and without a chat
template of its own (LF's template wins either way). The readable cases below were derived by reading LF's code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lazytrain.data.templates import CHATML, check_template, infer_seqlen, lf_template, names
from lazytrain.errors import LazyTrainError

DATA = Path(__file__).parent / "data" / "lf_templates"
GOLDEN = json.loads((DATA / "golden.json").read_text(encoding="utf-8"))
BASE = AutoTokenizer.from_pretrained(str(DATA))


def _labels(ids: list[int], mask: str, eos: int) -> list[int]:
    return [-100 if m == "." else i if m == "=" else eos for i, m in zip(ids, mask, strict=True)]


def _tokenizer(chat_template: str | None):
    tokenizer = copy.deepcopy(BASE)
    tokenizer.chat_template = chat_template
    return tokenizer


def test_every_text_template_of_lf_is_in_the_table():
    assert sorted(GOLDEN["templates"]) == sorted(names())
    for name in ("qwen", "qwen3", "qwen3_nothink", "llama3", "llama2", "mistral", "gemma", "gemma3", "chatml",
                 "alpaca", "default", "empty", "deepseek3", "glm4", "phi", "phi4", "yi", "cohere"):
        assert name in names()


@pytest.mark.parametrize("own", [None, CHATML], ids=["no-chat-template", "chat-template"])
@pytest.mark.parametrize("name", sorted(GOLDEN["templates"]))
def test_ids_and_labels_are_lfs(name, own):
    expected = GOLDEN["templates"][name]
    tokenizer = _tokenizer(own)
    template = lf_template(name)
    template.fix_tokenizer(tokenizer)
    assert tokenizer.eos_token == expected["eos_token"] and len(tokenizer) == expected["vocab"]
    for case, messages in GOLDEN["cases"].items():
        cutoff = GOLDEN["cutoff_len"].get(case, 1024)
        ids, labels, truncated = template.encode(tokenizer, messages, cutoff_len=cutoff, train_on_prompt=False)
        want = expected[case]
        assert ids == want["input_ids"], (name, case)
        assert labels == _labels(want["input_ids"], want["labels"], tokenizer.eos_token_id), (name, case)
        assert truncated == (case == "multi_turn_cut") and len(ids) <= cutoff


def _render(name: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    """(the whole example, the trained tokens) as text, special tokens written out."""
    tokenizer = _tokenizer(None)
    template = lf_template(name)
    template.fix_tokenizer(tokenizer)
    ids, labels, _ = template.encode(tokenizer, messages, cutoff_len=1024, train_on_prompt=False)
    return tokenizer.decode(ids), tokenizer.decode([t for t in labels if t != -100])


ONE = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the cat"}]
SYS = [{"role": "system", "content": "be kind"}, *ONE]
TWO = [*SYS, {"role": "user", "content": "and"}, {"role": "assistant", "content": "a dog"}]


def test_qwen_default_system_and_the_newline_after_im_end_trained():
    whole, trained = _render("qwen", ONE)
    assert whole == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                     "<|im_end|>\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\nthe cat<|im_end|>\n")
    assert trained == "the cat<|im_end|>\n"  # replace_eos: <|im_end|> is EOS, no second EOS


def test_qwen3_puts_an_empty_think_block_in_the_trained_response():
    whole, trained = _render("qwen3", TWO)
    assert whole == ("<|im_start|>system\nbe kind<|im_end|>\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\n"
                     "<think>\n\n</think>\n\nthe cat<|im_end|>\n<|im_start|>user\nand<|im_end|>\n"
                     "<|im_start|>assistant\n<think>\n\n</think>\n\na dog<|im_end|>\n")
    assert trained == "<think>\n\n</think>\n\nthe cat<|im_end|>\n<think>\n\n</think>\n\na dog<|im_end|>\n"
    assert _render("qwen3_nothink", ONE) == ("<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\nthe cat"
                                             "<|im_end|>\n", "the cat<|im_end|>\n")


def test_llama3_and_llama2_and_mistral():
    assert _render("llama3", SYS) == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nbe kind<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nwhy<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nthe cat<|eot_id|>", "the cat<|eot_id|>")
    assert _render("llama2", TWO) == ("<s>[INST] <<SYS>>\nbe kind\n<</SYS>>\n\nwhy [/INST]the cat</s><s>[INST] and "
                                      "[/INST]a dog</s>", "the cat</s>a dog</s>")
    assert _render("mistral", SYS) == ("<s>[INST] be kind\n\nwhy[/INST] the cat</s>", " the cat</s>")


def test_efficient_eos_trains_eos_in_place_of_the_next_prompts_first_token():
    tokenizer = _tokenizer(None)
    template = lf_template("glm4")
    template.fix_tokenizer(tokenizer)
    ids, labels, _ = template.encode(tokenizer, TWO, cutoff_len=1024, train_on_prompt=False)
    second = tokenizer.convert_tokens_to_ids("<|user|>")
    at = [i for i, t in enumerate(ids) if t == second][1]  # the second turn's <|user|>
    assert labels[at] == tokenizer.eos_token_id and ids[-1] == labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == ("[gMASK]<sop><|system|>\nbe kind<|user|>\nwhy<|assistant|>\nthe cat<|user|>\nand"
                                     "<|assistant|>\na dog</s>")


def test_a_conversation_lf_drops_is_none():
    template = lf_template("qwen")
    assert template.encode(BASE, ONE[:1], cutoff_len=64, train_on_prompt=False) is None
    assert template.encode(BASE, ONE + ONE[:1], cutoff_len=64, train_on_prompt=False) is None
    assert template.encode(BASE, ONE[::-1], cutoff_len=64, train_on_prompt=False) is None


@pytest.mark.parametrize("source, target, cutoff, expected", [
    (100, 10, 50, (40, 10)),  # a short response kept whole
    (10, 100, 50, (10, 40)),  # a short prompt kept whole
    (60, 40, 50, (30, 20)),  # both cut in proportion
    (3, 4, 50, (3, 4)),
])
def test_infer_seqlen(source, target, cutoff, expected):
    assert infer_seqlen(source, target, cutoff) == expected


def test_the_jinja_installed_renders_as_the_template_encodes():
    for name in ("qwen", "llama3", "llama2", "alpaca"):
        tokenizer = _tokenizer(None)
        template = lf_template(name)
        template.fix_tokenizer(tokenizer)
        ids, _, _ = template.encode(tokenizer, TWO, cutoff_len=1024, train_on_prompt=False)
        rendered = tokenizer.apply_chat_template(TWO, tokenize=False)
        assert rendered == tokenizer.decode(ids), name


@pytest.mark.parametrize("name, needle", [("qwen2_vl", "vision / audio template"),
                                          ("qwen4", "not one of LLaMA-Factory's templates"),
                                          ("lama3", "did you mean llama3")])
def test_unknown_and_vision_templates_are_refused(name, needle):
    with pytest.raises(LazyTrainError, match=needle):
        check_template(name)
