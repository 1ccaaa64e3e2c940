"""Tool-call formats: find calls in generated text, and write calls in a family's convention.

Families: `hermes` (Qwen, Hermes, SmolLM: `<tool_call>{"name", "arguments"}</tool_call>`),
`llama3` (a JSON object `{"name", "parameters"}`, optionally after `<|python_tag|>`),
`mistral` (`[TOOL_CALLS][{...}]` or `[TOOL_CALLS]name[ARGS]{...}`) and `gemma`
(a ```tool_code block holding Python calls `name(key=value)`). Parsing never raises, whatever
the text (nested 100,000 deep, a 5,000-digit number): a malformed call comes back as a typed
`CallError` next to the calls that did parse. A call's name is text and its arguments are what
every tool can take (`argument_problem`): a JSON object nested at most MAX_ARGUMENT_DEPTH deep,
its strings free of lone surrogates (which no UTF-8 encoder, argv or tokenizer accepts), its
numbers finite; anything else is a `CallError`, so that nothing a model writes can raise
further on. The same code serves `serve`, agent rollouts, `collect` and SFT on tool records;
nothing here knows about templates or ids.
"""

from __future__ import annotations

import ast
import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from retrograd import nesting
from retrograd.text import is_text


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class CallError:
    """Why a call-shaped piece of text is not a valid call.

    kind: "invalid_json", "not_an_object", "missing_name", "bad_name", "bad_arguments",
    "unterminated", "invalid_syntax". `start`/`end` are character offsets of the piece in the
    text.
    """

    kind: str
    message: str
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text with call markup removed, stripped
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[CallError, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.errors


MAX_ARGUMENT_DEPTH = 64  # objects and arrays inside each other, the arguments' own included
# what a call's JSON may nest as read (deeper: invalid_json): the arguments in a call object in
# an array of calls, with room past the limit, so that arguments a few levels too deep are read
# and refused as arguments by argument_problem (bad_arguments, naming the limit)
PARSE_DEPTH = MAX_ARGUMENT_DEPTH + 8


def _value_problem(value: Any) -> str | None:
    """Why one scalar cannot stand in arguments, or None."""
    if isinstance(value, str):
        return None if is_text(value) else "arguments hold a lone surrogate, which is not text"
    if isinstance(value, float):
        return None if math.isfinite(value) else "arguments hold a number that is not finite"
    if value is None or isinstance(value, (bool, int)):
        return None
    return f"arguments hold a {type(value).__name__} value, which JSON cannot carry"


def argument_problem(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> str | None:
    """Why `value` cannot be a call's arguments, or None when every tool can take it: a JSON
    object (tuples count as arrays) nested at most `limit` deep, with string keys and no lone
    surrogate nor non-finite number anywhere. Walked without recursion."""
    if not isinstance(value, dict):
        return "arguments must be an object"
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > limit:
                return f"arguments nested more than {limit} levels deep"
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        return f"arguments hold a {type(key).__name__} key, which JSON cannot carry"
                    if not is_text(key):
                        return "arguments hold a lone surrogate, which is not text"
                item = item.values()
            todo.extend((v, depth + 1) for v in item)
        elif (problem := _value_problem(item)) is not None:
            return problem
    return None


def _json_arrays(value: Any) -> Any:
    """`value` with its tuples made lists (a Python literal's arrays), as JSON reads them."""
    if isinstance(value, dict):
        return {k: _json_arrays(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_arrays(v) for v in value]
    return value


def _decode_json(text: str, pos: int = 0) -> tuple[Any, int]:
    """One JSON value at `pos`. Every failure is a JSONDecodeError: a number of more digits
    than Python converts, or nesting past PARSE_DEPTH (nesting.TooDeep, found before the
    parser recurses), included (nesting.raw_decode)."""
    return nesting.raw_decode(text, pos, PARSE_DEPTH)


def normalize_arguments(value: Any) -> dict[str, Any]:
    """Arguments as an object: a dict stays, a JSON-encoded object string is decoded. Raises
    ValueError (alone) when they are not an object or `argument_problem` finds one."""
    if isinstance(value, str):
        text = value.lstrip()
        value, end = _decode_json(text)
        if text[end:].strip():
            raise ValueError("text after the JSON object")
    problem = argument_problem(value)
    if problem is not None:
        if problem == "arguments must be an object":
            problem = "arguments must be an object or a JSON-encoded object"
        raise ValueError(problem)
    return value


def _call_from_json(obj: Any, args_keys: tuple[str, ...], start, end, text) -> ToolCall | CallError:
    if not isinstance(obj, dict):
        return CallError("not_an_object", "a call must be a JSON object", start, end, text)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return CallError("missing_name", 'a call needs a non-empty string "name"', start, end, text)
    if not is_text(name):
        return CallError("bad_name", "a call's name holds a lone surrogate", start, end, text)
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    try:
        args = normalize_arguments(args)
    except ValueError as e:
        return CallError("bad_arguments", f"call {name!r}: {e}", start, end, text)
    return ToolCall(name, args, obj.get("id") if isinstance(obj.get("id"), str) else None)


def _json_at(text: str, pos: int, args_keys, end_limit: int | None = None):
    """Decode one JSON value at `pos`; (result, end)."""
    try:
        obj, end = _decode_json(text, pos)
    except json.JSONDecodeError as e:
        stop = end_limit if end_limit is not None else len(text)
        return CallError("invalid_json", f"invalid JSON: {e.msg}", pos, stop, text[pos:stop]), stop
    return _call_from_json(obj, args_keys, pos, end, text[pos:end]), end


class ToolFormat(ABC):
    """One family's convention. Subclasses set `name` and implement `parse` and `render`."""

    name = ""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The prose and calls of a generated turn."""

    @abstractmethod
    def render(self, calls: list[ToolCall]) -> str:
        """Calls written in this family's markup (raw assistant turns)."""


def _collect(text: str, spans: list[tuple[int, int]], items: list) -> ParsedTurn:
    content, pos = [], 0
    for s, e in sorted(spans):
        content.append(text[pos:s])
        pos = e
    content.append(text[pos:])
    calls = tuple(x for x in items if isinstance(x, ToolCall))
    errors = tuple(x for x in items if isinstance(x, CallError))
    return ParsedTurn("".join(content).strip(), calls, errors)


class Hermes(ToolFormat):
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        spans, items, pos = [], [], 0
        while (s := text.find(self._OPEN, pos)) >= 0:
            body = s + len(self._OPEN)
            e = text.find(self._CLOSE, body)
            if e < 0:
                items.append(
                    CallError(
                        "unterminated", "<tool_call> without </tool_call>", s, len(text), text[s:]
                    )
                )
                spans.append((s, len(text)))
                break
            inner = text[body:e]
            lead = len(inner) - len(inner.lstrip())
            item, end = _json_at(text, body + lead, ("arguments", "parameters"), e)
            if isinstance(item, ToolCall) and text[end:e].strip():
                item = CallError("invalid_json", "text after the JSON object", body, e, inner)
            items.append(item)
            spans.append((s, e + len(self._CLOSE)))
            pos = e + len(self._CLOSE)
        return _collect(text, spans, items)

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            f"{self._OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n{self._CLOSE}"
            for c in calls
        )


class Llama3(ToolFormat):
    name = "llama3"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self._TAG)
        if start >= 0:
            pos = start + len(self._TAG)
        else:
            stripped = text.lstrip()
            if not stripped.startswith("{"):
                return ParsedTurn(text.strip())
            start = pos = len(text) - len(stripped)
        spans, items = [], []
        while pos < len(text):
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(text):
                break
            item, end = _json_at(text, pos, ("parameters", "arguments"))
            items.append(item)
            if isinstance(item, CallError):
                end = len(text)
            pos = end
        spans.append((start, len(text)))
        return _collect(text, spans, items)

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False)
            for c in calls
        )


