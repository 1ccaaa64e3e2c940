"""A real OpenAI-compatible chat completions server that answers from a script, for tests of
`collect --api` and `scenarios generate`.

    with scripted_openai([reply("hi", calls=[("add", {"n": 1})]), status(500)]) as api:
        ...  # api.base_url ends in /v1; api.requests holds every request body, in order

Each POST /v1/chat/completions takes the next item of the script: a chat message (`reply`),
an HTTP error (`status`), a body sent as it is (`raw`, to script a hostile endpoint), a function of the request body returning either, or one of these
answered late (`delay`, to script a client's timeout). A request with
the script used up gets a 500. The bearer token must be `key` (401 otherwise). It runs under
uvicorn on a free loopback port in a thread, so clients (httpx, the openai SDK) speak real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


@dataclass(frozen=True)
class Status:
    code: int
    body: str = "scripted failure"


def status(code: int, body: str = "scripted failure") -> Status:
    return Status(code, body)


@dataclass(frozen=True)
class Delay:
    seconds: float
    item: Any


@dataclass(frozen=True)
class Raw:
    body: str


def raw(body: str) -> Raw:
    """A 200 whose JSON body is `body` as it is (not built from a message)."""
    return Raw(body)


def delay(seconds: float, item: Any) -> Delay:
    """`item`, answered after `seconds` (the server's other requests go on meanwhile)."""
    return Delay(seconds, item)


def reply(
    content: str | None = "",
    calls: list[tuple[str, Any]] | None = None,
    completion_tokens: int = 0,
) -> dict:
    """An assistant message; `calls` are (name, arguments): a dict is JSON-encoded, a string is
    sent as it is (to script malformed arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"scripted_{next(_ids)}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for name, args in calls
        ]
    if completion_tokens:
        message["_completion_tokens"] = completion_tokens
    return message


_ids = itertools.count()
Item = dict | Status | Delay | Raw | Callable[[dict], "dict | Status"]


@dataclass
class ScriptedOpenAI:
    script: list[Item]
    key: str = "test-key"
    requests: list[dict] = field(default_factory=list)
    base_url: str = ""

    def app(self):
        app = FastAPI()
        lock = threading.Lock()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            body = await request.json()
            with lock:
                self.requests.append(body)
                item = self.script.pop(0) if self.script else Status(500, "script used up")
            if isinstance(item, Delay):
                await asyncio.sleep(item.seconds)
                item = item.item
            if callable(item):
                item = item(body)
            if isinstance(item, Status):
                return JSONResponse({"error": {"message": item.body}}, status_code=item.code)
            if isinstance(item, Raw):
                return Response(item.body, media_type="application/json")
            return JSONResponse(_completion(body, dict(item)))

        return app


def _completion(body: dict, message: dict) -> dict:
    tokens = message.pop("_completion_tokens", 0)
    return {
        "id": f"chatcmpl-{len(body.get('messages', []))}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", ""),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 0,
            "completion_tokens": tokens,
            "total_tokens": tokens,
        },
    }


@contextlib.contextmanager
def scripted_openai(script: list[Item], key: str = "test-key") -> Iterator[ScriptedOpenAI]:
    """The scripted server, running; yields it with `base_url` set (…/v1)."""
    import uvicorn

    api = ScriptedOpenAI(list(script), key)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(api.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    api.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    try:
        yield api
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
