"""The resolved run, key by key, and where each value came from: the first lines of a verbose run.

Every key of every section the run has is listed with its value and its origin: `file` (the run
file wrote it), `default`, `--model` / `--device` (the command line), or `derived` (filled in
from other keys by the loader, such as output.kind or reference.ctx). Knows the section models
and the parsed document, not logging: `load.py` sends the lines to the `retrograd.config` logger.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from retrograd.config.document import RunDocument
from retrograd.config.report import _models, toml_value


def resolved_lines(
    config: RunDocument, data: dict[str, Any], overrides: dict[str, str] | None = None
) -> list[str]:
    """`[table].key = value (origin)` for every key of the run; `overrides` maps
    "model.path" / "model.device" to the flag that set it."""
    lines: list[str] = []
    for name in RunDocument.model_fields:
        section = getattr(config, name)
        if section is not None:
            lines += _section(name, section, data.get(name), overrides or {})
    return lines


def _section(table: str, section: BaseModel, raw: Any, overrides: dict[str, str]) -> list[str]:
    raw = raw if isinstance(raw, dict) else {}
    lines: list[str] = []
    for key, value in _keys(section):
        where = f"{table}.{key}"
        if isinstance(value, BaseModel):
            lines += _section(where, value, raw.get(key), overrides)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            items = raw.get(key) if isinstance(raw.get(key), list) else []
            for i, item in enumerate(value):
                inner = items[i] if i < len(items) else None
                lines += _section(f"{where}[{i}]", item, inner, overrides)
        elif (
            isinstance(value, dict)
            and value
            and all(isinstance(v, BaseModel) for v in value.values())
        ):
            named = raw.get(key) if isinstance(raw.get(key), dict) else {}
            for item_name, item in value.items():
                lines += _section(f"{where}.{item_name}", item, named.get(item_name), overrides)
        else:
            origin = _origin(section, key, value, raw, overrides.get(where))
            shown = "none" if value is None else toml_value(value, limit=400)
            lines.append(f"[{table}].{key} = {shown} ({origin})")
    return lines


def _keys(section: BaseModel) -> Iterator[tuple[str, Any]]:
    """(key, value) of the section, leaving out the nested tables it does not have."""
    for key, field in type(section).model_fields.items():
        value = getattr(section, key)
        if value is not None or not _models(field.annotation):
            yield key, value


def _default(section: BaseModel, key: str) -> Any:
    return type(section).model_fields[key].default


def _origin(section: BaseModel, key: str, value: Any, raw: dict, flag: str | None) -> str:
    if flag is not None:
        return flag
    if key in raw:
        return "file"
    return "default" if value == _default(section, key) else "derived"
