"""The key tables of docs/configuration.md, generated from the section models.

`python -m retrograd.config.docs docs/configuration.md` rewrites the part of the page between
the two markers; a test checks the page is in sync. The "At run time" column comes from
`availability.py`. The prose around the tables is written by hand.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from retrograd.config.availability import availability
from retrograd.config.document import RunDocument
from retrograd.config.report import _models, _tag_of, _unwrap, toml_value

BEGIN = "<!-- BEGIN GENERATED KEY TABLES: python -m retrograd.config.docs docs/configuration.md -->"
END = "<!-- END GENERATED KEY TABLES -->"


def key_tables() -> str:
    """Markdown: one table per TOML table, in file order, nested tables after their parent."""
    parts: list[str] = []
    for table in toml_tables():
        heading = f"[[{table.name}]]" if table.array else f"[{table.name}]"
        parts.append(f"### `{heading}`{table.variant}\n")
        parts.append(f"{_prose(table.model.__doc__ or table.about)}\n")
        _rows(table.name, table.model, parts)
    return "\n".join(parts).rstrip() + "\n"


def documented_keys() -> list[tuple[str, str]]:
    """(table, key) of every key the tables list, e.g. ("grpo.judge", "timeout_secs")."""
    return [
        (table.name, key)
        for table in toml_tables()
        for key, field in table.model.model_fields.items()
        if not _holds_tables(field.annotation)
    ]


@dataclass(frozen=True)
class TomlTable:
    name: str  # dotted, e.g. "agent.environment.tools.toolset.NAME"
    model: type[BaseModel]
    about: str  # the parent's description of the field, when the model has no docstring
    variant: str = ""  # ' with type = "ruler"' for one member of a tagged union
    array: bool = False  # [[name]]


def toml_tables() -> Iterator[TomlTable]:
    """Every TOML table of a run file, in file order, nested tables after their parent."""
    for name, field in RunDocument.model_fields.items():
        yield from _tables(name, field.annotation, field.description or "")


def _tables(name: str, annotation: Any, about: str, array: bool = False) -> Iterator[TomlTable]:
    inner = _unwrap(annotation)
    origin = typing.get_origin(inner)
    if origin is list:
        yield from _tables(name, typing.get_args(inner)[0], about, array=True)
        return
    if origin is dict:
        yield from _tables(f"{name}.NAME", typing.get_args(inner)[1], about)
        return
    models = _models(inner)
    for model in models:
        variant = ""
        if len(models) > 1:
            tag = "type" if "type" in model.model_fields else "mode"
            variant = f' with {tag} = "{_tag_of(model)}"'
        yield TomlTable(name, model, about, variant, array)
        for key_name, field in model.model_fields.items():
            if _holds_tables(field.annotation):
                yield from _tables(f"{name}.{key_name}", field.annotation, field.description or "")


def _holds_tables(annotation: Any) -> bool:
    inner = _unwrap(annotation)
    if typing.get_origin(inner) in (list, dict):
        inner = typing.get_args(inner)[-1]
    return bool(_models(inner))


def _rows(table: str, model: type[BaseModel], parts: list[str]) -> None:
    rows = [
        "| Key | Type | Default | Description | At run time |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key_name, field in model.model_fields.items():
        if _holds_tables(field.annotation):
            continue  # a nested table, documented under its own heading
        rows.append(
            f"| `{key_name}` | {_type_text(field.annotation)} "
            f"| {_default_text(field, key_name in getattr(model, 'SUPPLIED_BY', {}))} "
            f"| {_prose(field.description or '')} "
            f"| {_cell(availability(table, key_name).column)} |"
        )
    parts.append("\n".join(rows) + "\n")


def _prose(text: str) -> str:
    """Docstring or description as table-safe markdown, without the `[table]: ` lead-in."""
    text = re.sub(r"^(\[[^\]]+\]|type = \"\w+\")(\s*/\s*\[[^\]]+\])*: ", "", text.strip())
    return _cell(text[0].upper() + text[1:] if text else text)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")


def _default_text(field: Any, replaceable: bool = False) -> str:
    """`required` (also for a key only the Python API may replace), `none`, or the value."""
    if field.default is PydanticUndefined or replaceable:
        return "required"
    if field.default is None:
        return "none"
    return f"`{toml_value(field.default, limit=80)}`".replace("|", "/")


def _type_text(annotation: Any) -> str:
    inner = _unwrap(annotation)
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        return " / ".join(f"`{toml_value(v)}`" for v in typing.get_args(inner))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(inner) if a is not type(None))
    if origin is list:
        return f"list of {_type_text(typing.get_args(inner)[0])}"
    if origin is dict:
        return "table"
    names = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "path"}
    return names.get(inner, getattr(inner, "__name__", str(inner)))


def sync(page: Path) -> bool:
    """Rewrite the generated part of `page`; True when it changed."""
    text = page.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n\n{key_tables()}\n{END}{tail}"
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    changed = sync(Path(sys.argv[1]))
    print(f"{sys.argv[1]}: {'updated' if changed else 'already in sync'}")
