"""Tool and toolset definitions (`[[tool]]`, `[toolset.NAME]`) and the registry that holds them.

Three layers, because they change for different reasons: a factory is code (builtin.FACTORIES)
taking params; a tool is a definition `id@version` (the name and description the model reads,
and either a factory with params or a program to exec in the sandbox); a toolset is a named
selection of tools. Definitions come from the built-ins first, then the `files` of
[agent.environment.tools], then its inline tables, in the same format; an `id@version` or a
toolset name is never redefined, since a new behaviour is a new version. Every error names the
place: the file (or the inline table) and the tool or toolset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.config.load import parse_toml
from retrograd.errors import ConfigError

TOOL_KEYS = {"id", "version", "name", "description", "input_schema", "builtin", "exec"}
EXEC_KEYS = {"argv", "script", "protocol", "timeout_secs"}
TOOLSET_KEYS = {"include", "tools", "deny"}


@dataclass(frozen=True)
class BuiltinImpl:
    factory: str
    params: dict[str, Any]


@dataclass(frozen=True)
class ExecImpl:
    argv: tuple[str, ...]
    script: Path | None  # resolved against the declaring file's directory
    protocol: str  # "text" or "json"
    timeout_secs: float | None  # None: the sandbox's exec timeout


@dataclass(frozen=True)
class ToolDefinition:
    id: str
    version: int
    name: str | None
    description: str | None
    input_schema: dict[str, Any] | None
    impl: BuiltinImpl | ExecImpl
    place: str  # "tools.toml: [[tool]] lint@1", for errors

    @property
    def ref(self) -> str:
        return f"{self.id}@{self.version}"

    @property
    def exposed_name(self) -> str:
        return self.name or self.id


@dataclass(frozen=True)
class ToolsetDefinition:
    name: str
    include: tuple[str, ...]
    tools: tuple[str, ...]  # "id" (the latest version) or "id@version"
    deny: tuple[str, ...]  # exposed-name patterns, * a wildcard
    place: str


@dataclass(frozen=True)
class Definitions:
    tools: tuple[ToolDefinition, ...] = ()
    toolsets: tuple[ToolsetDefinition, ...] = ()


def read_definitions(path: Path) -> Definitions:
    """One definition file; its exec.script paths are relative to it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the tool definitions: {error}") from None
    data = parse_toml(text, str(path))  # invalid or nested too deep: ConfigError with the place
    extra = sorted(set(data) - {"tool", "toolset"})
    if extra:
        raise ConfigError(
            f'{path}: unknown key "{extra[0]}"; a definition file holds [[tool]] and [toolset.NAME]'
        )
    tools, toolsets = data.get("tool", []), data.get("toolset", {})
    if not isinstance(tools, list) or not isinstance(toolsets, dict):
        raise ConfigError(f"{path}: tool must be [[tool]] tables, toolset [toolset.NAME] tables")
    return parse_definitions(tools, toolsets, str(path), path.parent)


def parse_definitions(
    tools: list[Any], toolsets: dict[str, Any], source: str, base_dir: Path, table: str = ""
) -> Definitions:
    """`[[tool]]` and `[toolset.NAME]` tables of one source (a file, or the run file's
    [agent.environment.tools] with `table` naming it)."""
    parsed = []
    for index, raw in enumerate(tools):
        where = f"{source}: {table}[[tool]] {index + 1}"
        parsed.append(_tool(raw, where, base_dir, source, table))
    sets = []
    for name, raw in toolsets.items():
        sets.append(_toolset(name, raw, f"{source}: [{table}toolset.{name}]"))
    return Definitions(tuple(parsed), tuple(sets))


