"""The OpenAI chat-completions request and response shapes, and what we refuse.

A request is validated in steps: its JSON was read nested at most nesting.MAX_DEPTH deep
(`app.py`; a `guided_json` schema given as text too), pydantic checks types (strictly: `true` is not a number) and ranges, then `check_supported` refuses,
with a 400 naming the field, what this server does not do (n > 1, logprobs, penalties, a
response_format other than text, tool_choice "required" or a named function,
parallel_tool_calls false beside tools). vLLM's `guided_json` extension constrains the answer
to a JSON schema (`guided_grammar` compiles it, refusing what it cannot say with a 400 naming
the keyword). Messages are converted to the records `ChatFormat`
renders, in an order training accepts (`to_records`). Nothing here generates.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retrograd import nesting
from retrograd.errors import DataError
from retrograd.openai_app.errors import (  # noqa: F401 - re-exported
    ApiError,
    check_text,
    model_entry,
    too_deep,
)
from retrograd.sampling.grammar import Grammar, SchemaError, json_schema_grammar
from retrograd.tokenizer.records import check_order
from retrograd.tokenizer.toolcalls import normalize_arguments


class ChatRequest(BaseModel):
    # unknown OpenAI fields are ignored; strict: `max_tokens: true` is not 1, nor "2" a 2
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool | None = None  # vLLM's extension: end-of-generation ids do not stop
    guided_json: dict[str, Any] | str | None = None  # vLLM's extension: answer with this schema


def parse_request(data: Any) -> ChatRequest:
    """The request, or ApiError 400 naming the field: one that does not match, or a string
    holding a lone surrogate (a `\\ud800` escape no template, tokenizer or answer takes)."""
    check_text(data)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise ApiError(400, f"invalid request: {problems}", param, "invalid_value") from None


def check_supported(req: ChatRequest) -> None:
    """Refuse, naming the field, what this server does not do."""

    def refuse(field: str, why: str):
        if len(why) > 200:  # what the client sent, quoted: not echoed back by the megabyte
            why = why[:200] + "…"
        raise ApiError(
            400, f"{field}: {why} is not supported by retrograd serve", field, "unsupported_value"
        )

    if req.n not in (None, 1):
        refuse("n", "more than one choice")
    if req.logprobs:
        refuse("logprobs", "returning log-probabilities")
    if req.top_logprobs is not None:
        refuse("top_logprobs", "returning log-probabilities")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field) not in (None, 0):
            refuse(field, "a penalty")
    if req.logit_bias:
        refuse("logit_bias", "a logit bias")
    if req.response_format and req.response_format.get("type", "text") != "text":
        refuse("response_format", f"response_format type {req.response_format.get('type')!r}")
    if isinstance(req.tool_choice, dict) or req.tool_choice not in (None, "auto", "none"):
        refuse("tool_choice", f"tool_choice {json.dumps(req.tool_choice)}")
    if req.tools and req.parallel_tool_calls is False:
        refuse("parallel_tool_calls", "parallel_tool_calls false")
    if req.guided_json is not None and req.tools and req.tool_choice != "none":
        refuse("guided_json", "guided_json beside tools")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4:
        raise ApiError(400, "stop: at most 4 stop strings", "stop", "invalid_value")


_GRAMMARS: OrderedDict[str, Grammar] = OrderedDict()  # compiled schemas, most recent last
MAX_GRAMMARS = 32


def guided_grammar(req: ChatRequest) -> Grammar | None:
    """The grammar of the request's guided_json schema (an object, or its JSON text), compiled
    once per schema text; None without one."""
    schema = req.guided_json
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = nesting.loads(schema)
        except nesting.TooDeep as e:
            raise too_deep(e.limit, "guided_json") from None
        except json.JSONDecodeError as e:
            raise ApiError(
                400, f"guided_json: not JSON ({e})", "guided_json", "invalid_value"
            ) from None
    key = json.dumps(schema, sort_keys=True)
    grammar = _GRAMMARS.get(key)
    if grammar is None:
        try:
            grammar = json_schema_grammar(schema)
        except SchemaError as e:
            message = str(e).replace("schema", "guided_json", 1)
            raise ApiError(400, message, "guided_json", "invalid_value") from None
        _GRAMMARS[key] = grammar
        if len(_GRAMMARS) > MAX_GRAMMARS:
            _GRAMMARS.popitem(last=False)
    _GRAMMARS.move_to_end(key)
    return grammar


def stop_strings(req: ChatRequest) -> tuple[str, ...]:
    return tuple([req.stop] if isinstance(req.stop, str) else (req.stop or []))


def tools_for_prompt(req: ChatRequest) -> list[dict] | None:
    """The catalog the prompt shows: none with tool_choice "none"."""
    if not req.tools or req.tool_choice == "none":
        return None
    for i, tool in enumerate(req.tools):
        fn = tool.get("function")
        if (
            tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not fn.get("name")
        ):
            raise ApiError(
                400, f"tools[{i}]: expected a function with a name", f"tools[{i}]", "invalid_value"
            )
    return req.tools


def to_records(messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
    """OpenAI messages -> the message records ChatFormat renders; their order must be one
    training accepts (no assistant first, no two user turns in a row outside tool use)."""
    out = _records(messages)
    tool_use = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in out)
    try:
        check_order(out, "messages", tool_use)
    except DataError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None
    return out


def _records(messages: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(
                400, f"{where}.role: unknown role {role!r}", f"{where}.role", "invalid_value"
            )
        record: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            record["tool_calls"] = [
                _call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])
            ]
        if role == "tool":
            record["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                record["name"] = m["name"]
        out.append(record)
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    400,
                    f"{where}.content[{k}]: {kind!r} parts are not supported (text only)",
                    f"{where}.content",
                    "unsupported_value",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(
        400,
        f"{where}.content: expected a string or a list of text parts",
        f"{where}.content",
        "invalid_value",
    )


def _call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise ApiError(
            400, f"{where}: expected a function call with a name", where, "invalid_value"
        )
    try:
        args = normalize_arguments(fn.get("arguments") or {})
    except ValueError as e:
        raise ApiError(
            400, f"{where}.function.arguments: {e}", f"{where}.function.arguments", "invalid_value"
        ) from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


# -- responses -------------------------------------------------------------------------------


def message_of(text: str, parsed) -> tuple[dict, str | None]:
    """The assistant message for generated text; parsed: a ParsedTurn when tools were offered.
    Returns the message and "tool_calls" when the model called tools."""
    if parsed is not None and parsed.calls:
        calls = [
            {
                "id": c.id or f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                },
            }
            for c in parsed.calls
        ]
        return {
            "role": "assistant",
            "content": parsed.content or None,
            "tool_calls": calls,
        }, "tool_calls"
    return {"role": "assistant", "content": text}, None


def completion_body(model: str, message: dict, finish: str, usage: dict) -> dict:
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


def usage_of(answer) -> dict:
    """OpenAI's usage of a `Completion`."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": len(answer.ids),
        "total_tokens": answer.prompt_tokens + len(answer.ids),
    }


def chunk_base(model: str) -> dict:
    """The fields every chunk of one stream shares."""
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }


def delta_chunk(base: dict, delta: dict, finish: str | None = None) -> dict:
    return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def message_delta(message: dict) -> dict:
    """A whole message as one delta: tool calls numbered by `index`, no role."""
    delta = {k: v for k, v in message.items() if k != "role"}
    if "tool_calls" in delta:
        delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(delta["tool_calls"])]
    return delta


def usage_chunk(base: dict, usage: dict) -> dict:
    return base | {"choices": [], "usage": usage}
