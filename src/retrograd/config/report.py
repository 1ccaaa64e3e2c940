"""Turning every problem of a run file into one line: `run.toml: [section].key = value: rule`.

Pydantic's errors carry a location path through models, tagged unions, lists and dicts; this
module walks that path against the section models to split it into the table (`[grpo.judge]`)
and the key, and rewrites pydantic's wording into ours, with the closest known key suggested
for a misspelled one. It knows nothing about which rules exist.

A section built in Python (`GrpoSection(group_size=1)`) is named by where it sits in the file
whose class registered with `@table_root` (the run document): `[grpo].group_size = 1: must
be at least 2`. A class that sits in several places (the sampling table of [grpo] and
[distill], a judge, an MCP server entry, a tool) is not placed yet when it is built, so its
errors name the class: `GrpoSampling.temperature = 0.5: ...`.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ValidationError

from retrograd.config.write import value_text
from retrograd.errors import ConfigError

MISSING = object()


@dataclass(frozen=True)
class Issue:
    """One problem: the table it is in, the key (None for the whole table), value and rule."""

    table: tuple[str | int, ...]
    key: str | None
    message: str
    value: Any = MISSING

    def render(self, source: str | None) -> str:
        """`source: [table].key = value: rule`; without a source (a config built in Python)
        the line starts at the table."""
        where = table_name(self.table) if self.table else ""
        if self.key is not None:
            where = f"{where}.{self.key}" if where else self.key
        if self.value is not MISSING:
            where = f"{where} = {toml_value(self.value)}"
        line = f"{where}: {self.message}" if where else self.message
        return f"{source}: {line}" if source is not None else line


MAX_REPORTED = 100  # problems reported one by one; the rest are counted


@dataclass(frozen=True)
class Unreported(Issue):
    """The problems past the first MAX_REPORTED, counted on one line."""

    count: int = 0


def unreported(count: int) -> Unreported:
    return Unreported((), None, f"and {count} more problems", count=count)


def capped(found: list[Issue]) -> list[Issue]:
    """The first MAX_REPORTED problems and one line counting the rest (a document of 100,000
    unknown keys is 101 lines, not 100,000)."""
    shown = [item for item in found if not isinstance(item, Unreported)]
    rest = sum(item.count for item in found if isinstance(item, Unreported))
    rest += max(0, len(shown) - MAX_REPORTED)
    return shown[:MAX_REPORTED] + ([unreported(rest)] if rest else [])


def table_name(table: tuple[str | int, ...]) -> str:
    """`("agent", "mcp_servers", 0)` -> `[agent.mcp_servers][0]`."""
    names: list[str] = []
    text = ""
    for part in table:
        if isinstance(part, int):
            text += f"[{'.'.join(names)}][{part}]" if names else f"[{part}]"
            names = []
        else:
            names.append(part)
    if names:
        text += f"[{'.'.join(names)}]" if not text else "." + ".".join(names)
    return text


def toml_value(value: Any, limit: int = 60) -> str:
    """A value as the user wrote it in TOML (strings in double quotes, lowercase booleans),
    cut to `limit` characters; what TOML cannot hold (None, an object) as Python prints it."""
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    try:
        text = value_text(value)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_of(choices: typing.Sequence[str]) -> str:
    """`a, b or c`."""
    items = list(choices)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def suggest(name: str, known: typing.Iterable[str]) -> str:
    """`; did you mean group_size?` for a close known name, else ``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


# --- walking pydantic locations -------------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated and Optional layers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _models(annotation: Any) -> list[type[BaseModel]]:
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found: list[type[BaseModel]] = []
        for member in typing.get_args(annotation):
            found += _models(member)
        return found
    return []


def _tag_of(model: type[BaseModel]) -> str | None:
    for name in ("type", "mode"):
        field = model.model_fields.get(name)
        if field is not None and typing.get_origin(field.annotation) is typing.Literal:
            return typing.get_args(field.annotation)[0]
    return None


@dataclass
class _Walk:
    table: list[str | int]
    model: type[BaseModel] | None
    variants: list[type[BaseModel]]


def _enter(walk: _Walk, annotation: Any, loc: list[Any]) -> bool:
    """Descend into a table-valued field; False when the field holds a plain value."""
    inner = _unwrap(annotation)
    origin = typing.get_origin(inner)
    if origin in (list, dict):
        element = typing.get_args(inner)[-1]
        if not _models(element) or not loc or not isinstance(loc[0], int | str):
            return False
        walk.table.append(loc.pop(0))
        return _enter(walk, element, loc)
    models = _models(inner)
    if not models:
        return False
    if len(models) > 1:
        tags = {_tag_of(m): m for m in models}
        if loc and loc[0] in tags:
            walk.model, walk.variants = tags[loc.pop(0)], models
            return True
        walk.model, walk.variants = None, models
        return True
    walk.model, walk.variants = models[0], models
    return True


def locate(root: Any, loc: tuple[Any, ...]) -> tuple[tuple[str | int, ...], list[Any], _Walk]:
    """Split a pydantic location under `root` into (table path, remaining key parts, walk)."""
    walk = _Walk([], None, [])
    rest = list(loc)
    _enter(walk, root, rest)
    while rest and walk.model is not None:
        part = rest[0]
        field = walk.model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            break
        saved = (list(walk.table), walk.model, walk.variants)
        walk.table.append(part)
        rest.pop(0)
        if not _enter(walk, field.annotation, rest):
            walk.table, walk.model, walk.variants = saved
            rest.insert(0, part)
            break
    return tuple(walk.table), rest, walk


