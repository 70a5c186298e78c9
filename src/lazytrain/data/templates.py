"""Chat templates: LLaMA-Factory's, by name, encoding a conversation into exactly the ids and labels LLaMA-Factory does.

`template: <name>` formats every conversation with LLaMA-Factory's (LF's) template of that name, whatever chat
template the tokenizer has, as LF does. The templates are data: `lf_templates.json` holds, per text template of LF's
`data/template.py`, its format strings (`user`, `assistant`, `system`, `prefix`), default system prompt, stop words
and switches. A format is a list of slots: a string with `{{content}}`, or `{{bos_token}}` / `{{eos_token}}` (the
tokenizer's id, when it has one) or `{{token:X}}` (the id of token X). Without `template`, the tokenizer's own chat
template renders the conversations (sft.py).

Encoding, as LF's `Template._encode` and its supervised processor:
- each slot is tokenized on its own (no special tokens added), so the ids are LF's, not those of the joined text;
- the first message opens with the prefix and the system message (the template's default system prompt when the
  row has none); `llama2`-kind templates (llama2, mistral, gemma) write the system text into the first user
  message instead;
- reasoning templates (qwen3, deepseekr1, ...) put an empty think block before a response that has none, trained
  (LF's `enable_thinking: true`);
- labels: every (prompt, response) pair's response trained, its prompt not (unless `train_on_prompt`);
  `efficient_eos` templates end the example with EOS and train EOS in place of each later prompt's first token;
- `cutoff_len` is shared pair by pair as LF's `infer_seqlen` shares it between prompt and response.

The tokenizer is fixed as LF fixes it (and saved so with every checkpoint): with `replace_eos`, the first stop
word becomes the EOS token (the turn's end marker trained, not a second EOS); the other stop words become special
tokens; a tokenizer without a chat template (or a template LF always installs) gets this one's, as Jinja.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # as data/loader.py (not imported: this module stays free of torch)
TABLE_FILE = Path(__file__).with_name("lf_templates.json")
BOS, EOS = "{{bos_token}}", "{{eos_token}}"

# The ChatML template as Jinja: the chat template of the tokenizer `train_bpe_tokenizer` makes.
CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Names of LF's vision / audio templates: refused (text models only).
_MEDIA = ("vl", "llava", "paligemma", "mllama", "pixtral", "video", "audio", "omni", "vision", "ocr", "minicpm_v",
          "minicpm_o", "glm4v", "glm4_5v", "gemma3n", "gemma4n")
Message = dict[str, str]


@dataclass(frozen=True)
class Template:
    """One LF template (an entry of lf_templates.json; see the module docstring)."""

    name: str
    user: tuple[str, ...]
    assistant: tuple[str, ...]
    system: tuple[str, ...]
    prefix: tuple[str, ...] = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False  # EOS once at the end, trained in place of later prompts' first token
    replace_eos: bool = False  # the first stop word becomes the EOS token
    replace_jinja_template: bool = False  # LF installs its Jinja even over the tokenizer's own
    kind: str = "plain"  # plain; llama2 (system text inside the first user message); reasoning; glm47
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")

    # ---- the tokenizer ---------------------------------------------------------------------------------
    def fix_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """EOS and stop words as LF's `fix_special_tokens` sets them."""
        stop_words = list(self.stop_words)
        if self.replace_eos:
            if tokenizer.eos_token != stop_words[0]:
                tokenizer.add_special_tokens({"eos_token": stop_words[0]})
            stop_words = stop_words[1:]
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if stop_words:
            try:
                tokenizer.add_special_tokens({"additional_special_tokens": stop_words},
                                             replace_additional_special_tokens=False)
            except TypeError:  # a tokenizer whose add_special_tokens has no such switch
                tokenizer.add_special_tokens({"additional_special_tokens": stop_words})
        if tokenizer.chat_template is None or self.replace_jinja_template:
            jinja = self.jinja(tokenizer)
            if jinja is not None:
                tokenizer.chat_template = jinja

    def jinja(self, tokenizer: PreTrainedTokenizerBase) -> str | None:
        """This template as a chat template (LF's `_get_jinja_template`), for inference with the saved tokenizer;
        None for a template with `{{token:X}}` slots (LF installs none either)."""
        parts = [_jinja_slots(s, tokenizer, placeholder) for s, placeholder in
                 ((self.prefix, "content"), (self.system, "system_message"), (self.user, "content"),
                  (self.assistant, "content"))]
        if any(part is None for part in parts):
            return None
        prefix, system, user, assistant = parts
        text = "{{ " + prefix + " }}" if prefix else ""
        if self.default_system:
            text += "{% set system_message = '" + _escape(self.default_system) + "' %}"
        text += ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
                 "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
                 "{% endif %}")
        if self.kind == "llama2":
            text += ("{% for message in loop_messages %}{% if loop.index0 == 0 and system_message is defined %}"
                     "{% set content = " + system + " + message['content'] %}{% else %}"
                     "{% set content = message['content'] %}{% endif %}")
        else:
            text += ("{% if system_message is defined %}{{ " + system + " }}{% endif %}"
                     "{% for message in loop_messages %}{% set content = message['content'] %}")
        return text + ("{% if message['role'] == 'user' %}{{ " + user + " }}{% elif message['role'] == 'assistant' %}"
                       "{{ " + assistant + " }}{% endif %}{% endfor %}")

    # ---- encoding ---------------------------------------------------------------------------------------
    def encode_pairs(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message]
                     ) -> list[tuple[list[int], list[int]]] | None:
        """(prompt ids, response ids) per turn; None for a conversation LF drops (not user / assistant turns in
        turn, ending with the assistant)."""
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
        roles = [m["role"] for m in turns]
        if not roles or len(roles) % 2 or roles != ["user", "assistant"] * (len(roles) // 2):
            return None
        system = system or self.default_system
        encoded = []
        for i, message in enumerate(turns):
            slots: list[str] = []
            content = message["content"]
            if i == 0:
                slots += self.prefix
                if system and self.kind == "llama2":
                    content = _fill(self.system[0], system) + content
                elif system:
                    slots += [_fill(s, system) for s in self.system]
            if message["role"] == "assistant" and self.kind in ("reasoning", "glm47") \
                    and self.thought_words[0].strip() not in content and self.thought_words[1].strip() not in content:
                empty_thought = self.thought_words[1] if self.kind == "glm47" else "".join(self.thought_words)
                encoded_thought = tokenizer.encode(empty_thought, add_special_tokens=False)
            else:
                encoded_thought = []
            slots += [_fill(s, content) for s in (self.user if message["role"] == "user" else self.assistant)]
            encoded.append(encoded_thought + _ids(tokenizer, slots))
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def encode(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], *, cutoff_len: int,
               train_on_prompt: bool) -> tuple[list[int], list[int], bool] | None:
        """(input_ids, labels, truncated) of one conversation as LF's supervised processor makes them; None for a
        conversation LF drops."""
        pairs = self.encode_pairs(tokenizer, messages)
        if pairs is None:
            return None
        input_ids: list[int] = []
        labels: list[int] = []
        total = 1 if self.efficient_eos else 0
        truncated = total + sum(len(p) + len(r) for p, r in pairs) > cutoff_len
        for turn, (prompt, response) in enumerate(pairs):
            if total >= cutoff_len:
                break
            prompt_len, response_len = infer_seqlen(len(prompt), len(response), cutoff_len - total)
            prompt, response = prompt[:prompt_len], response[:response_len]
            total += prompt_len + response_len
            if train_on_prompt:
                prompt_labels = prompt
            elif self.efficient_eos and turn != 0:
                prompt_labels = [tokenizer.eos_token_id] + [IGNORE_INDEX] * (prompt_len - 1)
            else:
                prompt_labels = [IGNORE_INDEX] * prompt_len
            input_ids += prompt + response
            labels += prompt_labels + response
        if self.efficient_eos:
            input_ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
        return input_ids, labels, truncated


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LF's split of a cutoff between a prompt and its response: a short response is kept whole and the prompt
    cut; a short prompt is kept and the response cut; else both in proportion to their lengths."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def _fill(slot: str, content: str) -> str:
    return slot if slot in (BOS, EOS) or slot.startswith("{{token:") else slot.replace("{{content}}", content, 1)


