"""How deep JSON and TOML written by someone else may nest, checked before anything recursive
reads it.

Python's JSON parser, tomllib, `copy.deepcopy`, `json.dumps` and our own merges all recurse once
a level: a document nested 100,000 deep (or 900 deep, past the parser, into a merge) ends in
RecursionError, which nothing expects and which kills a request or a run. Whatever a peer wrote
(HTTP bodies, dataset lines, reward programs', judges' and environments' replies, model-written
tool calls) is read through `loads` / `raw_decode` here, or checked with `check_json`,
`check_toml` or `check_value` first. The scans are not recursive and step over strings (and
TOML comments), so a bracket inside a string never counts.

`TooDeep` is a `json.JSONDecodeError` (so a ValueError): every reader that already names the
place of malformed JSON (`data.jsonl:17: ...`, a reply's batch and line) names this one too.
`loads` and `raw_decode` make an integer of more digits than Python converts (4300,
`sys.get_int_max_str_digits()`: a ValueError out of the parser) a JSONDecodeError as well.
Nothing here knows who wrote the text or which error its reader answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # arrays and objects (TOML: arrays, inline tables and tables) inside each other

# A JSON string, closed or (malformed) running to the end of the text: the parser fails there,
# so no bracket inside it can nest.
_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"?'
_JSON_SKIP = re.compile(_JSON_STRING, re.S)
_JSON_TOKEN = re.compile(_JSON_STRING + r"|[\[\]{}]", re.S)
# TOML's four strings (multi-line ones first; up to two quotes may close with the delimiter)
# and its comments.
_TOML_SKIP = re.compile(
    r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*(?:"""(?:""?)?|\Z)'
    r"|'''[^']*(?:'(?!'')[^']*)*(?:'''(?:''?)?|\Z)"
    r'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"?'
    r"|'[^'\n]*'?"
    r"|#[^\n]*",
    re.S,
)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class TooDeep(json.JSONDecodeError):
    """A document nested deeper than `limit`; `pos` is the bracket that went past it."""

    def __init__(self, msg: str, doc: str, pos: int, limit: int = MAX_DEPTH):
        super().__init__(msg, doc, pos)
        self.limit = limit
        if not doc:  # a parsed value (check_value): no text, so no line and column
            ValueError.__init__(self, msg)


def too_deep(limit: int, doc: str = "", pos: int = 0) -> TooDeep:
    return TooDeep(f"nested more than {limit} levels deep", doc, pos, limit)


def _deepest(brackets: str) -> int:
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _past_limit(text: str, limit: int, start: int, one_value: bool) -> int | None:
    """The position of the bracket that opens level limit + 1 (None: none does), token by
    token; `one_value` stops where the value that starts at `start` closes."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        ch = token[0]
        if ch in "[{":
            depth += 1
            if depth > limit:
                return token.start()
        elif ch in "]}":
            depth -= 1
        if one_value and depth <= 0:
            return None
    return None


def check_json(text: str, limit: int = MAX_DEPTH, start: int = 0, one_value: bool = False) -> None:
    """TooDeep if the JSON in `text` (from `start`; `one_value`: only the value there) nests
    more than `limit` arrays and objects. Over the whole text first, at C speed; token by token
    only where that found too deep a place, to name it (or, for `one_value`, to see whether it
    lies past the value's end)."""
    if text.count("[", start) + text.count("{", start) <= limit:
        return  # fewer openers than levels: most documents end here
    rest = _JSON_SKIP.sub("", text[start:] if start else text)
    if _deepest(_NOT_BRACKET.sub("", rest)) <= limit:
        return
    pos = _past_limit(text, limit, start, one_value)
    if pos is not None:
        raise too_deep(limit, text, pos)


def text_of(raw: str | bytes | bytearray) -> str:
    """JSON bytes as text, decoded as json.loads decodes them (UTF-8, -16 or -32): a scan of
    the bytes themselves would miss the brackets and quotes of UTF-16."""
    if isinstance(raw, str):
        return raw
    return bytes(raw).decode(json.detect_encoding(raw), "surrogatepass")


def loads(raw: str | bytes | bytearray, limit: int = MAX_DEPTH) -> Any:
    """`json.loads(raw)`, refusing (TooDeep) a document nested more than `limit` deep before
    the parser sees it; an integer of too many digits is a JSONDecodeError."""
    text = text_of(raw)
    check_json(text, limit)
    return _decoded(json.loads, text)


def raw_decode(text: str, pos: int = 0, limit: int = MAX_DEPTH) -> tuple[Any, int]:
    """`json.JSONDecoder().raw_decode(text, pos)` for the one value at `pos` (text may follow
    it), refusing (TooDeep) one nested more than `limit` deep; an integer of too many digits
    is a JSONDecodeError."""
    check_json(text, limit, pos, one_value=True)
    return _decoded(json.JSONDecoder().raw_decode, text, pos)


def _decoded(parse, text: str, *args) -> Any:
    """`parse(text, *args)`, its every failure a JSONDecodeError: the parser raises a plain
    ValueError for an integer of more digits than int() converts (`"7" * 5000`)."""
    try:
        return parse(text, *args)
    except json.JSONDecodeError:
        raise
    except ValueError as error:
        found = _LONG_DIGITS.search(text, *args)
        raise json.JSONDecodeError(str(error), text, found.start() if found else 0) from None


_LONG_DIGITS = re.compile(r"[0-9]{4301}")  # where an integer past int()'s limit starts


def check_toml(text: str, limit: int = MAX_DEPTH) -> None:
    """TooDeep if the TOML in `text` nests more than `limit` arrays, inline tables and table
    headers' brackets inside each other, found before tomllib (which recurses) parses it.
    Dotted keys nest without brackets: `check_value` the parsed document for those."""
    if text.count("[") + text.count("{") <= limit:
        return
    rest = _NOT_BRACKET.sub("", _TOML_SKIP.sub("", text))
    if _deepest(rest) > limit:
        depth = 0
        for token in re.finditer(r"[\[\]{}]", _TOML_SKIP.sub(lambda m: " " * len(m[0]), text)):
            depth += 1 if token[0] in "[{" else -1
            if depth > limit:
                raise too_deep(limit, text, token.start())


def check_value(value: Any, limit: int = MAX_DEPTH) -> None:
    """TooDeep if a parsed value (dicts and lists) nests more than `limit` deep; walked
    without recursion."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list | tuple):
            continue
        if depth > limit:
            raise too_deep(limit)
        todo.extend((v, depth + 1) for v in item)
