"""The OpenAI routes over runs' weights: `RUN_ID`, `RUN_ID@final|@best|@step-N|@latest|@base`.

A model id names a run and which of its adapters to apply: `@final` the adapter it exported,
`@best` and `@step-N` the adapters exported beside those checkpoints, `@latest` the one a
resume would pick, `@base` none. A bare `RUN_ID` is the live weights while the run's process
lives (answered by that process at its next boundary, in one piece), then its final adapter
(else its latest checkpoint's). Other answers come from `retrograd serve`'s own app
(openai_app/app.py), built for one model at a time in this process and dropped after
`[serving].idle_seconds` or when another model is asked for. Errors are OpenAI's JSON, not problem+json. Only runs that train a LoRA adapter
are served. Nothing here imports torch until a chat request loads a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse, StreamingResponse

from retrograd import nesting
from retrograd.openai_app.errors import ApiError, check_text, model_entry, too_deep
from retrograd.server.guard import TextJSON
from retrograd.server.problems import Problem
from retrograd.server.runner import LIVE, Runs
from retrograd.server.store import RunRecord, RunStore
from retrograd.text import json_dumps

CHAT = "/v1/chat/completions"
_ID = re.compile(r"^(run_[0-9a-f]+)(?:@(final|best|latest|base|step-(\d+)))?$")


@dataclass(frozen=True)
class Target:
    """What one model id resolves to: the run and the adapter file (None: the base model)."""

    model_id: str
    run: RunRecord
    adapter: Path | None
    live: bool = False  # answered by the run's own process


def _checkpoint_dir(record: RunRecord) -> Path | None:
    directory = record.effective_config.get("checkpoint", {}).get("directory")
    return Path(directory) if directory else None


def _final(record: RunRecord) -> Path | None:
    """The run's exported adapter, or None (a record without an output path has none)."""
    output = record.effective_config.get("output") or {}
    written = output.get("path") if output.get("kind", "adapter") == "adapter" else None
    path = Path(written) if isinstance(written, str) and written else None
    return path if path is not None and path.is_file() else None


def _exports(record: RunRecord) -> list[tuple[str, Path]]:
    """(suffix, adapter) of the run's checkpoints that have an exported adapter, newest first."""
    from retrograd.checkpoint.layout import list_checkpoints

    directory = _checkpoint_dir(record)
    if directory is None:
        return []
    found = []
    for c in list_checkpoints(directory):
        if c.complete and c.adapter is not None:
            found.append((c.id if c.kind == "best" else f"step-{c.global_step}", c.adapter))
    return found


def _latest(record: RunRecord) -> Path | None:
    from retrograd.checkpoint.layout import latest_checkpoint

    directory = _checkpoint_dir(record)
    state = latest_checkpoint(directory) if directory is not None else None
    adapter = state.with_suffix(".gguf") if state is not None else None
    return adapter if adapter is not None and adapter.is_file() else None


def available(record: RunRecord, live: bool = False) -> list[str]:
    """Every model id the run answers to now (`live`: its process runs)."""
    if record.effective_config.get("training", {}).get("trainable", "lora") != "lora":
        return []
    ids = [record.id] if (live or _final(record) or _latest(record)) else []
    ids += [f"{record.id}@final"] if _final(record) else []
    ids += [f"{record.id}@latest"] if _latest(record) else []
    ids += [f"{record.id}@{suffix}" for suffix, _ in _exports(record)]
    return ids + [f"{record.id}@base"]


def resolve(store: RunStore, runs: Runs, model_id: str) -> Target:
    found = _ID.match(model_id or "")
    record = store.runs.get(found[1]) if found else None
    if record is None:
        raise ApiError(404, f"model {model_id!r} not found", "model", "model_not_found")
    live = record.id in runs.live and record.status in LIVE
    if model_id not in available(record, live):
        raise ApiError(
            404,
            f"model {model_id!r}: that run has no such weights (it has: "
            f"{', '.join(available(record)) or 'none: it trains base tensors'})",
            "model",
            "model_not_found",
        )
    suffix = found[2]
    if suffix is None and live:
        return Target(model_id, record, None, live=True)
    if suffix == "base":
        adapter = None
    elif suffix == "final":
        adapter = _final(record)
    elif suffix == "latest":
        adapter = _latest(record)
    elif suffix is None:
        adapter = _final(record) or _latest(record)
    else:
        adapter = dict(_exports(record))[suffix]
    return Target(model_id, record, adapter)


class Serving:
    """One loaded model at a time, its serve app, and when it was last used. A load waits at
    most `device_wait` seconds for the runs holding the device (`busy()` true) to end, then
    is refused (503, code device-busy)."""

    def __init__(self, store: RunStore, idle_seconds: float, device_wait: float = 0.0, busy=None):
        self.store = store
        self.idle_seconds = idle_seconds
        self.device_wait = device_wait
        self.busy = busy or (lambda: False)
        self.key: tuple | None = None
        self.app = None
        self.used = 0.0
        self.users = 0  # requests answering from the loaded app
        self.changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def use(self, target: Target):
        """The app over the target's weights while a request answers from it. Other weights
        are loaded only once no request uses the loaded ones (a swap never pulls a model out
        from under an answer)."""
        key = (target.run.id, str(target.adapter), target.model_id)
        async with self.changed:
            await self.changed.wait_for(lambda: self.key == key or self.users == 0)
            if self.key != key:
                await self._device_free()
                self.close()
                self.app = await asyncio.to_thread(_build, target)
                self.key = key
            self.users += 1
            self.used = time.monotonic()
            app = self.app
        try:
            yield app
        finally:
            async with self.changed:
                self.users -= 1
                self.used = time.monotonic()
                self.changed.notify_all()

    async def _device_free(self) -> None:
        deadline = time.monotonic() + self.device_wait
        while self.busy():
            if time.monotonic() >= deadline:
                raise ApiError(
                    503,
                    "a run holds the device; loading other weights waits for it "
                    f"([serving] device_wait_seconds = {self.device_wait:g})",
                    "model",
                    "device-busy",
                    {"Retry-After": "5"},
                )
            await asyncio.sleep(0.2)

    def close(self) -> None:
        if self.app is not None:
            self.app.state.worker.close()
        self.app, self.key = None, None

    def close_if_idle(self) -> None:
        if (
            self.app is not None
            and self.users == 0
            and time.monotonic() - self.used > self.idle_seconds
        ):
            self.close()