def _key_text(parts: list[Any]) -> str | None:
    if not parts:
        return None
    text = str(parts[0])
    for part in parts[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _unknown_key(name: str, walk: _Walk) -> str:
    if walk.model is None:
        return "unknown key"
    for other in walk.variants:
        if other is not walk.model and name in other.model_fields:
            tag_key = "type" if "type" in other.model_fields else "mode"
            return f"read only with {tag_key} = {_tag_of(other)}; remove it"
    return "unknown key" + suggest(name, walk.model.model_fields)


_RANGES = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
}
_TYPES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "path_type": "must be a path (a string)",
    "list_type": "must be a list",
    "dict_type": "must be a table",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "finite_number": "must be a finite number",
}


def _message(error: dict[str, Any], walk: _Walk, key: str | None) -> str:
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return _unknown_key(key or "", walk)
    if kind == "literal_error":
        expected = ctx.get("expected", "").replace("'", "")
        choices = [c.strip() for c in expected.replace(" or ", ", ").split(",")]
        hint = suggest(error["input"], choices) if isinstance(error["input"], str) else ""
        return f"must be {expected}" + hint
    if kind in _RANGES:
        bounds = {k: _number(v) for k, v in ctx.items()}
        return _RANGES[kind].format(**bounds)
    if kind in _TYPES:
        return _TYPES[kind]
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return "must start with http:// or https://"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind in ("union_tag_not_found", "union_tag_invalid", "invalid_mode"):
        tags = [str(_tag_of(m)) for m in walk.variants]
        given = error["input"].get(key or "") if isinstance(error["input"], dict) else None
        hint = suggest(given, tags) if isinstance(given, str) else ""
        return "must be " + one_of(tags) + hint
    return error["msg"]


def issues_from_pydantic(
    errors: list[dict[str, Any]], root: Any, prefix: tuple[str | int, ...]
) -> list[Issue]:
    """Our issues for pydantic's errors of a value validated as `root` at table `prefix`: the
    first MAX_REPORTED, then one counting the rest (each costs a walk and a suggestion)."""
    found: list[Issue] = []
    if len(errors) > MAX_REPORTED:
        found.append(unreported(len(errors) - MAX_REPORTED))
        errors = errors[:MAX_REPORTED]
    for error in errors:
        table, rest, walk = locate(root, error["loc"])
        value = error.get("input", MISSING)
        if error["type"] in ("union_tag_not_found", "union_tag_invalid", "invalid_mode"):
            tag_key = "mode" if error["type"] == "invalid_mode" else "type"
            rest = [tag_key]
            value = value.get(tag_key, MISSING) if isinstance(value, dict) else MISSING
        key_name = _key_text(rest)
        if error["type"] == "missing" or (key_name is None and isinstance(value, dict)):
            value = MISSING
        message = _message(error, walk, str(rest[0]) if rest else None)
        found.append(Issue(prefix + table, key_name, message, value))
    return found


# -- sections built in Python -------------------------------------------------------------------

# The classes of whole files (document.py's RunDocument) whose tables name a section's errors.
ROOTS: list[type[BaseModel]] = []


def table_root(cls: type[BaseModel]) -> type[BaseModel]:
    """Register the class of a whole file: its tables are where sections sit."""
    ROOTS.append(cls)
    _homes.cache_clear()
    return cls


def construction_error(cls: type[BaseModel], error: ValidationError) -> ConfigError:
    """The ConfigError of a section built in Python with bad keys, one line per problem."""
    home = home_of(cls)
    found = capped(issues_from_pydantic(error.errors(), cls, home or ()))
    lines = [item.render(None) if home else _class_line(cls, item) for item in found]
    failure = ConfigError("\n".join(lines))
    failure.issues = found  # type: ignore[attr-defined]
    return failure


def _class_line(cls: type, item: Issue) -> str:
    """`GrpoSampling.temperature = 0.5: rule`: the issue named from its class."""
    where = cls.__name__ + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in item.table)
    if item.key is not None:
        where += f".{item.key}"
    if item.value is not MISSING:
        where += f" = {toml_value(item.value)}"
    return f"{where}: {item.message}"


def home_of(cls: type) -> tuple[str, ...] | None:
    """The one table path where `cls` sits (("grpo", "sampling")), or None when it sits in
    several, in an array or map of tables, or in no registered file."""
    homes = _homes().get(cls, set())
    if len(homes) != 1:
        return None
    (home,) = homes
    return home


def section_classes() -> tuple[type[BaseModel], ...]:
    """Every table class of the registered files, in the order the walk first meets them."""
    return tuple(_homes())


@cache
def _homes() -> dict[type, set[tuple[str, ...] | None]]:
    found: dict[type, set[tuple[str, ...] | None]] = {}
    for root in ROOTS:
        _walk_homes(root, (), found)
    return found


def _walk_homes(model: type[BaseModel], path: tuple[str, ...] | None, found: dict) -> None:
    for name, field in model.model_fields.items():
        inner = _unwrap(field.annotation)
        contained = typing.get_origin(inner) in (list, dict)
        if contained:
            inner = typing.get_args(inner)[-1]
        for member in _models(inner):
            where = None if path is None or contained else (*path, name)
            found.setdefault(member, set()).add(where)
            _walk_homes(member, where, found)
