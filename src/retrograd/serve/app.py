"""The OpenAI-compatible app over one loaded model: /v1/chat/completions and /v1/models.

Two model ids: the served name (the adapter, or the base model with --base-only) and `base`.
Prompts are rendered and answers parsed by the model's `ChatFormat` (the code agent rollouts
use), so tools reach the model through its template and calls come back as `tool_calls`.
`stream: true` sends the finished answer as one delta. Every error is OpenAI's JSON shape.
Generation runs on one worker thread (`worker.py`); handlers only validate and wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrograd.errors import RetrogradError
from retrograd.sampling import SampleRequest, SamplingParams
from retrograd.serve import protocol as proto
from retrograd.serve.protocol import ApiError
from retrograd.serve.worker import Worker

MAX_BODY_BYTES = 4 << 20
BASE_ID = "base"


def create_app(
    loaded,
    name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_batch: int = 8,
) -> FastAPI:
    """An app answering for `loaded` (see weights.load_for_generation) under `name`."""
    worker = Worker(loaded.sampler, loaded.model.decoder, max_batch=max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        worker.close()

    app = FastAPI(title="retrograd serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.worker = worker
    created = int(time.time())
    ids = {name: loaded.adapter is not None, BASE_ID: False}  # id -> adapter on

    @app.middleware("http")
    async def guard(request: Request, call_next):
        try:
            if api_key is not None and request.url.path.startswith("/v1"):
                _authorize(request, api_key)
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > max_body_bytes:
                raise ApiError(
                    413, f"request body over {max_body_bytes} bytes", None, "request_too_large"
                )
        except ApiError as e:
            return _error(e)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), None, None))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [proto.model_entry(i, created) for i in ids]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in ids:
            raise ApiError(
                404,
                f"model {model_id!r} not found (served: {', '.join(ids)})",
                "model",
                "model_not_found",
            )
        return proto.model_entry(model_id, created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = proto.parse_request(await _json_body(request, max_body_bytes))
        proto.check_supported(req)
        if req.model not in ids:
            raise ApiError(
                404,
                f"model {req.model!r} not found (served: {', '.join(ids)})",
                "model",
                "model_not_found",
            )
        tools = proto.tools_for_prompt(req)
        sample = _sample_request(loaded, req, tools)
        try:
            answer = await asyncio.wrap_future(worker.submit(sample, ids[req.model]))
        except (RetrogradError, ValueError) as e:
            raise ApiError(400, str(e), None, "invalid_value") from None
        parsed = loaded.chat.parse(answer.text) if tools else None
        message, finish = proto.message_of(answer.text, parsed)
        usage = {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": len(answer.ids),
            "total_tokens": answer.prompt_tokens + len(answer.ids),
        }
        body = proto.completion_body(req.model, message, finish or answer.finish_reason, usage)
        if not req.stream:
            return body
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _sse(proto.stream_chunks(body, include_usage)), media_type="text/event-stream"
        )

    return app


def _authorize(request: Request, api_key: str) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
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
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return data


def _sample_request(loaded, req: proto.ChatRequest, tools) -> SampleRequest:
    try:
        prompt = loaded.chat.prompt_ids(proto.to_records(req.messages), tools)
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
        seed=req.seed if req.seed is not None else secrets.randbits(63),
    )
    return SampleRequest(tuple(prompt), params)


def _error(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _sse(chunks: list[dict]):
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
