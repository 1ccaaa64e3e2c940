"""The run file's JSON Schema (draft 2020-12), generated from the section models.

Editors (Taplo, Even Better TOML) use it to complete and check run files. Besides what pydantic
writes, it says which algorithm sections a run may hold, and drops what TOML cannot express
(null) and the titles pydantic invents from key names. Rules between keys are the loader's job.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from retrograd.config.document import ALGORITHM_SECTIONS, OBSERVE_ALGORITHMS, RunDocument
from retrograd.config.report import section_classes

SCHEMA_ID = "https://retrograd.dev/schemas/run.schema.json"


@cache
def _schema() -> dict[str, Any]:
    schema = _simplify(RunDocument.model_json_schema(mode="validation"))
    _require_replaceable_keys(schema)
    schema["allOf"] = [_refused_sections(algorithm) for algorithm in ALGORITHM_SECTIONS]
    schema["title"] = "Retrograd run file"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a run file, as a fresh dict."""
    import copy

    return copy.deepcopy(_schema())


def _require_replaceable_keys(schema: dict[str, Any]) -> None:
    """A key the Python API may replace by an object (SUPPLIED_BY) is required in a file."""
    for cls in section_classes():
        keys = getattr(cls, "SUPPLIED_BY", {})
        node = schema.get("$defs", {}).get(cls.__name__)
        if keys and node is not None:
            required = {*node.get("required", ()), *keys}
            node["required"] = [name for name in cls.model_fields if name in required]


def _refused_sections(algorithm: str) -> dict[str, Any]:
    own = ALGORITHM_SECTIONS[algorithm]
    refused = [name for name in ALGORITHM_SECTIONS.values() if name != own]
    if algorithm not in OBSERVE_ALGORITHMS:
        refused.append("observe")
    return {
        "if": {
            "properties": {"run": {"properties": {"algorithm": {"const": algorithm}}}},
            "required": ["run"],
        },
        "then": {"required": [own], "properties": {name: False for name in refused}},
    }


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def _simplify(node: Any, parent_key: str | None = None) -> Any:
    if isinstance(node, list):
        return [_simplify(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _simplify(v, k) for k, v in node.items()}
    if parent_key == "properties":
        return out  # a mapping of key names, not a schema
    options = out.get("anyOf")
    if options is not None:
        kept = [o for o in options if o != {"type": "null"}]
        if len(kept) == 1:
            del out["anyOf"]
            out = {**kept[0], **out}
        else:
            out["anyOf"] = kept
    if out.get("default", 0) is None:
        del out["default"]
    elif isinstance(out.get("default"), dict):
        out["default"] = _without_none(out["default"])
    if "title" in out and "properties" not in out:
        del out["title"]  # pydantic's title-cased key names say nothing
    return out
