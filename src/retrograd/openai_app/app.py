"""The OpenAI-compatible app over one loaded model: /v1/chat/completions and /v1/models.

Two model ids: the served name (the adapter, or the base model with --base-only) and `base`.
Prompts are rendered and answers parsed by the model's `ChatFormat` (the code agent rollouts
use), so tools reach the model through its template and calls come back as `tool_calls`.
Generation runs on one worker thread (`worker.py`) in a live batch; handlers validate, queue
and wait. `stream: true` sends server-sent events as the tokens are decided; with tools
offered the answer is parsed whole at the end, so its content and calls come in one delta
then. A client that goes away frees its row. Every error is OpenAI's JSON shape; with an
API key, every route (the OpenAPI schema too) asks for it; without one, only requests from
this machine are answered (local.py: no web page elsewhere may drive the model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrograd import nesting
from retrograd.errors import RetrogradError
from retrograd.openai_app import MAX_QUEUE, MAX_SEQUENCES
from retrograd.openai_app import protocol as proto
from retrograd.openai_app.local import from_this_machine
from retrograd.openai_app.protocol import ApiError
from retrograd.openai_app.worker import Busy, Worker
from retrograd.sampling import SampleRequest, SamplingParams
from retrograd.sampling.batch import LiveBatch
from retrograd.text import json_dumps

MAX_BODY_BYTES = 4 << 20
BASE_ID = "base"


def create_app(
    loaded,
    name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_sequences: int = MAX_SEQUENCES,
    max_queue: int = MAX_QUEUE,
    batch=None,
    local_only: bool = True,
) -> FastAPI:
    """An app answering for `loaded` (see weights.load_for_generation) under `name`.
    batch: what generates (default: a LiveBatch over loaded.sampler). local_only: without
    `api_key`, refuse requests not from this machine (False where another app in front of
    this one decides who reaches it)."""
    batch = batch or LiveBatch(loaded.sampler, max_sequences)
    worker = Worker(batch, loaded.model.decoder, max_sequences, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        worker.close()

    app = FastAPI(title="retrograd serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, local_only=local_only)
    app.state.worker = worker
    created = int(time.time())
    ids = {name: loaded.adapter is not None, BASE_ID: False}  # id -> adapter on

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), None, None))

    def known(model_id: str) -> str:
        if model_id not in ids:
            raise ApiError(
                404,
                f"model {model_id!r} not found (served: {', '.join(ids)})",
                "model",
                "model_not_found",
            )
        return model_id

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [proto.model_entry(i, created) for i in ids]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return proto.model_entry(known(model_id), created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = proto.parse_request(await _json_body(request, max_body_bytes))
        proto.check_supported(req)
        known(req.model)
        tools = proto.tools_for_prompt(req)
        sample = sample_request(loaded, req, tools)
        parse = loaded.chat.parse if tools else None
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return _streamed(worker, sample, ids[req.model], req.model, include_usage, parse)
        answer = await _answer(request, worker, sample, ids[req.model])
        message, finish = proto.message_of(answer.text, parse(answer.text) if parse else None)
        usage = proto.usage_of(answer)
        return proto.completion_body(req.model, message, finish or answer.finish_reason, usage)

    return app


class Guard:
    """The API key (every route, when set; else, with local_only, requests from this machine
    only) and the body size, before any route runs. Plain ASGI, so that streamed responses
    and client disconnects pass through untouched."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, local_only: bool = True):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.local_only = local_only

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                if self.api_key is not None:
                    _authorize(headers, self.api_key)
                elif self.local_only and not from_this_machine(
                    headers.get("host"), headers.get("origin")
                ):
                    raise ApiError(
                        403,
                        "this server has no API key: it answers only requests to a loopback "
                        "address or localhost that no page served from another machine sent",
                        None,
                        "not_from_this_machine",
                    )
                size = headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
                    raise ApiError(
                        413,
                        f"request body over {self.max_body_bytes} bytes",
                        None,
                        "request_too_large",
                    )
            except ApiError as e:
                await _error(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _authorize(headers: Headers, api_key: str) -> None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise ApiError(
            401,
            "missing or wrong API key (send Authorization: Bearer KEY)",
            None,
            "invalid_api_key",
        )


async def _json_body(request: Request, limit: int):
    raw = b""
    async for chunk in request.stream():  # bounded even without a Content-Length
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, f"request body over {limit} bytes", None, "request_too_large")
    try:
        data = nesting.loads(raw)
    except nesting.TooDeep as e:
        raise proto.too_deep(e.limit) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return data


