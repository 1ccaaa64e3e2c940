"""Chat templates: render `tokenizer.chat_template` the way transformers and llama.cpp do.

A sandboxed jinja2 environment with the globals and filters real templates use
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, loop controls,
`namespace`). `ChatTemplate.render` takes messages, tools, `add_generation_prompt`, the BOS/EOS
strings and the run's `template_variables`; the names the renderer sets itself are refused as
variables. This module knows nothing about ids or masks (conversation.py) nor about which
template a model lacks (fallbacks.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from retrograd.errors import ConfigError, TokenizerError

RESERVED = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt"})

# A tool and a result no real conversation contains: seen in the output means the template
# renders tools itself.
_PROBE_TOOL = "retrograd_probe_tool_7f3a"
_PROBE_RESULT = "retrograd_probe_result_7f3a"


class TemplateError(TokenizerError):
    """A chat template cannot be compiled or raised an error while rendering."""


def _raise(message: str) -> None:
    raise TemplateError(f"chat template refused the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kw) -> str:
    # transformers' tojson: non-ASCII kept, keys in insertion order unless sort_keys
    return json.dumps(
        value,
        indent=indent,
        ensure_ascii=ensure_ascii,
        sort_keys=bool(kw.get("sort_keys", False)),
        separators=kw.get("separators"),
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): the body
    renders unchanged; masks come from conversation.py, not from these markers."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def check_variables(variables: dict[str, Any], where: str = "template_variables") -> None:
    """Refuse run variables that would overwrite what the renderer passes."""
    for name in variables:
        if name in RESERVED:
            raise ConfigError(
                f"{where}.{name}: reserved by the chat template renderer "
                f"(reserved names: {', '.join(sorted(RESERVED))})"
            )


class ChatTemplate:
    """One compiled chat template with the BOS/EOS strings and run variables it renders with.

    `name` says where the source came from ("gguf" or a fallback family such as "gemma").
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        variables: dict[str, Any] | None = None,
        name: str = "gguf",
    ):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.variables = dict(variables or {})
        self.name = name
        check_variables(self.variables)
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template ({name}) does not compile: line {e.lineno}: {e.message}"
            ) from None

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text of `messages`, as transformers' apply_chat_template renders it."""
        context = {**self.variables, **extra}
        context.update(
            messages=messages,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=add_generation_prompt,
        )
        if tools:
            context["tools"] = tools
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(
                f"chat template ({self.name}) tried an unsafe operation: {e}"
            ) from None
        except jinja2.TemplateError as e:
            raise TemplateError(
                f"chat template ({self.name}) failed: {type(e).__name__}: {e}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(
                f"chat template ({self.name}) failed on this conversation: {type(e).__name__}: {e}"
            ) from None

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders a tool catalog and tool results itself (probed once)."""
        tool = {
            "type": "function",
            "function": {
                "name": _PROBE_TOOL,
                "description": "probe",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": _PROBE_TOOL, "arguments": {"x": "1"}},
        }
        messages = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": "call_0",
                "name": _PROBE_TOOL,
                "content": _PROBE_RESULT,
            },
        ]
        try:
            text = self.render(messages, tools=[tool], add_generation_prompt=True)
        except TokenizerError:
            return False
        return _PROBE_TOOL in text and _PROBE_RESULT in text
