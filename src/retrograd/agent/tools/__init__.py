"""Sandbox tools and toolsets of container and local environments (formats.md §4.1).

    catalog = load_catalog(env.tools, base_dir)     # built-ins, files, inline definitions
    catalog.specs("python")                          # what the model sees
    catalog.entries()[0].tool.call(sandbox, {...})   # an Observation

`base.py` holds the Tool interface and the frozen rendering, `builtin.py` the built-in tools
and toolsets, `exec_tool.py` tools that run a program in the sandbox, `definitions.py` the
`[[tool]]` / `[toolset.NAME]` format and its registry, `catalog.py` the resolved catalog.
Nothing here knows whether a sandbox is a directory or a container, nor anything of MCP.
"""

from retrograd.agent.tools.base import Tool, render_exec
from retrograd.agent.tools.catalog import Catalog, CatalogEntry, builtin_registry, load_catalog

__all__ = ["Catalog", "CatalogEntry", "Tool", "builtin_registry", "load_catalog", "render_exec"]