class Mistral(ToolFormat):
    name = "mistral"
    _TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self._TAG)
        if start < 0:
            return ParsedTurn(text.strip())
        items: list = []
        pos = start
        while (pos := text.find(self._TAG, pos)) >= 0:
            pos += len(self._TAG)
            rest = text[pos:].lstrip()
            pos += len(text[pos:]) - len(rest)
            if rest.startswith("["):
                try:
                    arr, end = _decode_json(text, pos)
                except json.JSONDecodeError as e:
                    items.append(
                        CallError(
                            "invalid_json", f"invalid JSON: {e.msg}", pos, len(text), text[pos:]
                        )
                    )
                    break
                seq = arr if isinstance(arr, list) else [arr]
                items += [
                    _call_from_json(o, ("arguments", "parameters"), pos, end, text[pos:end])
                    for o in seq
                ]
                pos = end
            else:
                a = text.find(self._ARGS, pos)
                if a < 0:
                    items.append(
                        CallError(
                            "unterminated",
                            "[TOOL_CALLS] without [ARGS]",
                            pos,
                            len(text),
                            text[pos:],
                        )
                    )
                    break
                name = text[pos:a].strip()
                argpos = a + len(self._ARGS)
                argpos += len(text[argpos:]) - len(text[argpos:].lstrip())
                try:
                    obj, end = _decode_json(text, argpos)
                except json.JSONDecodeError as e:
                    items.append(
                        CallError(
                            "invalid_json",
                            f"invalid JSON: {e.msg}",
                            argpos,
                            len(text),
                            text[argpos:],
                        )
                    )
                    break
                call = {"name": name, "arguments": obj}
                items.append(_call_from_json(call, ("arguments",), pos, end, text[pos:end]))
                pos = end
        return _collect(text, [(start, len(text))], items)

    def render(self, calls: list[ToolCall]) -> str:
        body = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return self._TAG + json.dumps(body, ensure_ascii=False)


