"""A real MCP server for the tests, built with the official SDK (mcp.server.mcpserver).

Tools: add, echo, env (a variable as the server process sees it), cwd, slow (sleeps), fail
(raises, so the SDK answers isError), big (a long result), header (a request header, over
HTTP) and crash (the process exits mid-call). Run it over stdio as
`python -m tests.factories.mcp_server` (from the repository root) or by script path, or over
streamable HTTP with `--http PORT`; `http_server()` starts that in a subprocess on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[2]

server = MCPServer("retrograd-test", log_level="ERROR")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@server.tool()
def env(name: str) -> str:
    """The value of an environment variable in the server, or <unset>."""
    return os.environ.get(name, "<unset>")


@server.tool()
def cwd() -> str:
    """The server's working directory."""
    return os.getcwd()


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def fail(message: str) -> str:
    """Always raise."""
    raise ToolError(message)


@server.tool()
def big(n: int) -> str:
    """n characters of x."""
    return "x" * n


@server.tool()
def header(name: str, ctx: Context) -> str:
    """A request header as the server received it (HTTP only)."""
    return (ctx.headers or {}).get(name.lower(), "<none>")


@server.tool()
def crash() -> str:
    """Kill the server without an answer."""
    os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stdio_command() -> list[str]:
    """argv that runs this server over stdio (by script path, from any directory)."""
    return [sys.executable, str(SCRIPT)]


@contextlib.contextmanager
def http_server(json_response: bool = False) -> Iterator[str]:
    """This server over streamable HTTP in a subprocess; yields its URL. `json_response`:
    each answer is one JSON body rather than a stream of server-sent events."""
    port = free_port()
    mode = ["--http-json"] if json_response else ["--http"]
    proc = subprocess.Popen([*stdio_command(), *mode, str(port)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the test MCP server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--http", "--http-json"):
        json_response = sys.argv[1] == "--http-json"
        server.run("streamable-http", port=int(sys.argv[2]), json_response=json_response)
    else:
        server.run()