def _tool(raw: Any, where: str, base_dir: Path, source: str, table: str) -> ToolDefinition:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table")
    raw = {k: v for k, v in raw.items() if v is not None}  # inline tables arrive with Nones
    extra = sorted(set(raw) - TOOL_KEYS)
    if extra:
        raise ConfigError(f'{where}: unknown key "{extra[0]}"')
    tid, version = raw.get("id"), raw.get("version")
    if not isinstance(tid, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", tid):
        raise ConfigError(f"{where}: id must be a name of letters, digits, _, . and -")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{where} ({tid}): version must be an integer of at least 1")
    where = f"{source}: {table}[[tool]] {tid}@{version}"
    name, description = raw.get("name"), raw.get("description")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigError(f"{where}: name must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise ConfigError(f"{where}: description must be a string")
    schema = raw.get("input_schema")
    if schema is not None and (not isinstance(schema, dict) or schema.get("type") != "object"):
        raise ConfigError(f'{where}: input_schema must be an object schema {{type = "object"}}')
    if ("builtin" in raw) == ("exec" in raw):
        raise ConfigError(f"{where}: needs exactly one of builtin and exec")
    if "builtin" in raw:
        impl: BuiltinImpl | ExecImpl = _builtin(raw["builtin"], where)
    else:
        impl = _exec(raw["exec"], where, base_dir)
    return ToolDefinition(tid, version, name, description, schema, impl, where)


def _builtin(raw: Any, where: str) -> BuiltinImpl:
    if not isinstance(raw, dict) or set(raw) - {"factory", "params"}:
        raise ConfigError(f"{where}: builtin must be {{factory = ..., params = {{...}}}}")
    factory, params = raw.get("factory"), raw.get("params", {})
    if not isinstance(factory, str) or not isinstance(params, dict):
        raise ConfigError(f"{where}: builtin needs a factory name and a params table")
    return BuiltinImpl(factory, params)


def _exec(raw: Any, where: str, base_dir: Path) -> ExecImpl:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: exec must be a table {{argv = [...], ...}}")
    extra = sorted(set(raw) - EXEC_KEYS)
    if extra:
        raise ConfigError(f'{where}: exec: unknown key "{extra[0]}"')
    argv = raw.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ConfigError(f"{where}: exec.argv must be a non-empty list of strings")
    script = raw.get("script")
    if script is not None and (not isinstance(script, str) or not script):
        raise ConfigError(f"{where}: exec.script must be a path")
    protocol = raw.get("protocol", "text")
    if protocol not in ("text", "json"):
        raise ConfigError(f"{where}: exec.protocol must be text or json, not {protocol!r}")
    timeout = raw.get("timeout_secs")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise ConfigError(f"{where}: exec.timeout_secs must be a positive number")
    return ExecImpl(
        tuple(argv),
        None if script is None else base_dir / script,
        protocol,
        None if timeout is None else float(timeout),
    )


def _names(raw: Any, key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key} must be a list of names")
    return tuple(value)


def _toolset(name: str, raw: Any, where: str) -> ToolsetDefinition:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table")
    extra = sorted(set(raw) - TOOLSET_KEYS)
    if extra:
        raise ConfigError(
            f'{where}: unknown key "{extra[0]}"; a toolset holds include, tools and deny'
        )
    if not name.strip():
        raise ConfigError(f"{where}: a toolset name must not be blank")
    return ToolsetDefinition(
        name,
        _names(raw, "include", where),
        _names(raw, "tools", where),
        _names(raw, "deny", where),
        where,
    )


def _pattern(glob: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")))


class Registry:
    """Every tool definition by (id, version) and every toolset by name."""

    def __init__(self) -> None:
        self.tools: dict[tuple[str, int], ToolDefinition] = {}
        self.toolsets: dict[str, ToolsetDefinition] = {}

    def define(self, definitions: Definitions) -> None:
        """Add tools and toolsets; an existing id@version or toolset name is refused."""
        for tool in definitions.tools:
            key = (tool.id, tool.version)
            if key in self.tools:
                raise ConfigError(
                    f"{tool.place}: {tool.ref} is defined already ({self.tools[key].place}); "
                    "a changed tool is a new version"
                )
            self.tools[key] = tool
        for toolset in definitions.toolsets:
            if toolset.name in self.toolsets:
                raise ConfigError(
                    f"{toolset.place}: toolset {toolset.name} is defined already "
                    f"({self.toolsets[toolset.name].place})"
                )
            self.toolsets[toolset.name] = toolset

    def lookup(self, ref: str, where: str) -> ToolDefinition:
        """`id@version` exactly, or `id` at its latest version."""
        tid, _, version = ref.partition("@")
        versions = sorted(v for (i, v) in self.tools if i == tid)
        if version:
            if not version.isdigit() or int(version) not in versions:
                known = ", ".join(f"{tid}@{v}" for v in versions) or "none"
                raise ConfigError(f"{where}: unknown tool {ref} (defined: {known})")
            return self.tools[(tid, int(version))]
        if not versions:
            raise ConfigError(f"{where}: unknown tool {ref}")
        return self.tools[(tid, versions[-1])]

    def expand(self, name: str, where: str, stack: tuple[str, ...] = ()) -> list[ToolDefinition]:
        """A toolset's tools in order: its includes first, then its own tools (each replacing
        an earlier one with the same id or the same exposed name), its deny patterns last."""
        if name in stack:
            raise ConfigError(
                f"{where}: toolsets include each other: {' -> '.join(stack)} -> {name}"
            )
        if name not in self.toolsets:
            known = ", ".join(sorted(self.toolsets))
            raise ConfigError(f"{where}: unknown toolset {name} (defined: {known})")
        toolset = self.toolsets[name]
        out: list[ToolDefinition] = []
        for include in toolset.include:
            for tool in self.expand(include, toolset.place, (*stack, name)):
                _replace_or_add(out, tool)
        for ref in toolset.tools:
            _replace_or_add(out, self.lookup(ref, toolset.place))
        patterns = [_pattern(glob) for glob in toolset.deny]
        out = [t for t in out if not any(p.fullmatch(t.exposed_name) for p in patterns)]
        if not out:
            raise ConfigError(f"{toolset.place}: the toolset selects no tools")
        return out


def _replace_or_add(tools: list[ToolDefinition], tool: ToolDefinition) -> None:
    tools[:] = [t for t in tools if t.id != tool.id and t.exposed_name != tool.exposed_name]
    tools.append(tool)
