"""The MCP servers of a run: [[agent.mcp_servers]] and mcp.json files merged into plans.

An mcp.json file is in the common format `{"mcpServers": {"NAME": {...}}}` with the keys
command, args, env, cwd (local) or url, headers (remote), and type ("stdio" | "http"), disabled,
timeout (seconds per tool call). It is read strictly: unknown keys, type "sse", both or neither
of command and url, and a name declared by two files are refused, naming file and key. A
disabled entry is skipped with a warning; a relative cwd resolves against the json file.

A [[agent.mcp_servers]] entry named like a file's server overlays policy only (allowed_tools,
denied_tools, required, stateless, tool_timeout_secs, max_tool_result_bytes, env_passthrough,
the keys it writes itself): how to start the server comes from the file. `${VAR}` in env and
headers values is expanded once, after merging, from this process's environment; a missing
variable is an error. This module starts nothing; mcp.py connects the plans.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrograd import nesting
from retrograd.config.agent import AgentSection, McpServer
from retrograd.errors import ConfigError

log = logging.getLogger(__name__)

FILE_KEYS = {"command", "args", "env", "url", "type", "headers", "disabled", "cwd", "timeout"}
POLICY = (
    "allowed_tools",
    "denied_tools",
    "required",
    "stateless",
    "tool_timeout_secs",
    "max_tool_result_bytes",
    "env_passthrough",
)
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET = re.compile(r"key|token|secret|password|auth", re.IGNORECASE)


@dataclass(frozen=True)
class ServerPlan:
    """One MCP server as it will be started: transport, then policy. `where` names its source
    in messages ("[agent.mcp_servers] NAME" or "FILE: mcpServers.NAME")."""

    name: str
    where: str
    command: tuple[str, ...] | None = None
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    allowed_tools: tuple[str, ...] | None = None
    denied_tools: tuple[str, ...] = ()
    required: bool = True
    stateless: bool = False
    tool_timeout_secs: float = 30.0
    max_tool_result_bytes: int = 65536
    env_passthrough: tuple[str, ...] | None = None

    def offers(self, tool: str) -> bool:
        """allowed_tools (all when unset) minus denied_tools; `*` is a wildcard, deny wins."""
        if any(_matches(p, tool) for p in self.denied_tools):
            return False
        return self.allowed_tools is None or any(_matches(p, tool) for p in self.allowed_tools)

    def process_env(self) -> dict[str, str]:
        """A local server's environment: PATH, HOME and env_passthrough (everything when unset)
        from this process, then the server's env."""
        if self.env_passthrough is None:
            inherited = dict(os.environ)
        else:
            names = ("PATH", "HOME", *self.env_passthrough)
            inherited = {n: os.environ[n] for n in names if n in os.environ}
        return inherited | self.env


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), name) is not None


def server_plans(agent: AgentSection, base_dir: Path) -> list[ServerPlan]:
    """Every enabled server of the run, [[agent.mcp_servers]] first, then the files' in order."""
    files: dict[str, ServerPlan] = {}
    for path in agent.mcp_config or ():
        path = path if path.is_absolute() else base_dir / path
        for plan in read_mcp_json(path):
            if plan.name in files:
                raise ConfigError(f"{plan.where}: already declared by {files[plan.name].where}")
            files[plan.name] = plan
    plans = []
    for server in agent.mcp_servers:
        if server.name in files:
            plans.append(_overlay(files.pop(server.name), server))
        else:
            plans.append(_from_toml(server, base_dir))
    plans += files.values()
    plans = [p for p in plans if p.command is not None or p.url is not None]  # not disabled
    for plan in plans:
        _warn_literal_secrets(plan)
    plans = [_expanded(p) for p in plans]
    if agent.environment is not None:
        for plan in plans:
            if not plan.stateless:
                raise ConfigError(
                    f"{plan.where}: must be stateless (stateless = true in a matching "
                    "[[agent.mcp_servers]] entry) when [agent.environment] is declared"
                )
    return plans


def _from_toml(server: McpServer, base_dir: Path) -> ServerPlan:
    cwd = server.cwd
    if cwd is not None and not cwd.is_absolute():
        cwd = base_dir / cwd
    return ServerPlan(
        server.name,
        f"[agent.mcp_servers] {server.name}",
        command=tuple(server.command) if server.command else None,
        url=server.url,
        env=dict(server.env or {}),
        headers=dict(server.headers or {}),
        cwd=cwd,
        **_policy(server, everything=True),
    )


def _overlay(plan: ServerPlan, server: McpServer) -> ServerPlan:
    if plan.command is None and plan.url is None:  # disabled in its file
        return plan
    return replace(plan, **_policy(server, everything=False))


