"""The resolved catalog of a container or local environment: every toolset made a list of built
tools, each known as `id@version`, with the hashes `tools list` prints and the signature a run's
resume check holds.

Built once when a run (or `tools list`) starts: definition files and exec scripts are read
here, so a tool is fixed for the whole run, and a script edited mid-run changes nothing until
the next start, where the signature tells resume it changed.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.agent.tools.base import Tool
from retrograd.agent.tools.builtin import BUILTIN_DEFINITIONS, FACTORIES
from retrograd.agent.tools.definitions import (
    BuiltinImpl,
    ExecImpl,
    Registry,
    ToolDefinition,
    parse_definitions,
    read_definitions,
)
from retrograd.agent.tools.exec_tool import ExecTool
from retrograd.agent.types import ToolSpec, catalog_hash
from retrograd.config.agent import ToolsConfig
from retrograd.errors import ConfigError

INLINE = "[agent.environment.tools]"
SCRIPT_LIMIT = 100_000  # bytes: a script travels as one argv element (Linux caps one at 128 KiB)


@dataclass(frozen=True)
class CatalogEntry:
    """One built tool of a toolset."""

    ref: str  # id@version
    tool: Tool
    source: dict[str, Any]  # what decides its behaviour, for the signature

    @property
    def spec(self) -> ToolSpec:
        return self.tool.spec


@dataclass(frozen=True)
class Catalog:
    """Every defined toolset, resolved. `default` serves a scenario that names no toolset;
    `selectable` (default first, then scenario_toolsets) is what a scenario may pick."""

    default: str
    selectable: tuple[str, ...]
    toolsets: dict[str, tuple[CatalogEntry, ...]]

    def entries(self, toolset: str | None = None) -> tuple[CatalogEntry, ...]:
        return self.toolsets[toolset or self.default]

    def specs(self, toolset: str | None = None) -> list[ToolSpec]:
        return [entry.spec for entry in self.entries(toolset)]

    def toolset_hash(self, toolset: str | None = None) -> str:
        """agent.types.catalog_hash of one toolset: what its model sees, and its ids."""
        entries = self.entries(toolset)
        return catalog_hash([e.spec for e in entries], [e.ref for e in entries])

    def hash(self) -> str:
        """The catalog hash: the selectable toolsets, by name, with their hashes."""
        rows = {name: self.toolset_hash(name) for name in self.selectable}
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()

    def signature(self) -> dict[str, Any]:
        """Plain JSON for a run's resume signature: the selectable toolsets and every
        definition they use, exec scripts by their sha256."""
        tools: dict[str, Any] = {}
        for name in self.selectable:
            for entry in self.toolsets[name]:
                spec = entry.spec
                tools[entry.ref] = {
                    "name": spec.name,
                    "description": spec.description,
                    "input_schema": spec.input_schema,
                    **entry.source,
                }
        return {
            "default": self.default,
            "selectable": list(self.selectable),
            "toolsets": {n: [e.ref for e in self.toolsets[n]] for n in self.selectable},
            "tools": tools,
            "catalog_hash": self.hash(),
        }


def builtin_registry() -> Registry:
    registry = Registry()
    data = tomllib.loads(BUILTIN_DEFINITIONS)
    registry.define(parse_definitions(data["tool"], data["toolset"], "built-in", Path(".")))
    return registry


def load_catalog(tools: ToolsConfig, base_dir: Path) -> Catalog:
    """[agent.environment.tools] resolved: built-ins, then `files`, then inline definitions;
    relative paths (files, inline scripts) resolve against `base_dir`, the run file's folder."""
    registry = builtin_registry()
    for path in tools.files or ():
        registry.define(read_definitions(base_dir / path))
    inline_tools = [t.model_dump(exclude_none=True) for t in tools.tool]
    inline_sets = {n: s.model_dump() for n, s in tools.toolset.items()}
    registry.define(parse_definitions(inline_tools, inline_sets, INLINE, base_dir))
    selectable = tuple(dict.fromkeys([tools.default, *(tools.scenario_toolsets or ())]))
    # Every definition is built, used or not, so that a broken one is an error today.
    built = {d.ref: build_entry(d) for d in registry.tools.values()}
    toolsets = {
        name: tuple(built[d.ref] for d in registry.expand(name, INLINE))
        for name in sorted(registry.toolsets)
    }
    for name in selectable:
        if name not in toolsets:
            key = "default" if name == tools.default else "scenario_toolsets"
            known = ", ".join(sorted(toolsets))
            raise ConfigError(f"{INLINE}.{key}: unknown toolset {name} (defined: {known})")
    return Catalog(tools.default, selectable, toolsets)


def build_entry(definition: ToolDefinition) -> CatalogEntry:
    """The tool a definition describes, with the name and description it gives."""
    impl = definition.impl
    if isinstance(impl, BuiltinImpl):
        factory = FACTORIES.get(impl.factory)
        if factory is None:
            known = ", ".join(FACTORIES)
            raise ConfigError(
                f"{definition.place}: unknown factory {impl.factory!r} (built-in: {known})"
            )
        tool = factory(impl.params, f"{definition.place}: builtin {impl.factory}")
        schema = definition.input_schema
        if schema is not None and schema != tool.spec.input_schema:
            raise ConfigError(
                f"{definition.place}: a builtin tool keeps its own input_schema; define an exec "
                "tool to take other arguments"
            )
        tool = tool.presented(definition.exposed_name, definition.description)
        source = {"builtin": {"factory": impl.factory, "params": impl.params}}
        return CatalogEntry(definition.ref, tool, source)
    return _exec_entry(definition, impl)


def _exec_entry(definition: ToolDefinition, impl: ExecImpl) -> CatalogEntry:
    argv = list(impl.argv)
    script_sha = None
    if impl.script is not None:
        try:
            data = impl.script.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(
                f"{definition.place}: cannot read exec.script {impl.script}: {error}"
            ) from None
        if len(data) > SCRIPT_LIMIT:
            raise ConfigError(
                f"{definition.place}: exec.script {impl.script} holds {len(data)} bytes; a "
                f"script travels as one argument, at most {SCRIPT_LIMIT}"
            )
        argv.append(text)
        script_sha = hashlib.sha256(data).hexdigest()
    spec = ToolSpec(
        definition.exposed_name,
        definition.description or "",
        definition.input_schema or {"type": "object", "properties": {}},
    )
    tool = ExecTool(spec, argv, impl.protocol, impl.timeout_secs)
    source = {
        "exec": {
            "argv": list(impl.argv),
            "script_sha256": script_sha,
            "protocol": impl.protocol,
            "timeout_secs": impl.timeout_secs,
        }
    }
    return CatalogEntry(definition.ref, tool, source)