def sample_request(loaded, req: proto.ChatRequest, tools) -> SampleRequest:
    """The sampler's request for a chat request; `loaded` needs `.chat` and `.ctx` (the run
    server's live runs pass their own)."""
    records = proto.to_records(req.messages, tools)
    try:
        prompt = loaded.chat.prompt_ids(records, tools)
    except RetrogradError as e:
        raise ApiError(400, f"messages: {e}", "messages", "invalid_value") from None
    room = loaded.ctx - len(prompt)
    if room < 1:
        raise ApiError(
            400,
            f"messages: the prompt has {len(prompt)} tokens; the context holds {loaded.ctx}",
            "messages",
            "context_length_exceeded",
        )
    limit = req.max_completion_tokens or req.max_tokens or room
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_new_tokens=min(limit, room),
        stop=proto.stop_strings(req),
        stop_ids=frozenset() if req.ignore_eos else None,
        seed=req.seed if req.seed is not None else secrets.randbits(63),
        grammar=proto.guided_grammar(req),
    )
    return SampleRequest(tuple(prompt), params)


def _submit(worker: Worker, sample: SampleRequest, adapter: bool, **callbacks):
    try:
        return worker.submit(sample, adapter, **callbacks)
    except Busy as e:
        raise ApiError(
            503,
            f"the server is busy: {e}",
            None,
            "server_busy",
            headers={"Retry-After": str(e.retry_after)},
        ) from None
    except ValueError as e:
        raise ApiError(400, str(e), None, "invalid_value") from None


def _failure(e: Exception) -> ApiError:
    """An error of the generation thread as the client sees it."""
    if isinstance(e, (RetrogradError, ValueError)):
        return ApiError(400, str(e), None, "invalid_value")
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", None, "server_error")


async def _answer(request: Request, worker: Worker, sample: SampleRequest, adapter: bool):
    """The completion, once generated; the job leaves the batch if the client goes first."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(answer, error) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(answer)

    job = _submit(
        worker,
        sample,
        adapter,
        on_done=lambda a: loop.call_soon_threadsafe(settle, a, None),
        on_error=lambda e: loop.call_soon_threadsafe(settle, None, _failure(e)),
    )
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            worker.cancel(job)
    if not done.done():
        raise ApiError(499, "the client closed the connection", None, "client_closed")
    return done.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _streamed(worker: Worker, sample, adapter: bool, model: str, include_usage: bool, parse):
    """Queue the job (a full queue is still a 503), then answer with its event stream."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def put(kind: str, value) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    job = _submit(
        worker,
        sample,
        adapter,
        on_done=lambda a: put("done", a),
        on_error=lambda e: put("error", e),
        on_text=None if parse else (lambda delta: put("text", delta)),
    )
    chunks = _events(worker, job, events, model, include_usage, parse)
    return StreamingResponse(chunks, media_type="text/event-stream")


async def _events(worker: Worker, job, events: asyncio.Queue, model: str, include_usage, parse):
    """Server-sent events: the role, text as it is decided (what is queued goes as one chunk),
    the parsed message when tools were offered, the finish, the usage, [DONE]."""
    base = proto.chunk_base(model)
    over = False
    try:
        yield _frame(proto.delta_chunk(base, {"role": "assistant", "content": ""}))
        while not over:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            text = "".join(value for kind, value in batch if kind == "text")
            if text:
                yield _frame(proto.delta_chunk(base, {"content": text}))
            for kind, value in batch:
                if kind == "error":
                    over = True
                    yield _frame({"error": _failure(value).body()["error"]})
                elif kind == "done":
                    over = True
                    for chunk in _ending(base, value, include_usage, parse):
                        yield _frame(chunk)
                    yield "data: [DONE]\n\n"
    finally:
        if not over:  # the client went away: free the row
            worker.cancel(job)


def _ending(base: dict, answer, include_usage: bool, parse) -> list[dict]:
    chunks = []
    finish = None
    if parse is not None:
        message, finish = proto.message_of(answer.text, parse(answer.text))
        chunks.append(proto.delta_chunk(base, proto.message_delta(message)))
    chunks.append(proto.delta_chunk(base, {}, finish or answer.finish_reason))
    if include_usage:
        chunks.append(proto.usage_chunk(base, proto.usage_of(answer)))
    return chunks


def _frame(chunk: dict) -> str:
    return f"data: {json_dumps(chunk)}\n\n"


def _error(e: ApiError) -> JSONResponse:
    headers = dict(e.headers or {})
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)
