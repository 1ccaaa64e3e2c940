"""MCP servers made live for a run: one background event loop owns every session.

`McpHub.open` starts the plans of mcp_config.py (stdio servers as subprocesses, remote ones
over streamable HTTP with their headers), lists their tools and exposes each offered tool as
SERVER__TOOL. The SDK is async; the hub is not: `call` may be used from many threads at once,
each call a task on the hub's loop. Each server's session lives in one owner task that enters
and leaves its transport, because anyio scopes must exit in the task that entered them.

Tool-level trouble is an observation with is_error (the server's isError, a timeout, a
JSON-RPC error, arguments JSON cannot carry); a lost connection raises EnvironmentFailure. So does a remote server's reply over 8 x
max_tool_result_bytes, at least 16 MiB (replies.py; the SDK bounds one server-sent event to
1 MiB itself): the SDK closes the session on it, and the failure names the cap. A
required server that cannot connect fails `open`; an optional one is skipped with a warning;
all of them failing is an error.
A local server sees PATH, HOME and its env_passthrough variables (the SDK adds LOGNAME, SHELL,
TERM and USER too), or this process's whole environment when env_passthrough is unset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, PaginatedRequestParams

from retrograd.agent.http_env import cap_text, reply_bytes
from retrograd.agent.mcp_config import ServerPlan, server_plans
from retrograd.agent.types import Observation, ToolSpec, quoted
from retrograd.config.agent import AgentSection
from retrograd.errors import ConfigError, EnvironmentFailure, RetrogradError
from retrograd.replies import cap_replies
from retrograd.tokenizer.toolcalls import argument_problem

log = logging.getLogger(__name__)

SEPARATOR = "__"  # SERVER__TOOL
CONNECT_TIMEOUT_SECS = 30.0  # start, initialize and list tools
CLOSE_TIMEOUT_SECS = 10.0


class McpServerError(RetrogradError):
    """An MCP server the run needs cannot be reached; the message names it and says why."""


@dataclass
class _Server:
    plan: ServerPlan
    session: ClientSession
    stop: asyncio.Event
    task: asyncio.Task
    refused: list[str]  # replies.py's refusals: the SDK reports them as a closed connection


class McpHub:
    """The run's MCP sessions; `tools` is the catalog they add beside the environment's."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="retrograd-mcp", daemon=True
        )
        self._thread.start()
        self._servers: list[_Server] = []
        self._routes: dict[str, tuple[_Server, str]] = {}  # exposed name -> server, tool
        self.tools: list[ToolSpec] = []
        self._closed = False

    @classmethod
    def open(cls, agent: AgentSection, base_dir: str | Path) -> McpHub:
        """Connect every server of the run; McpServerError when a required one (or all of
        them) cannot connect, ConfigError for a broken declaration."""
        plans = server_plans(agent, Path(base_dir))
        hub = cls()
        try:
            hub._connect(plans)
        except BaseException:
            hub.close()
            raise
        return hub

    def _run(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _connect(self, plans: list[ServerPlan]) -> None:
        results = self._run(self._start_all(plans))
        self._servers = [r[0] for r in results if isinstance(r, tuple)]  # closed on failure
        failed = []
        for plan, result in zip(plans, results, strict=True):
            if isinstance(result, tuple):
                self._expose(*result)
                continue
            reason = f"{plan.where}: cannot connect ({result})"
            failed.append(reason)
            if plan.required:
                raise McpServerError(reason)
            log.warning("%s; skipped (required = false)", reason)
        if plans and not self._servers:
            raise McpServerError("every MCP server failed to connect: " + "; ".join(failed))

    def _expose(self, server: _Server, listed: list) -> None:
        plan = server.plan
        for tool in listed:
            if not plan.offers(tool.name):
                continue
            name = plan.name + SEPARATOR + tool.name
            if name in self._routes:
                where = self._routes[name][0].plan.where
                raise ConfigError(f"{plan.where}: tool {name} is exposed by {where} already")
            self._routes[name] = (server, tool.name)
            self.tools.append(ToolSpec(name, tool.description or "", dict(tool.input_schema)))

    async def _start_all(self, plans: list[ServerPlan]) -> list[tuple[_Server, list] | str]:
        return await asyncio.gather(*(self._start(p) for p in plans))

    async def _start(self, plan: ServerPlan) -> tuple[_Server, list] | str:
        """A connected server and its tools, or why it did not connect."""
        ready = self._loop.create_future()
        stop = asyncio.Event()
        refused: list[str] = []
        task = asyncio.create_task(self._own(plan, ready, stop, refused))
        try:
            session, listed = await asyncio.wait_for(asyncio.shield(ready), CONNECT_TIMEOUT_SECS)
        except TimeoutError:
            task.cancel()
            return f"no answer within {CONNECT_TIMEOUT_SECS:g} s"
        except Exception as e:
            return _reason(e)
        return _Server(plan, session, stop, task, refused), listed

    async def _own(
        self, plan: ServerPlan, ready: asyncio.Future, stop: asyncio.Event, refused: list[str]
    ) -> None:
        """The one task that enters, holds and leaves a server's transport and session."""
        try:
            async with AsyncExitStack() as stack:
                streams = await _transport(plan, stack, refused)
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                ready.set_result((session, await _list_tools(session)))
                await stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except BaseException as e:  # noqa: BLE001 - the transport's errors arrive grouped
            if not ready.done():
                ready.set_exception(e)
            else:
                log.debug("%s: %s while closing", plan.where, _reason(e))

    def owns(self, name: str) -> bool:
        """True when `name` is an exposed tool of this hub."""
        return name in self._routes

    def call(self, name: str, arguments: dict[str, Any]) -> Observation:
        """Run one tool call (thread-safe). Arguments JSON cannot carry are an error
        observation, never sent. Raises EnvironmentFailure when the server is lost."""
        if name not in self._routes:
            return Observation(f"unknown tool '{quoted(name)}'", is_error=True)
        problem = argument_problem(arguments)
        if problem is not None:
            return Observation(problem, is_error=True)
        server, tool = self._routes[name]
        return self._run(self._call(server, tool, arguments))

    async def _call(self, server: _Server, tool: str, arguments: dict[str, Any]) -> Observation:
        plan = server.plan
        try:
            with anyio.fail_after(plan.tool_timeout_secs):
                result = await server.session.call_tool(tool, arguments)
        except TimeoutError:
            return Observation(
                f"tool call timed out after {plan.tool_timeout_secs:g} s", is_error=True
            )
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                why = server.refused[-1] if server.refused else e.message
                raise EnvironmentFailure(f"{plan.where}: the server is gone ({why})") from None
            return Observation(e.message, is_error=True)
        except Exception as e:
            raise EnvironmentFailure(f"{plan.where}: tool {tool} failed: {_reason(e)}") from None
        text = cap_text(_text(result), plan.max_tool_result_bytes)
        return Observation(text, is_error=bool(result.is_error))

    def close(self) -> None:
        """Close every session and stop the loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._shutdown(), CLOSE_TIMEOUT_SECS + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_TIMEOUT_SECS)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        tasks = [s.task for s in self._servers]
        for server in self._servers:
            server.stop.set()
        tasks += [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        tasks = list(dict.fromkeys(tasks))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SECS)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_SECS)

    def __enter__(self) -> McpHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _transport(plan: ServerPlan, stack: AsyncExitStack, refused: list[str]):
    """The server's (read, write) streams, entered on `stack`; a remote server's replies
    are capped (replies.py), each refusal noted in `refused`."""
    if plan.command is not None:
        params = StdioServerParameters(
            command=plan.command[0],
            args=list(plan.command[1:]),
            env=plan.process_env(),
            cwd=plan.cwd,
        )
        return await stack.enter_async_context(stdio_client(params))
    # NOTE: the SDK's own client keeps its timeouts (a long read for the event stream).
    client = cap_replies(
        create_mcp_http_client(headers=plan.headers),
        reply_bytes(plan.max_tool_result_bytes),
        plan.where,
        refused,
    )
    client = await stack.enter_async_context(client)
    return await stack.enter_async_context(streamable_http_client(plan.url, http_client=client))


async def _list_tools(session: ClientSession) -> list:
    tools, cursor = [], None
    while True:
        page = await session.list_tools(
            params=None if cursor is None else PaginatedRequestParams(cursor=cursor)
        )
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _text(result) -> str:
    """A tool result as one text: its text blocks (and text resources) joined by newlines;
    the structured content when there is no block."""
    parts = []
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{block.type} content]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, sort_keys=True, ensure_ascii=False)
    return "\n".join(parts)


def _reason(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def list_tools(agent: AgentSection, base_dir: str | Path) -> list[dict[str, str]]:
    """Each offered MCP tool for `retrograd tools list`: server, exposed name, tool, description."""
    with McpHub.open(agent, base_dir) as hub:
        return [
            {
                "server": hub._routes[t.name][0].plan.name,
                "name": t.name,
                "tool": hub._routes[t.name][1],
                "description": t.description,
            }
            for t in hub.tools
        ]