def _build(target: Target):
    """openai_app/app.py's app over the run's model with the target's adapter, named by its id."""
    from retrograd.config import validate_run
    from retrograd.openai_app.app import create_app
    from retrograd.openai_app.weights import load_for_generation

    record = target.run
    cfg = validate_run(record.document, source=f"run {record.id}", base_dir=record.base_dir)
    loaded = load_for_generation(cfg, target.adapter, None, None)
    return create_app(loaded, target.model_id, local_only=False)  # the run server's guard decides


def openai_error(error: ApiError) -> JSONResponse:
    headers = dict(error.headers or {})
    return TextJSON(error.body(), status_code=error.status, headers=headers or None)


class ChatCompletions:
    """POST /v1/chat/completions: the body's `model` picks the weights; serve's app answers,
    or the live run's process."""

    def __init__(
        self, store: RunStore, runs: Runs, serving: Serving, timeout: float, queue: int = 8
    ):
        self.store, self.runs, self.serving, self.timeout = store, runs, serving, timeout
        self.queue = queue  # requests waiting for the served model beyond the one answered
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            data = nesting.loads(body)
            check_text(data)  # before a run's process or serve's app reads it
            model_id = data.get("model") if isinstance(data, dict) else None
            if not isinstance(model_id, str):
                raise ApiError(400, "model: required, a model id (GET /v1/models)", "model")
            with self.store.lock:
                target = resolve(self.store, self.runs, model_id)
            if target.live:
                response = await self._live(target, data)
                return await response(scope, receive, send)
            if self.in_flight > self.queue:
                raise ApiError(
                    503,
                    f"{self.in_flight} requests are already waiting for the served model "
                    f"([serving] queue = {self.queue}); try again",
                    None,
                    "queue_full",
                    {"Retry-After": "1"},
                )
        except nesting.TooDeep as error:
            return await openai_error(too_deep(error.limit))(scope, receive, send)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            not_json = ApiError(400, f"the body is not JSON: {error}", None, "invalid_json")
            return await openai_error(not_json)(scope, receive, send)  # as serve's app says
        except ApiError as error:
            return await openai_error(error)(scope, receive, send)
        self.in_flight += 1
        try:
            await self._served(target, body, scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _served(self, target: Target, body: bytes, scope, receive, send) -> None:
        """The answer of serve's app over the target's weights (loaded when needed)."""
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            async with self.serving.use(target) as app:
                await app(scope, replay, send)
        except ApiError as error:
            return await openai_error(error)(scope, receive, send)

    async def _live(self, target: Target, data: dict):
        """The live run's answer, as JSON or (stream) as one piece of server-sent events."""
        try:
            waiting = self.runs.ask(target.run, "chat", data)
        except Problem as problem:  # 409: not live; 429: too many asks waiting already
            raise ApiError(
                problem.status,
                f"model {target.model_id!r}: {problem.detail}",
                "model",
                headers=problem.headers or None,
            ) from None
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(waiting), self.timeout)
        except TimeoutError:
            raise ApiError(504, f"the run reached no boundary within {self.timeout:g} s") from None
        if "error" in reply:
            raise ApiError(500, f"the run could not answer: {reply['error']}")
        body, status = reply["body"], reply.get("status", 200)
        if status != 200 or not data.get("stream"):
            return TextJSON(body, status_code=status)
        return StreamingResponse(_one_piece(body, data), media_type="text/event-stream")


async def _one_piece(body: dict, data: dict):
    """A whole answer as OpenAI's stream: the role, the message, the finish, the usage."""
    from retrograd.openai_app import protocol as proto

    base = proto.chunk_base(body["model"])
    choice = body["choices"][0]
    chunks = [
        proto.delta_chunk(base, {"role": "assistant", "content": ""}),
        proto.delta_chunk(base, proto.message_delta(choice["message"])),
        proto.delta_chunk(base, {}, choice["finish_reason"]),
    ]
    if (data.get("stream_options") or {}).get("include_usage"):
        chunks.append(proto.usage_chunk(base, body["usage"]))
    for chunk in chunks:
        yield f"data: {json_dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def model_routes(
    app, store: RunStore, runs: Runs, serving: Serving, timeout: float, queue: int = 8
) -> None:
    """GET /v1/models, GET /v1/models/{model} and POST /v1/chat/completions on `app`."""
    from starlette.routing import Route

    @app.get("/v1/models", tags=["openai"])
    async def models():
        with store.lock:
            records = sorted(store.runs.values(), key=lambda r: r.id, reverse=True)
            ids = [
                (i, r.created_at // 1000)
                for r in records
                for i in available(r, r.id in runs.live and r.status in LIVE)
            ]
        return {"object": "list", "data": [model_entry(i, created) for i, created in ids]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str):
        try:
            with store.lock:
                target = resolve(store, runs, model_id)
        except ApiError as error:
            return openai_error(error)
        return model_entry(model_id, target.run.created_at // 1000)

    endpoint = ChatCompletions(store, runs, serving, timeout, queue)
    app.router.routes.append(Route(CHAT, endpoint, methods=["POST"]))
