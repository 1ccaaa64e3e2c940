"""Writing a run file: the TOML text of a RunConfig, which `load_run` reads back equal.

A config becomes a document first: every section that is not None, each holding the keys set
on it (written in the file, passed in Python, or filled in by the loader), never a default the
file left out, so that a key a rule reads only when it is written ("read only with ...")
stays unwritten. Then the document becomes TOML: a table's plain keys, then its sub-tables
(`[grpo.sampling]`), then its arrays of tables (`[[agent.mcp_servers]]`); a table inside an
array of plain values is written inline. Paths are written as the config holds them (absolute
once loaded or built), so the file means the same wherever it is saved. Nothing here knows a
section's meaning; the writer is TOML's own rules and no more (TOML has no null: None is left
out, and a value TOML cannot hold is a ConfigError naming its key).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from retrograd.errors import ConfigError

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def document(config: BaseModel) -> dict[str, Any]:
    """The run document of a config: {section: {key: value}}, set keys only, None left out."""
    out: dict[str, Any] = {}
    for name, field in type(config).model_fields.items():
        section = getattr(config, name)
        if section is None:
            continue
        table = section_document(section)
        if table or field.default is None:  # an empty table the loader fills in is left out
            out[name] = table
    return out


def section_document(section: BaseModel) -> dict[str, Any]:
    """One section's set keys, nested sections as dicts, Paths kept (values as validated)."""
    return section.model_dump(mode="python", exclude_unset=True, exclude_none=True)


def dumps(doc: dict[str, Any]) -> str:
    """TOML text of a document whose top level holds tables (a run file's sections)."""
    lines: list[str] = []
    for name, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: a run file's top level holds tables, not {table!r}")
        _table(lines, [name], table, array=False)
    return "\n".join(lines).lstrip("\n") + "\n"


def key_text(key: str) -> str:
    """A key bare when TOML allows it (`group_size`), else quoted (`"my key"`)."""
    return key if _BARE_KEY.match(key) else _string(key)


def value_text(value: Any, where: str = "value") -> str:
    """One TOML value: strings quoted, booleans lowercase, tables inline. TypeError for what
    TOML cannot hold (None, an object); ValueError for a lone surrogate in a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str | Path):
        return _string(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(v, where) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{key_text(str(k))} = {value_text(v, where)}" for k, v in value.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"{where}: TOML cannot hold {type(value).__name__} {value!r}")


def _string(text: str) -> str:
    # JSON's escapes are TOML's (\" \\ \n \t \uXXXX); TOML also wants DEL escaped.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{text[:40]!r}: a lone surrogate cannot be written") from None
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, list | tuple) and bool(value) and all(isinstance(v, dict) for v in value)
    )


def _table(lines: list[str], path: list[str], table: dict[str, Any], *, array: bool) -> None:
    header = ".".join(key_text(p) for p in path)
    lines += ["", f"[[{header}]]" if array else f"[{header}]"]
    subtables, arrays = [], []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict):
            subtables.append((key, value))
        elif _is_table_array(value):
            arrays.append((key, value))
        else:
            dotted = ".".join([*path, key])
            try:
                lines.append(f"{key_text(key)} = {value_text(value, dotted)}")
            except (TypeError, ValueError) as error:
                raise ConfigError(
                    f"[{header}].{key}: cannot be written as TOML ({error})"
                ) from None
    for key, value in subtables:
        _table(lines, [*path, key], value, array=False)
    for key, items in arrays:
        for item in items:
            _table(lines, [*path, key], item, array=True)