def _ids(tokenizer: PreTrainedTokenizerBase, slots: list[str]) -> list[int]:
    """LF's `_convert_elements_to_ids`: each string slot tokenized on its own."""
    ids: list[int] = []
    for slot in slots:
        if slot == BOS:
            ids += [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        elif slot == EOS:
            ids += [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        elif slot.startswith("{{token:"):
            ids.append(tokenizer.convert_tokens_to_ids(slot[len("{{token:"):-2]))
        elif slot:
            ids += tokenizer.encode(slot, add_special_tokens=False)
    return ids


def _escape(text: str) -> str:
    return text.replace("'", r"\'")


def _jinja_slots(slots: tuple[str, ...], tokenizer: PreTrainedTokenizerBase, placeholder: str) -> str | None:
    items = []
    for slot in slots:
        if slot in (BOS, EOS):
            token = tokenizer.bos_token if slot == BOS else tokenizer.eos_token
            if token is not None:
                items.append("'" + _escape(token) + "'")
        elif slot.startswith("{{token:"):
            return None
        else:
            before, found, after = slot.partition("{{content}}")
            items += (["'" + _escape(before) + "'"] if before else []) + ([placeholder] if found else []) + (
                ["'" + _escape(after) + "'"] if after else [])
    return " + ".join(items)


@cache
def _table() -> dict[str, dict]:
    return json.loads(TABLE_FILE.read_text(encoding="utf-8"))


def names() -> list[str]:
    """LF's text templates, by name."""
    return list(_table())


def check_template(name: str) -> None:
    """A vision / audio template, or a name LF does not have, is refused in one line (before anything loads)."""
    if any(marker in name for marker in _MEDIA):
        raise LazyTrainError(f"template {name} is a vision / audio template; LazyTrain trains text models: use the "
                             "text model's template (e.g. qwen for Qwen2-VL's language model) or leave template out")
    if name not in _table():
        near = difflib.get_close_matches(name, names(), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise LazyTrainError(f"template {name!r} is not one of LLaMA-Factory's templates; {hint}set template to one "
                             "of its names (qwen, qwen3, llama3, mistral, gemma, ...) or leave it out for the "
                             "tokenizer's own chat template")


def lf_template(name: str) -> Template:
    """LF's template `name`, checked."""
    check_template(name)
    entry = dict(_table()[name])
    fields = {key: tuple(value) if isinstance(value, list) else value for key, value in entry.items()}
    return Template(name=name, **fields)
