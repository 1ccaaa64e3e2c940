"""Strings that must be text. A Python str can hold a lone surrogate (U+D800 to U+DFFF alone),
which a JSON `\\ud800` escape written by a model, a server or a data file puts there, and which
no UTF-8 encoder, file, command line or tokenizer takes: one of them reaching `.encode()` ends
whatever called it in UnicodeEncodeError.

`is_text` tells; `as_text` makes each lone surrogate U+FFFD (for what a model or a tool reads);
`json_dumps` writes JSON that always encodes, with ASCII escapes where a lone surrogate must
stay as it was (a record read back holds the same string); `not_text_at` finds the place of
the first string in parsed JSON that is not text (for a reader that refuses it), `first_at`
the first key or value of any kind a caller names. Nothing here knows where a string
came from or where it goes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def is_text(value: str) -> bool:
    """True when `value` encodes as UTF-8 (holds no lone surrogate)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def as_text(value: str) -> str:
    """`value` with each lone surrogate made U+FFFD."""
    return value if is_text(value) else _SURROGATE.sub("\ufffd", value)


# C0 controls but "\t" and "\n", DEL and the C1 controls: a terminal acts on them (ESC starts
# the sequences that move the cursor, clear the screen or set the title; \x9b is ESC [ alone).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` for a terminal: each control character but "\t" and "\n" shown as its escape
    ("\x1b", "\r"), so a policy's answer, a tool's output or a program's stderr quoted in an
    error or a log line is read, not obeyed."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def newline_split(text: str) -> list[str]:
    r"""The lines of a JSONL (or plain) text, split at "\n" alone (a trailing "\r" dropped).

    str.splitlines() would also cut at U+2028, U+2029, \x85 and other breaks that JSON allows
    unescaped inside a string, as json_dumps writes them: a record holding one would be
    refused as two halves that are not JSON (data.sft.jsonl_lines reads the trainer's files
    the same way)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def json_dumps(value: Any, **options: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, **options)`, or, when that text holds a lone
    surrogate, the same value with ASCII escapes: text a UTF-8 file always takes."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return text if is_text(text) else json.dumps(value, ensure_ascii=True, **options)


def not_text_at(value: Any) -> tuple[str | int, ...] | None:
    """The path (keys and indices) to the first string, key or value, in a parsed JSON value
    that holds a lone surrogate; None when every string is text. Walked without recursion."""
    return first_at(value, lambda v: isinstance(v, str) and not is_text(v))


def first_at(value: Any, bad: Callable[[Any], bool]) -> tuple[str | int, ...] | None:
    """The path (keys and indices) to the first key or scalar of a parsed JSON value (dicts,
    lists, tuples) for which `bad` is true, in document order; None when there is none.
    Walked without recursion."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while todo:
        item, path = todo.pop()
        if isinstance(item, dict):
            for key, v in reversed(item.items()):
                if bad(key):
                    return (*path, key)
                todo.append((v, (*path, key)))
        elif isinstance(item, list | tuple):
            todo.extend((v, (*path, i)) for i, v in reversed(list(enumerate(item))))
        elif bad(item):
            return path
    return None
