"""A real HTTP environment server for the tests: FastAPI under uvicorn, in a thread.

The game is a counter: `add {by}` moves it and earns a step reward of 0.1 per call; reaching the
scenario's `metadata.target` (default 3) ends the episode with a reward of 1.0 instead. `echo
{text, times?}` repeats text; `echo` with text "oops" is an error result. Reset answers an
observation when `metadata.greet` is true; /state answers 404 when `metadata.no_state` is true.

Every request is recorded (method, path, JSON body, headers) in `EnvServer.calls`, so tests can
assert the protocol. Knobs: `gone` (env_ids answered 410), `step_delay` (seconds /step sleeps),
`bad_step` (the step reply misses its result), `raw_step` (the text /step answers instead, as
JSON, however malformed), `drip_step` (/step answers a body that never ends, a byte every
that many seconds), `raw_reset` (the text /reset answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

TOOLS = [
    {
        "name": "add",
        "description": "Add to the counter.",
        "input_schema": {
            "type": "object",
            "properties": {"by": {"type": "integer"}},
            "required": ["by"],
        },
    },
    {
        "name": "echo",
        "description": "Repeat text.",
        "input_schema": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
            "required": ["text"],
        },
    },
]


@dataclass
class Game:
    scenario: dict[str, Any]
    seed: int
    counter: int = 0
    reward: float = 0.0
    done: bool = False


@dataclass
class EnvServer:
    calls: list[dict[str, Any]] = field(default_factory=list)
    games: dict[str, Game] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    step_delay: float = 0.0
    bad_step: bool = False
    raw_step: str | None = None
    drip_step: float | None = None
    raw_reset: str | None = None
    url: str = ""

    def routes(self, method: str | None = None) -> list[str]:
        return [c["path"] for c in self.calls if method is None or c["method"] == method]

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            body = await request.body()
            self.calls.append(
                {
                    "method": request.method,
                    "path": request.url.path,
                    "body": body.decode() if body else None,
                    "headers": dict(request.headers),
                }
            )
            return await call_next(request)

        def missing(env_id: str) -> JSONResponse | None:
            if env_id in self.gone:
                return JSONResponse({"error": "gone"}, status_code=410)
            if env_id not in self.games:
                return JSONResponse({"error": "no such env"}, status_code=404)
            return None

        @app.get("/tools")
        def tools():
            return {"tools": TOOLS}

        @app.post("/reset")
        def reset(body: dict):
            if self.raw_reset is not None:
                return Response(self.raw_reset, media_type="application/json")
            env_id = f"env-{len(self.games)}"
            game = Game(body["scenario"], body["seed"])
            self.games[env_id] = game
            meta = game.scenario.get("metadata", {})
            greet = f"counter 0, target {meta.get('target', 3)}" if meta.get("greet") else None
            return {"env_id": env_id, "observation": greet}

        @app.post("/step")
        def step(body: dict):
            env_id = body["env_id"]
            if (answer := missing(env_id)) is not None:
                return answer
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.bad_step:
                return {"reward": None, "done": False}
            if self.raw_step is not None:
                return Response(self.raw_step, media_type="application/json")
            if self.drip_step is not None:
                return StreamingResponse(self._drip(self.drip_step), media_type="application/json")
            game, call = self.games[env_id], body["call"]
            args = call["arguments"]
            if call["name"] == "echo":
                if args["text"] == "oops":
                    return {"result": {"content": "echo refuses oops", "is_error": True}}
                return {
                    "result": {"content": args["text"] * args.get("times", 1)},
                    "reward": None,
                    "done": False,
                }
            game.counter += args["by"]
            target = game.scenario.get("metadata", {}).get("target", 3)
            game.done = game.counter >= target
            reward = 1.0 if game.done else 0.1
            game.reward += reward
            return {
                "result": {"content": f"counter {game.counter}", "is_error": False},
                "reward": reward,
                "done": game.done,
            }

        @app.get("/state/{env_id}")
        def state(env_id: str):
            if (answer := missing(env_id)) is not None:
                return answer
            game = self.games[env_id]
            if game.scenario.get("metadata", {}).get("no_state"):
                return JSONResponse({"error": "no state"}, status_code=404)
            return {
                "done": game.done,
                "cumulative_reward": game.reward,
                "summary": f"counter={game.counter} seed={game.seed}",
                "metadata": {"counter": game.counter},
            }

        @app.post("/close")
        def close(body: dict):
            if (answer := missing(body["env_id"])) is not None:
                return answer
            self.closed.append(body["env_id"])
            return Response(status_code=204)

        return app

    async def _drip(self, seconds: float):
        yield b'{"result": {"content": "'
        while True:  # until the client goes away
            await asyncio.sleep(seconds)
            yield b"x"


@contextlib.contextmanager
def env_server() -> Iterator[EnvServer]:
    """An EnvServer under uvicorn on 127.0.0.1 (a free port); `.url` is its base URL."""
    env = EnvServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(env.app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    env.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield env
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
