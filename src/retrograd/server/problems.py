"""Error documents (formats.md §9.2): RFC 9457 problem+json with the contract's types and codes.

A handler raises `Problem`; the app turns it (and every other failure outside the OpenAI
routes) into `application/problem+json`. `type` and each error's `code` are the contract, the
prose may change. `issues_to_errors` maps the run-file loader's issues to pointers and codes,
with the closest known key (edit distance at most 2) as the hint of an unknown one. Paths in
the prose are redacted when the server says so. Nothing here knows about runs.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any

from retrograd.config.report import MISSING, Issue, Unreported, _models, _unwrap
from retrograd.nesting import TooDeep

PROBLEM_BASE = "https://retrograd.dev/problems/"
MEDIA_TYPE = "application/problem+json"

# type slug -> (status, title)
TYPES = {
    "invalid-request": (422, "The request is not valid"),
    "server-declared": (422, "The field is declared by the server"),
    "unknown-catalog-id": (422, "No catalogue entry has this id"),
    "insufficient-memory": (422, "The run does not fit the memory budgets"),
    "unauthorized": (401, "Missing or wrong bearer token"),
    "forbidden-path": (403, "The path is outside the server's path roots"),
    "not-found": (404, "Not found"),
    "method-not-allowed": (405, "Method not allowed"),
    "conflict": (409, "The request conflicts with the resource's state"),
    "payload-too-large": (413, "The request body is too large"),
    "too-many-requests": (429, "Too many requests at once"),
    "unsupported-media-type": (415, "Unsupported media type"),
    "internal": (500, "Internal error"),
    "not-implemented": (501, "Not implemented yet"),
    "device-busy": (503, "The device is busy"),
    "timeout": (504, "The request took too long"),
}
CODES = (
    "missing_field",
    "unknown_field",
    "invalid_value",
    "out_of_range",
    "unsupported_format",
    "path_not_found",
    "forbidden_path",
    "unknown_catalog_id",
    "needs_opt_in",
    "override_conflict",
    "conflict",
    "unauthorized",
    "not_found",
    "server_declared",
)


@dataclass(frozen=True)
class FieldError:
    """One entry of `errors[]`: where (a JSON pointer into the request), what, a hint."""

    pointer: str
    code: str
    message: str
    hint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"pointer": self.pointer, "code": self.code, "message": self.message}
        return out | ({"hint": self.hint} if self.hint is not None else {})


@dataclass
class Problem(Exception):
    """An error answered as problem+json; `kind` is a key of TYPES."""

    kind: str
    detail: str
    errors: list[FieldError] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.kind in TYPES, self.kind
        assert all(e.code in CODES for e in self.errors), self.errors
        super().__init__(self.detail)

    @property
    def status(self) -> int:
        return TYPES[self.kind][0]

    def document(self, trace_id: str, redact: bool = False) -> dict[str, Any]:
        hide = redact_paths if redact else (lambda text: text)
        return {
            "type": PROBLEM_BASE + self.kind,
            "title": TYPES[self.kind][1],
            "status": self.status,
            "detail": hide(self.detail),
            "trace_id": trace_id,
            "errors": [
                {**e.as_dict(), "message": hide(e.message)}
                for e in (self.errors if self.kind not in _BARE else [])
            ],
            "meta": self.meta,
        }


_BARE = (
    "device-busy",
    "timeout",
    "internal",
    "too-many-requests",
)  # their errors[] is always empty
_PATH = re.compile(r"(?<![\w.:/])(?:[A-Za-z]:)?(?:/[^\s'\"`,;:()\[\]{}]+)+")


def redact_paths(text: str) -> str:
    """Absolute paths in prose become `<path>` (for error documents off loopback)."""
    return _PATH.sub("<path>", text)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions of one character."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def closest(name: str, known: typing.Iterable[str], limit: int = 2) -> str | None:
    """The known name nearest to `name` within `limit` edits (the first of equals), or None."""
    best = None
    for candidate in sorted(known):
        d = edit_distance(name, candidate)
        if d <= limit and (best is None or d < best[0]):
            best = (d, candidate)
    return best[1] if best else None


def unknown_field(pointer: str, name: str, known: typing.Iterable[str]) -> FieldError:
    hint = closest(name, known)
    message = f"unknown field {name!r}" + (f"; did you mean {hint!r}?" if hint else "")
    return FieldError(pointer, "unknown_field", message, hint)


def not_found(message: str, field: str = "id") -> Problem:
    """A 404 whose one error points at the path parameter or field that named nothing."""
    return Problem("not-found", message, [FieldError(pointer(field), "not_found", message)])


def too_deep(error: TooDeep, message: str | None = None, where: str = "") -> Problem:
    """A body (or one of its lines, `where`) nested deeper than nesting.py allows; `message`
    says where, when the error's own text does not."""
    text = message or str(error)
    return Problem(
        "invalid-request",
        text,
        [FieldError(where, "unsupported_format", text)],
        meta={"max_depth": error.limit},
    )


def pointer(*parts: str | int) -> str:
    """A JSON pointer (RFC 6901) from its parts."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def known_keys(root: Any, table: tuple[str | int, ...]) -> set[str]:
    """The keys of the model reached from `root` along `table` (list indices stepped over)."""
    models = _models(root)
    for part in table:
        if isinstance(part, int):
            continue
        nxt: list = []
        for model in models:
            f = model.model_fields.get(part)
            if f is not None:
                inner = _unwrap(f.annotation)
                if typing.get_origin(inner) in (list, dict):
                    inner = typing.get_args(inner)[-1]
                nxt += _models(inner)
        models = nxt
    return {name for model in models for name in model.model_fields}


def issues_to_errors(
    issues: list[Issue], root: Any, prefix: tuple[str, ...] = ()
) -> list[FieldError]:
    """The run-file loader's issues as `errors[]` entries under the pointer `prefix`."""
    out = []
    for item in issues:
        key_parts = tuple(item.key.split(".")) if item.key else ()
        where = pointer(*prefix, *item.table, *key_parts)
        text = item.message
        if item.value is not MISSING:
            text = f"{text} (got {item.value!r})"
        if isinstance(item, Unreported):  # the problems past the first ones, counted
            out.append(FieldError(pointer(*prefix), "invalid_value", item.message))
        elif text.startswith("unknown key") and key_parts:
            known = known_keys(root, item.table + key_parts[:-1])
            error = unknown_field(where, key_parts[-1], known)
            out.append(FieldError(where, "unknown_field", item.message, error.hint))
        elif text.startswith("unknown section"):
            error = unknown_field(where, str(item.table[-1]), known_keys(root, ()))
            out.append(FieldError(where, "unknown_field", item.message, error.hint))
        else:
            out.append(FieldError(where, _code(item.message), text))
    return out


def _code(message: str) -> str:
    if message.startswith("required"):
        return "missing_field"
    if re.match(r"must be (at least|at most|greater|less|\d)|must be .* to \d", message):
        return "out_of_range"
    return "invalid_value"
