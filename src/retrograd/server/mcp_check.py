"""Startup check of the [[mcp_server]] catalogue (formats.md §9.1): a required server that
cannot connect stops the server from starting, before it listens.

Each required entry is connected as a run would connect it (agent/mcp.py's hub) and closed
again; optional ones are left for the runs that use them. Imports the MCP SDK, not torch.
"""

from __future__ import annotations

from pathlib import Path

from retrograd.errors import ConfigError, RetrogradError
from retrograd.server.config import ServerConfig


def check_required_mcp(config: ServerConfig, base_dir: Path) -> None:
    """ConfigError naming the entry when a required [[mcp_server]] cannot connect."""
    from retrograd.agent.mcp import McpHub
    from retrograd.config.agent import AgentSection, McpServer

    for i, entry in enumerate(config.mcp_server):
        if not entry.required:
            continue
        fields = entry.model_dump(exclude={"id", "description"}, exclude_none=True)
        server = McpServer.model_validate({**fields, "name": entry.name or entry.id})
        # only the keys the hub reads: the rest of an [agent] table is a run's business
        agent = AgentSection.model_construct(
            mcp_servers=[server], mcp_config=None, environment=None
        )
        try:
            McpHub.open(agent, base_dir).close()
        except RetrogradError as error:
            raise ConfigError(
                f'[mcp_server][{i}] id = "{entry.id}": required, and it cannot connect: {error}'
            ) from None
