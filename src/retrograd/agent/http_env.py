"""type = "http": episodes served by an environment server over OpenEnv-style routes.

The wire format (formats.md §4.2; the call and result objects are our choice, after the
server's ToolCallView/MessageView):

    GET  /tools          -> {"tools": [{"name", "description", "input_schema"}]}   (once per run)
    POST /reset          {"scenario": {...}, "seed": n} -> {"env_id", "observation": null | str}
    POST /step           {"env_id", "call": ToolCall} -> {"result": ToolResult,
                                                          "reward": null | n, "done": bool}
    GET  /state/{env_id} -> {"done", "cumulative_reward"?, "summary"?, "metadata"?}; 404: none
    POST /close          {"env_id"} -> any 2xx, body ignored

    ToolCall   = {"id": "call_N" (N counts from 0 in the episode), "name": str, "arguments": {}}
    ToolResult = {"content": str, "is_error"?: bool}   ("reward" and "done" may be left out)

A 404 or 410 on a route carrying an env_id (state excepted), any other non-2xx answer, a
timeout (a reply still arriving request_timeout_secs after the request, however slowly it
drips), a reply over `reply_limit` bytes (read no further) or of the wrong shape (a reward that
is not a finite number, JSON nested past what the parser reads) fails the trajectory
(EnvironmentFailure naming the scenario, URL and route). Reset's observation is capped at
max_result_bytes like a result. An HTTP environment grades through its step rewards: `grades` is True and `verify`
returns None. Calls to a tool missing from /tools, and arguments JSON cannot carry
(`toolcalls.argument_problem`), are error observations that never reach the server. This
module knows nothing about tokens or the policy.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from retrograd import nesting
from retrograd.agent.types import (
    Environment,
    Episode,
    Observation,
    ToolSpec,
    finite,
    quoted,
)
from retrograd.config.agent import HttpEnvironment as HttpConfig
from retrograd.errors import EnvironmentFailure
from retrograd.text import as_text
from retrograd.tokenizer.toolcalls import argument_problem

TRUNCATED = "\n[output truncated]"
MIN_REPLY_BYTES = 16 << 20  # a reply may always hold this much (reply_limit)


def cap_text(text: str, max_bytes: int) -> str:
    """`text` (a lone surrogate made U+FFFD) cut to `max_bytes` of UTF-8, never inside a
    character, and marked when cut."""
    text = as_text(text)
    raw = text.encode()
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode(errors="ignore") + TRUNCATED


def reply_limit(config: HttpConfig) -> int:
    """The most bytes one reply may hold (reply_bytes of max_result_bytes)."""
    return reply_bytes(config.max_result_bytes)


def reply_bytes(max_result_bytes: int) -> int:
    """The most bytes one reply of a peer may hold: 8 x the result bytes kept (JSON writes a
    character of the observation in up to 6 bytes per UTF-8 byte, and the reply holds more),
    at least MIN_REPLY_BYTES. A larger one is a broken server."""
    return max(MIN_REPLY_BYTES, 8 * max_result_bytes)


def _read(response: httpx.Response, limit: int, deadline: float, place: str, late) -> bytes:
    """The reply's body, refused (EnvironmentFailure) past `limit` bytes, or with `late` past
    the `deadline` (monotonic): httpx's timeout bounds each read, not the reply, which a byte
    now and then would keep open for ever."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise EnvironmentFailure(f"{place}: the answer is over {limit} bytes")
        if time.monotonic() > deadline:
            raise late
    return bytes(body)