class Gemma(ToolFormat):
    name = "gemma"
    _BLOCK = re.compile(r"```tool_code\s*\n(.*?)```", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        spans, items = [], []
        for m in self._BLOCK.finditer(text):
            spans.append(m.span())
            # NOTE: "\n" only: splitlines would also cut at U+2028 inside a string argument
            for line in filter(str.strip, m.group(1).split("\n")):
                items.append(self._call(line.strip(), m.start(1), m.end(1)))
        unterminated = text.find("```tool_code", spans[-1][1] if spans else 0)
        if unterminated >= 0:
            items.append(
                CallError(
                    "unterminated",
                    "```tool_code block without closing ```",
                    unterminated,
                    len(text),
                    text[unterminated:],
                )
            )
            spans.append((unterminated, len(text)))
        return _collect(text, spans, items)

    @staticmethod
    def _call(line: str, s: int, e: int) -> ToolCall | CallError:
        try:
            node = ast.parse(line, mode="eval").body
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("expected name(key=value, ...)")
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        # NOTE: CPython's parser answers nesting past its stack (100,000 unary minus signs)
        # with MemoryError, and literal_eval's walk with RecursionError.
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            return CallError("invalid_syntax", f"not a call: {exc}", s, e, line)
        problem = argument_problem(args)
        if problem is not None:
            return CallError("bad_arguments", f"call {node.func.id!r}: {problem}", s, e, line)
        return ToolCall(node.func.id, _json_arrays(args))

    def render(self, calls: list[ToolCall]) -> str:
        lines = [
            f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls
        ]
        return "```tool_code\n" + "\n".join(lines) + "\n```"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3(), Mistral(), Gemma())}


def detect_format(template_source: str) -> ToolFormat:
    """The convention a chat template uses for calls; Hermes when it names none."""
    if "[TOOL_CALLS]" in template_source:
        return FORMATS["mistral"]
    if "<tool_call>" in template_source:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template_source or "<|start_header_id|>" in template_source:
        return FORMATS["llama3"]
    if "tool_code" in template_source:
        return FORMATS["gemma"]
    return FORMATS["hermes"]


def describe_tools(tools: list[dict]) -> str:
    """The catalog as system-prompt text, for templates that do not render tools (Hermes)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
