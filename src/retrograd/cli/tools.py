"""List the tools an agentic run offers: its toolsets resolved, each tool as id@version.

Reads an agent_grpo run file's [agent.environment.tools] (built-in tools and toolsets, the
definition files and the inline tables), builds every toolset as a run would, and prints the
selectable ones (default first) with their hashes and the catalog hash a run's signature holds.
MCP servers are connected and their tools listed too, unless --no-connect. No model is loaded.

Example:
  retrograd tools list examples/agent/fix-tests.toml
  retrograd tools list run.toml --json --no-connect
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from retrograd.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tools_command", metavar="SUBCOMMAND", required=True)
    listing = sub.add_parser("list", help="print the resolved catalog and its hash")
    listing.add_argument("config", metavar="CONFIG.toml", help="the run file (agent_grpo)")
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    listing.add_argument(
        "--no-connect", action="store_true", help="name the MCP servers without connecting"
    )


def run(args: argparse.Namespace) -> int:
    from retrograd.cli.common import placeholder_model
    from retrograd.config import load_run

    cfg = load_run(args.config, model=placeholder_model(args.config))
    if cfg.run.algorithm != "agent_grpo":
        raise ConfigError(
            f"{args.config}: [run].algorithm = {cfg.run.algorithm!r}: tools list reads an "
            "agent_grpo run file"
        )
    base_dir = Path(args.config).resolve().parent
    report = catalog_report(cfg.agent, base_dir, connect=not args.no_connect)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def catalog_report(agent, base_dir: Path, connect: bool) -> dict[str, Any]:
    """What `tools list` shows, as plain JSON."""
    env = agent.environment
    report: dict[str, Any] = {"environment": env.type if env else None}
    if env is not None and env.type in ("container", "local"):
        from retrograd.agent.tools.catalog import load_catalog

        catalog = load_catalog(env.tools, base_dir)
        report["default"] = catalog.default
        report["toolsets"] = {
            name: {
                "selectable": name in catalog.selectable,
                "hash": catalog.toolset_hash(name),
                "tools": [_tool_row(entry) for entry in catalog.entries(name)],
            }
            for name in (
                *catalog.selectable,
                *sorted(set(catalog.toolsets) - set(catalog.selectable)),
            )
        }
        report["catalog_hash"] = catalog.hash()
    elif env is not None:
        report["tools_url"] = env.base_url.rstrip("/") + "/tools"
    report["mcp"] = _mcp(agent, base_dir, connect)
    return report


def _tool_row(entry) -> dict[str, Any]:
    spec = entry.spec
    tid, _, version = entry.ref.partition("@")
    return {
        "ref": entry.ref,
        "id": tid,
        "version": int(version),
        "name": spec.name,
        "description": spec.description,
        "input_schema": spec.input_schema,
        "kind": "builtin" if "builtin" in entry.source else "exec",
    }


def _mcp(agent, base_dir: Path, connect: bool) -> dict[str, Any]:
    """MCP servers by name; with `connect`, their tools through retrograd.agent.mcp.list_tools
    (the hook that module provides), when it is installed."""
    servers = _server_names(agent, base_dir)
    out: dict[str, Any] = {"servers": servers, "connected": False, "tools": []}
    if not servers:
        return out
    out["note"] = "--no-connect"
    if not connect:
        return out
    mcp = _optional_module("retrograd.agent.mcp")
    if mcp is None or not hasattr(mcp, "list_tools"):
        out["note"] = "MCP support is not installed"
        return out
    del out["note"]
    out["tools"] = [_mcp_row(row) for row in mcp.list_tools(agent, base_dir)]
    out["connected"] = True
    return out


def _mcp_row(row: Any) -> dict[str, Any]:
    if isinstance(row, dict):
        return {k: row[k] for k in ("server", "name", "tool", "description") if k in row}
    return {"name": row.name, "description": row.description}  # a ToolSpec


def _server_names(agent, base_dir: Path) -> list[str]:
    config = _optional_module("retrograd.agent.mcp_config")
    if config is not None and hasattr(config, "server_plans"):
        return [plan.name for plan in config.server_plans(agent, base_dir)]
    return [server.name for server in agent.mcp_servers]


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None  # the module, or a package it needs (the MCP SDK), is not installed


def render(report: dict[str, Any]) -> str:
    lines = []
    if report["environment"] is None:
        lines.append("no [agent.environment]: the policy has only MCP tools")
    elif "tools_url" in report:
        lines.append(
            f"http environment: its tools come from GET {report['tools_url']} when a run starts"
        )
    toolsets = report.get("toolsets", {})
    for name, toolset in toolsets.items():
        if not toolset["selectable"]:
            continue
        role = "default" if name == report["default"] else "selectable"
        lines.append(f"toolset {name} ({role}), hash {toolset['hash'][:16]}")
        width = max(len(t["ref"]) for t in toolset["tools"])
        names = max(len(t["name"]) for t in toolset["tools"])
        for t in toolset["tools"]:
            lines.append(f"  {t['ref']:<{width}}  {t['name']:<{names}}  {t['description']}")
    others = [name for name, toolset in toolsets.items() if not toolset["selectable"]]
    if others:
        lines.append(f"other toolsets (not selectable): {', '.join(others)}")
    if "catalog_hash" in report:
        lines.append(f"catalog hash: {report['catalog_hash']}")
    mcp = report["mcp"]
    if mcp["connected"]:
        lines.append("mcp tools:")
        lines += [f"  {t['name']}  {t.get('description') or ''}".rstrip() for t in mcp["tools"]]
    elif mcp["servers"]:
        lines.append(f"mcp servers: {', '.join(mcp['servers'])} (not connected: {mcp['note']})")
    return "\n".join(lines)
