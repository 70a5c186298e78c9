"""Chat templates: LLaMA-Factory's template names resolved to the tokenizer's own chat template, or ours.

`template: qwen` (or llama3, mistral, gemma, chatml, alpaca, default, empty, ...) means: the model's tokenizer's own
chat template when it has one (it is what the model was trained with, and what inference will use), else our
template of that family below. Vision / audio templates (qwen2_vl, llava, ...) are refused: LazyTrain trains text
models. Which template was used is said in the run's report.

Ours are Jinja, as `tokenizer.chat_template` holds them. Each renders a list of `{"role", "content"}` messages
(roles system, user, assistant) and, with `add_generation_prompt`, opens an assistant turn. They are
prefix-stable — the rendering of the first k messages (with the generation prompt when message k+1 is the
assistant's) is a prefix of the rendering of all of them — which is how `sft.py` finds the assistant spans. An
assistant turn ends with the template's stop marker: `<|im_end|>` (chatml), `<|eot_id|>` (llama3),
`<end_of_turn>` (gemma), the tokenizer's EOS (alpaca, mistral, default).
"""

from __future__ import annotations

from lazytrain.errors import LazyTrainError

CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

# Stanford Alpaca's layout; the user turn already opens the response, so the generation prompt adds nothing.
ALPACA = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ '### Instruction:\n' + message['content'] + '\n\n### Response:\n' }}"
    "{%- else -%}{{ message['content'] + eos_token + '\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

MISTRAL = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else -%}{{ message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

GEMMA = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' + message['content'] "
    "+ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# LLaMA-Factory's `default`: Human / Assistant turns.
DEFAULT = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ 'System: ' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Human: ' + message['content'] + '\nAssistant:' }}"
    "{%- else -%}{{ message['content'] + eos_token + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# LLaMA-Factory's `empty`: the contents alone, one after the other.
EMPTY = "{%- for message in messages -%}{{ message['content'] }}{%- endfor -%}"

TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "alpaca": ALPACA, "mistral": MISTRAL,
                             "gemma": GEMMA, "default": DEFAULT, "empty": EMPTY}
# LLaMA-Factory's template names (data/template.py) of text models, by the family of ours each falls back to.
FAMILIES: dict[str, str] = {
    **dict.fromkeys(("qwen", "qwen3", "qwen3_nothink", "qwen3_5", "qwen3_5_nothink", "qwen3_6", "chatml",
                     "chatml_de", "yi", "openchat", "dbrx", "sailor", "opencoder", "smollm", "smollm2"), "chatml"),
    **dict.fromkeys(("llama3", "llama4"), "llama3"),
    **dict.fromkeys(("mistral", "ministral", "mistral_small", "ministral3"), "mistral"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3"), "gemma"),
    "alpaca": "alpaca", "default": "default", "empty": "empty",
}
# Names of vision / audio templates: refused (text models only).
_MEDIA = ("vl", "llava", "paligemma", "mllama", "pixtral", "video", "audio", "omni", "vision", "ocr", "minicpm_v",
          "minicpm_o", "glm4v", "glm4_5v", "gemma3n", "gemma4n")


def choose_template(name: str | None, has_own: bool) -> tuple[str | None, str]:
    """(our template's text to install, or None to keep the tokenizer's own; what was used, for the report)."""
    if name is not None and any(marker in name for marker in _MEDIA):
        raise LazyTrainError(f"template {name} is a vision / audio template; LazyTrain trains text models: use the "
                             "text model's template (e.g. qwen for Qwen2-VL's language model) or leave template out")
    if has_own:
        return None, ("the tokenizer's own chat template" + (f" (template {name})" if name else ""))
    if name is None:
        raise LazyTrainError(f"the tokenizer has no chat template; set template to one of {', '.join(TEMPLATES)} "
                             "(or a LLaMA-Factory name such as qwen, llama3, mistral, gemma)")
    family = FAMILIES.get(name, name if name in TEMPLATES else None)
    if family is None:
        raise LazyTrainError(f"unknown template {name!r} and the tokenizer has no chat template of its own; use one of "
                             f"{', '.join(sorted(set(FAMILIES) | set(TEMPLATES)))}")
    return TEMPLATES[family], f"LazyTrain's {family} template (template {name}; the tokenizer has none)"
