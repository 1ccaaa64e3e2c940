"""Validate chat and tool records (formats.md §1.2, §1.4) into normalized message lists.

Checks roles and their order, empty contents, tool catalogs, call ids and answers; names calls
without an id `call_0`, `call_1`, ... in turn order; decodes JSON-string arguments; prefixes
failed observations with "ERROR: "; and, for raw assistant turns, checks that the family's
parser reads exactly the declared calls back. Every refusal is a `DataError` naming the
record's place (`data.jsonl:17`). Nothing here renders or tokenizes.
"""

from __future__ import annotations

import copy
from typing import Any

from retrograd.errors import DataError
from retrograd.tokenizer.toolcalls import ToolCall, ToolFormat, normalize_arguments

ERROR_PREFIX = "ERROR: "
ROLES = ("system", "user", "assistant", "tool")


def normalize_tools(tools: Any, where: str) -> list[dict]:
    """The catalog in OpenAI function shape; the flat {name, description, parameters} too."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise DataError(f'{where}: "tools" must be a list')
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict):
            raise DataError(f"{where}: tools[{k}] must be an object")
        fn = t.get("function") if t.get("type") == "function" else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(f'{where}: tools[{k}] needs a non-empty "name"')
        out.append({"type": "function", "function": dict(fn)})
    return out


def validate_record(
    record: dict,
    where: str,
    tool_format: ToolFormat | None = None,
    require_assistant: bool = False,
) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a chat or tool record, normalized; DataError when it breaks a rule.

    Messages keep their keys; assistant calls become {"id", "type", "function": {"name",
    "arguments": dict}}; a raw assistant turn keeps `"raw": True`.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list')
    tools = normalize_tools(record.get("tools"), where)
    declared = {t["function"]["name"] for t in tools}
    msgs = [_message(m, i, where) for i, m in enumerate(copy.deepcopy(messages))]
    is_tool_record = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
    check_order(msgs, where, is_tool_record)
    _check_calls(msgs, where, declared, tool_format)
    if is_tool_record and msgs[-1]["role"] not in ("assistant", "tool"):
        raise DataError(
            f"{where}: a tool record must end on an assistant turn or on its call results"
        )
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message to train on")
    return msgs, tools


def _message(m: Any, i: int, where: str) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{where}: message {i} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise DataError(f"{where}: message {i}: role {role!r} is not one of {', '.join(ROLES)}")
    content = m.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise DataError(f"{where}: message {i} ({role}): content must be a string")
    m["content"] = content
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise DataError(f"{where}: message {i}: tool_calls must be a list on an assistant message")
    if not content and not (role == "tool" or calls):
        raise DataError(f"{where}: message {i} ({role}): empty content")
    return m


def check_order(msgs: list[dict], where: str, is_tool_record: bool) -> None:
    prev = None
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system" and prev not in (None, "system"):
            raise DataError(
                f"{where}: message {i}: a system message may only open the conversation"
            )
        if role == "assistant" and prev == "assistant":
            raise DataError(f"{where}: message {i}: two consecutive assistant messages")
        if role == "user" and prev == "user" and not is_tool_record:
            raise DataError(f"{where}: message {i}: user and assistant messages must alternate")
        if role == "assistant" and prev in (None, "system"):
            raise DataError(
                f"{where}: message {i}: the conversation must start with a user message"
            )
        prev = role


def _check_calls(msgs: list[dict], where: str, declared: set[str], fmt: ToolFormat | None) -> None:
    counter = 0
    pending: list[dict] = []  # calls of the latest assistant turn not yet answered
    for i, m in enumerate(msgs):
        if m["role"] == "tool":
            _answer(m, i, where, pending)
            continue
        if pending:
            ids = ", ".join(c["id"] for c in pending)
            raise DataError(f"{where}: message {i}: calls {ids} are not answered before it")
        if m["role"] != "assistant":
            continue
        calls = []
        for k, c in enumerate(m.get("tool_calls") or []):
            calls.append(_call(c, where, i, k, declared, f"call_{counter}"))
            counter += 1
        if calls:
            m["tool_calls"] = calls
        pending = list(calls)
        if m.get("raw"):
            _check_raw(m, i, where, fmt, calls)


def _call(c: Any, where: str, i: int, k: int, declared: set[str], auto_id: str) -> dict:
    place = f"{where}: message {i}: tool_calls[{k}]"
    if not isinstance(c, dict):
        raise DataError(f"{place} must be an object")
    fn = c.get("function", c)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise DataError(f'{place}: missing function "name"')
    if not declared:
        raise DataError(f'{place}: the record calls {name!r} but declares no "tools"')
    if name not in declared:
        raise DataError(f"{place}: {name!r} is not a declared tool ({', '.join(sorted(declared))})")
    try:
        args = normalize_arguments(fn.get("arguments", {}))
    except ValueError as e:
        raise DataError(f"{place} ({name}): arguments are not a JSON object: {e}") from None
    cid = c.get("id") or auto_id
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _answer(m: dict, i: int, where: str, pending: list[dict]) -> None:
    if not pending:
        raise DataError(
            f"{where}: message {i}: a tool message answers no pending call of the last assistant turn"
        )
    cid = m.get("tool_call_id")
    if cid is None:
        call = pending[0]
    else:
        match = [c for c in pending if c["id"] == cid]
        if not match:
            raise DataError(
                f"{where}: message {i}: tool_call_id {cid!r} names no pending call of the last assistant turn"
            )
        call = match[0]
    pending.remove(call)
    name = call["function"]["name"]
    if m.get("name") not in (None, name):
        raise DataError(f"{where}: message {i}: name {m['name']!r} is not the called tool {name!r}")
    m["tool_call_id"] = call["id"]
    m["name"] = name
    if m.get("is_error"):
        m["content"] = ERROR_PREFIX + m["content"]


def _check_raw(m: dict, i: int, where: str, fmt: ToolFormat | None, calls: list[dict]) -> None:
    if fmt is None:
        return
    parsed = fmt.parse(m["content"])
    if parsed.errors:
        e = parsed.errors[0]
        raise DataError(
            f"{where}: message {i}: raw turn has a malformed {fmt.name} call: {e.message}"
        )
    want = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    got = [ToolCall(c.name, c.arguments) for c in parsed.calls]
    if got != want:
        raise DataError(
            f"{where}: message {i}: the {fmt.name} parser reads {[c.name for c in got]} from the raw "
            f"turn, but tool_calls declares {[c.name for c in want]} (names and arguments must match)"
        )
