"""Named chat templates (Jinja, as `tokenizer.chat_template` holds them) for tokenizers that ship none.

Each renders a list of `{"role", "content"}` messages (roles system, user, assistant) and, with
`add_generation_prompt`, opens an assistant turn. They are prefix-stable — the rendering of the first k
messages (with the generation prompt when message k+1 is the assistant's) is a prefix of the rendering of all
of them — which is how `sft.py` finds the assistant spans. An assistant turn ends with the template's stop
marker: `<|im_end|>` (chatml), `<|eot_id|>` (llama3), the tokenizer's EOS (alpaca).
"""

from __future__ import annotations

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

TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "alpaca": ALPACA}