class HttpEnvironment(Environment):
    """One HTTP client (pool_size connections) shared by every episode of the run."""

    def __init__(self, config: HttpConfig):
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=config.headers or {},
            timeout=httpx.Timeout(config.request_timeout_secs, connect=config.connect_timeout_secs),
            limits=httpx.Limits(
                max_connections=config.pool_size, max_keepalive_connections=config.pool_size
            ),
        )
        self._tools: list[ToolSpec] | None = None
        self._lock = threading.Lock()

    def request(
        self, method: str, route: str, where: str, body: Any = None, missing_ok: bool = False
    ) -> Any:
        """One call; the decoded JSON answer (None for an empty body, or a 404 when
        missing_ok). Raises EnvironmentFailure naming `where`, the URL and the route."""
        place = f"{where}: {method} {self.base_url}{route}"
        late = EnvironmentFailure(
            f"{place}: no answer within {self.config.request_timeout_secs:g} s"
        )
        deadline = time.monotonic() + self.config.request_timeout_secs
        try:
            with self.client.stream(method, route, json=body) as response:
                content = _read(response, reply_limit(self.config), deadline, place, late)
        except httpx.TimeoutException:
            raise late from None
        except httpx.HTTPError as e:
            raise EnvironmentFailure(f"{place}: {type(e).__name__}: {e}") from None
        if missing_ok and response.status_code == 404:
            return None
        if not response.is_success:
            gone = (
                " (the environment instance is gone)" if response.status_code in (404, 410) else ""
            )
            text = content[:200].decode(errors="replace")
            raise EnvironmentFailure(f"{place}: HTTP {response.status_code}{gone}: {text}")
        if not content:
            return None
        try:
            return nesting.loads(content)
        except nesting.TooDeep as e:
            raise EnvironmentFailure(f"{place}: the answer is JSON {e}") from None
        except ValueError:
            raise EnvironmentFailure(f"{place}: the answer is not JSON") from None

    def catalog(self, scenario=None) -> list[ToolSpec]:
        with self._lock:
            if self._tools is None:
                self._tools = self._fetch_tools()
            return list(self._tools)

    def _fetch_tools(self) -> list[ToolSpec]:
        reply = self.request("GET", "/tools", "[agent.environment]")
        place = f"[agent.environment]: GET {self.base_url}/tools"
        if not isinstance(reply, dict) or not isinstance(reply.get("tools"), list):
            raise EnvironmentFailure(f'{place}: expected {{"tools": [...]}}')
        out = []
        for i, tool in enumerate(reply["tools"]):
            if not isinstance(tool, dict):
                raise EnvironmentFailure(f"{place}: tools[{i}] must be an object")
            name, description = tool.get("name"), tool.get("description", "")
            schema = tool.get("input_schema")
            if not isinstance(name, str) or not name:
                raise EnvironmentFailure(f'{place}: tools[{i}] needs a "name" string')
            if not isinstance(description, str) or not isinstance(schema, dict):
                raise EnvironmentFailure(
                    f'{place}: tools[{i}] ("{name}") needs a "description" string and an '
                    '"input_schema" object'
                )
            out.append(ToolSpec(name, description, schema))
        return out

    def open(self, scenario, seed: int) -> HttpEpisode:
        tools = self.catalog(scenario)
        where = f"scenario {scenario.id}"
        reply = self.request(
            "POST", "/reset", where, {"scenario": scenario.as_json(), "seed": seed}
        )
        place = f"{where}: POST {self.base_url}/reset"
        if not isinstance(reply, dict) or not isinstance(reply.get("env_id"), (str, int)):
            raise EnvironmentFailure(f'{place}: expected {{"env_id": ..., "observation": ...}}')
        opening = reply.get("observation")
        if opening is not None and not isinstance(opening, str):
            raise EnvironmentFailure(f'{place}: "observation" must be null or a string')
        if opening is not None:
            opening = cap_text(opening, self.config.max_result_bytes)
        return HttpEpisode(self, where, reply["env_id"], tools, opening)

    def grades(self, scenario) -> bool:
        return True

    def close(self) -> None:
        self.client.close()


class HttpEpisode(Episode):
    """One env_id on the server, from reset to close."""

    def __init__(self, env: HttpEnvironment, where: str, env_id, tools: list[ToolSpec], opening):
        self.env, self.where, self.env_id = env, where, env_id
        self.tools, self.opening = tools, opening
        self._names = {t.name for t in tools}
        self._calls = 0
        self._closed = False

    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        if name not in self._names:
            return Observation(f"unknown tool '{quoted(name)}'", is_error=True)
        problem = argument_problem(arguments)
        if problem is not None:
            return Observation(problem, is_error=True)
        call = {"id": f"call_{self._calls}", "name": name, "arguments": arguments}
        self._calls += 1
        reply = self.env.request("POST", "/step", self.where, {"env_id": self.env_id, "call": call})
        place = f"{self.where}: POST {self.env.base_url}/step"
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, dict) or not isinstance(result.get("content"), str):
            raise EnvironmentFailure(f'{place}: expected {{"result": {{"content": "..."}}, ...}}')
        is_error, reward, done = (
            result.get("is_error", False),
            reply.get("reward"),
            reply.get("done", False),
        )
        if not isinstance(is_error, bool) or not isinstance(done, bool):
            raise EnvironmentFailure(f'{place}: "is_error" and "done" must be booleans')
        if reward is not None and not finite(reward):
            raise EnvironmentFailure(f'{place}: "reward" must be null or a finite number')
        content = cap_text(result["content"], self.env.config.max_result_bytes)
        return Observation(content, is_error, None if reward is None else float(reward), done)

    def state(self) -> dict[str, Any] | None:
        """The server's EnvState, or None when it keeps none (404)."""
        reply = self.env.request("GET", f"/state/{self.env_id}", self.where, missing_ok=True)
        if reply is not None and not isinstance(reply, dict):
            raise EnvironmentFailure(
                f"{self.where}: GET {self.env.base_url}/state/{self.env_id}: expected an object"
            )
        return reply

    def summary(self) -> str | None:
        state = self.state()
        summary = None if state is None else state.get("summary")
        return summary if isinstance(summary, str) else None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.env.request("POST", "/close", self.where, {"env_id": self.env_id})
