"""The chat template of a model: its own `tokenizer.chat_template`, or a documented fallback.

A model without a template (a base model such as our Gemma 3 270M) gets the format of its
family, written as jinja with exactly the text of llama.cpp's built-in formats
(`llm_chat_apply_template` in src/llama-chat.cpp). The family is found from the vocabulary's
marker tokens, tested in the order llama.cpp's `llm_chat_detect_template` tests template text.
Without any marker it is an error that says what to set. Nothing here tokenizes.
"""

from __future__ import annotations

from typing import Any

from retrograd.errors import TokenizerError
from retrograd.tokenizer.codec import Tokenizer
from retrograd.tokenizer.template import ChatTemplate

# Each fallback is llama.cpp's built-in format for the family, as jinja.
FALLBACKS: dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    # Gemma has no system role: system text is trimmed and opens the first user turn.
    "gemma": (
        "{%- set ns = namespace(system='') -%}"
        "{%- for message in messages -%}"
        "{%- if message.role == 'system' -%}{%- set ns.system = ns.system + message.content | trim -%}"
        "{%- else -%}"
        "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
        "{{- '<start_of_turn>' + role + '\\n' -}}"
        "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}"
        "{%- set ns.system = '' -%}{%- endif -%}"
        "{{- message.content | trim + '<end_of_turn>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    "llama3": (
        "{%- for message in messages -%}"
        "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' -}}"
        "{{- message.content | trim + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
    "phi3": (
        "{%- for message in messages -%}"
        "{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    ),
    # llama.cpp's "mistral-v7": system in [SYSTEM_PROMPT], no generation prompt of its own.
    "mistral-v7": (
        "{%- for message in messages -%}"
        "{%- if message.role == 'system' -%}{{- '[SYSTEM_PROMPT] ' + message.content + '[/SYSTEM_PROMPT]' -}}"
        "{%- elif message.role == 'user' -%}{{- '[INST] ' + message.content + '[/INST]' -}}"
        "{%- else -%}{{- ' ' + message.content + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    # llama.cpp's "mistral-v3": [INST] turns, system text before the user text.
    "mistral": (
        "{%- set ns = namespace(inside=false) -%}"
        "{%- for message in messages -%}"
        "{%- if not ns.inside -%}{{- '[INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}"
        "{%- if message.role == 'system' -%}{{- message.content + '\\n\\n' -}}"
        "{%- elif message.role == 'user' -%}{{- message.content + '[/INST]' -}}"
        "{%- else -%}{{- ' ' + message.content | trim + '</s>' -}}{%- set ns.inside = false -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
    ),
}

# (family, marker tokens that must all be in the vocabulary), in llama.cpp's detection order
_DETECT = [
    ("chatml", ("<|im_start|>", "<|im_end|>")),
    ("mistral-v7", ("[INST]", "[SYSTEM_PROMPT]")),
    ("mistral", ("[INST]", "[/INST]")),
    ("phi3", ("<|assistant|>", "<|end|>")),
    ("gemma", ("<start_of_turn>", "<end_of_turn>")),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>")),
]


def detect_family(tokenizer: Tokenizer) -> str | None:
    """The fallback family whose marker tokens the vocabulary has, or None."""
    for family, markers in _DETECT:
        if all(tokenizer.token_id(m) is not None for m in markers):
            return family
    return None


def special_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A special token's text as templates see it (bos_token, eos_token)."""
    if token_id < 0:
        return ""
    return tokenizer.token_to_piece(token_id, special=True).decode("utf-8", "replace")


def chat_template(
    tokenizer: Tokenizer,
    metadata: dict,
    variables: dict[str, Any] | None = None,
    override: str | None = None,
) -> ChatTemplate:
    """The template a model renders conversations with.

    `override` (template source, or a fallback family name) wins over the file's
    `tokenizer.chat_template`; without either the family fallback applies.
    """
    bos = special_text(tokenizer, tokenizer.bos_id)
    eos = special_text(tokenizer, tokenizer.eos_id)
    source = override or metadata.get("tokenizer.chat_template")
    if source and source not in FALLBACKS:
        return ChatTemplate(
            str(source), bos, eos, variables, name="gguf" if not override else "override"
        )
    family = source or detect_family(tokenizer)
    if family is None:
        raise TokenizerError(
            "the model has no chat template (tokenizer.chat_template) and its vocabulary has "
            "none of the marker tokens of a known family; set a chat template explicitly "
            f"(jinja source or one of: {', '.join(FALLBACKS)})"
        )
    return ChatTemplate(FALLBACKS[family], bos, eos, variables, name=family)