def _policy(server: McpServer, everything: bool) -> dict[str, Any]:
    out = {}
    for key in POLICY:
        if everything or server.is_set(key):
            value = getattr(server, key)
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


def read_mcp_json(path: Path) -> list[ServerPlan]:
    """The servers of one mcp.json file; a disabled one comes back without command or url."""
    try:
        document = nesting.loads(path.read_text())  # TooDeep: a JSONDecodeError
    except OSError as e:
        raise ConfigError(f"[agent].mcp_config = {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    if not isinstance(document, dict) or not isinstance(document.get("mcpServers"), dict):
        raise ConfigError(f'{path}: expected {{"mcpServers": {{"NAME": {{...}}}}}}')
    extra = sorted(set(document) - {"mcpServers"})
    if extra:
        raise ConfigError(f'{path}: unknown key "{extra[0]}"; the file holds mcpServers')
    return [_entry(path, name, e) for name, e in document["mcpServers"].items()]


def _entry(path: Path, name: str, entry: Any) -> ServerPlan:
    where = f"{path}: mcpServers.{name}"
    if not name or not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object named by a non-empty string")
    extra = sorted(set(entry) - FILE_KEYS)
    if extra:
        raise ConfigError(
            f'{where}: unknown key "{extra[0]}"; known: {", ".join(sorted(FILE_KEYS))}'
        )
    kind = entry.get("type")
    if kind == "sse":
        raise ConfigError(f'{where}.type: "sse" is not supported; use a streamable HTTP url')
    if kind not in (None, "stdio", "http"):
        raise ConfigError(f'{where}.type: must be "stdio" or "http", not {json.dumps(kind)}')
    if ("command" in entry) == ("url" in entry):
        raise ConfigError(f"{where}: needs exactly one of command (local) and url (remote)")
    local = "command" in entry
    if kind is not None and (kind == "stdio") != local:
        raise ConfigError(
            f'{where}.type: "{kind}" does not go with {"command" if local else "url"}'
        )
    for key in ("args", "env", "cwd") if not local else ("headers",):
        if key in entry:
            raise ConfigError(f"{where}.{key}: only for a {'remote' if local else 'local'} server")
    disabled = _typed(entry, "disabled", bool, where, False)
    if disabled:
        log.warning("%s: disabled; skipped", where)
        return ServerPlan(name, where)
    timeout = entry.get("timeout", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{where}.timeout: must be a number of seconds above 0")
    command, url, cwd = None, None, None
    if local:
        program = _typed(entry, "command", str, where)
        args = _typed(entry, "args", list, where, [])
        if not program or not all(isinstance(a, str) for a in args):
            raise ConfigError(f"{where}: command must be a non-empty string and args strings")
        command = (program, *args)
        if "cwd" in entry:
            cwd = path.parent / _typed(entry, "cwd", str, where)
    else:
        url = _typed(entry, "url", str, where)
        if not re.match(r"^https?://.+", url):
            raise ConfigError(f"{where}.url: must be an http or https URL, not {url}")
    return ServerPlan(
        name,
        where,
        command=command,
        url=url,
        env=_strings(entry, "env", where),
        headers=_strings(entry, "headers", where),
        cwd=cwd,
        tool_timeout_secs=float(timeout),
    )


def _typed(entry: dict, key: str, kind: type, where: str, default: Any = None) -> Any:
    value = entry.get(key, default)
    if not isinstance(value, kind):
        raise ConfigError(f"{where}.{key}: must be a {kind.__name__}, not {json.dumps(value)}")
    return value


def _strings(entry: dict, key: str, where: str) -> dict[str, str]:
    value = _typed(entry, key, dict, where, {})
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise ConfigError(f"{where}.{key}.{bad[0]}: must be a string")
    return dict(value)


def _warn_literal_secrets(plan: ServerPlan) -> None:
    for table, values in (("env", plan.env), ("headers", plan.headers)):
        for key, value in values.items():
            if SECRET.search(key) and value and not VARIABLE.search(value):
                log.warning(
                    "%s: %s.%s holds a literal secret; write ${VAR} and set VAR in the "
                    "environment instead",
                    plan.where,
                    table,
                    key,
                )


def _expanded(plan: ServerPlan) -> ServerPlan:
    def expand(table: str, values: dict[str, str]) -> dict[str, str]:
        def one(key: str, match: re.Match) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ConfigError(f"{plan.where}: {table}.{key} uses ${{{name}}}, which is not set")
            return os.environ[name]

        return {k: VARIABLE.sub(lambda m, k=k: one(k, m), v) for k, v in values.items()}

    return replace(plan, env=expand("env", plan.env), headers=expand("headers", plan.headers))
