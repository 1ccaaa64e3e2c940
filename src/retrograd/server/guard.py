"""What every request passes before a route (formats.md §9.2): trace id, bearer token under
/v1, body size, request time, and the problem+json answers for what goes wrong.

`Guard` is plain ASGI so that event streams pass through unbuffered. It answers 401 (with
`WWW-Authenticate: Bearer`) for a missing or wrong token under /v1, unless the request is a
signed link that links.py admits (decided here, before any route, so that no route's answer
tells a stranger what exists); without a token, for a request addressed to another name than
a loopback one or sent by a page served from another machine (a web page the browser shows must not
drive a server that trusts this machine); 413 for a body over the limit
(announced by Content-Length, or counted as it arrives), 504 for a request over
`request_timeout_seconds` (event streams exempt), 429 past `max_concurrent_requests` requests
at once, and past as many event streams open at once (counted apart: a stream lasts as long as
its client). `install_handlers` turns Problem, FastAPI's
validation errors, Starlette's 404/405 and any other exception into problem+json.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers, QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrograd import nesting
from retrograd.errors import RetrogradError
from retrograd.openai_app.local import from_this_machine
from retrograd.server.links import Links
from retrograd.server.problems import (
    MEDIA_TYPE,
    FieldError,
    Problem,
    pointer,
    too_deep,
    unknown_field,
)
from retrograd.text import first_at, json_dumps, not_text_at

log = logging.getLogger(__name__)
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="retrograd"'}
# What a JSON body holds before it can hold a lone surrogate or a number that is not finite.
_MAYBE_UNWRITABLE = re.compile(r"\\u|NaN|Infinity|[0-9][eE]")


class TextJSON(JSONResponse):
    """FastAPI's JSON answer, written by text.json_dumps: a string holding a lone surrogate (a
    file name that is not UTF-8, as Python decodes it, in a run's error or events) goes out
    as its escape, where JSONResponse's UTF-8 encoding ends the request in a 500. Every route
    of the server answers with it (create_app's default response class)."""

    def render(self, content) -> bytes:
        return json_dumps(content, allow_nan=False, separators=(",", ":")).encode("utf-8")


def problem_response(problem: Problem, trace_id: str, redact: bool) -> JSONResponse:
    return TextJSON(
        problem.document(trace_id, redact),
        status_code=problem.status,
        media_type=MEDIA_TYPE,
        headers={**problem.headers, "Trace-Id": trace_id},
    )


# The routes (paths, whole) of event streams; and of requests left untimed besides them.
_STREAM = re.compile(r"/v1/(?:runs/[^/]+/)?events")
_UNTIMED = re.compile(r"/v1/runs/[^/]+/(?:artifacts/[^/]+|generate|evaluate)|/v1/chat/completions")


def _untimed(path: str, method: str = "GET") -> bool:
    """Event streams, downloads (an adapter may be large), and requests that may wait for a
    run's boundary (a PATCH of a live run too) or a model's load (bounded by
    command_timeout_seconds where a run answers)."""
    return method == "PATCH" or bool(_STREAM.fullmatch(path) or _UNTIMED.fullmatch(path))


class Guard:
    def __init__(
        self,
        app,
        *,
        token: str | None,
        max_body: int,
        timeout: float,
        redact: bool,
        route_limits: dict[str, int] | None = None,
        idle_limits: dict[str, float] | None = None,
        max_concurrent: int | None = None,
        links: Links | None = None,
    ):
        self.app = app
        self.links = links  # signed links open one artifact each without the token
        # requests at once, and event streams open at once, each counted on its own
        self.max_concurrent = max_concurrent
        self.active = 0
        self.streams = 0
        self.token = token
        self.max_body = max_body
        self.route_limits = route_limits or {}  # path -> its body limit, if not max_body
        self.idle_limits = idle_limits or {}  # path -> longest silence of an upload's body
        self.timeout = timeout
        self.redact = redact

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        trace_id = uuid.uuid4().hex
        scope.setdefault("state", {})["trace_id"] = trace_id
        path = scope["path"]

        async def refuse(problem: Problem) -> None:
            await problem_response(problem, trace_id, self.redact)(scope, receive, send)

        if path.startswith("/v1"):
            headers = Headers(scope=scope)
            if self.token is None and not from_this_machine(
                headers.get("host"), headers.get("origin")
            ):
                return await refuse(_not_from_this_machine())
            if self.token is not None and not self._admitted_by(scope):
                return await refuse(_unauthorized(scope.get("query_string", b"")))
        stream = _STREAM.fullmatch(path) is not None
        held = self.streams if stream else self.active
        if self.max_concurrent is not None and held >= self.max_concurrent:
            what = "event streams are open" if stream else "requests are being served"
            return await refuse(
                Problem(
                    "too-many-requests",
                    f"{held} {what} (max_concurrent_requests = {self.max_concurrent}); try again",
                    headers={"Retry-After": "1"},
                )
            )
        self._count(stream, 1)
        try:
            return await self._admitted(scope, receive, send, trace_id, refuse)
        finally:
            self._count(stream, -1)

    def _count(self, stream: bool, change: int) -> None:
        if stream:
            self.streams += change
        else:
            self.active += change

    async def _admitted(self, scope, receive, send, trace_id: str, refuse) -> None:
        """The request past the token and the concurrency limit: body limits and time."""
        path, headers = scope["path"], Headers(scope=scope)
        limit = self.route_limits.get(path, self.max_body)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await refuse(self._too_large(limit))
        received = 0

        idle = self.idle_limits.get(path)

        async def counted():
            nonlocal received
            if idle is None:
                message = await receive()
            else:  # an upload: bounded by its silences, not its length
                try:
                    message = await asyncio.wait_for(receive(), idle)
                except TimeoutError:
                    raise Problem("timeout", f"the upload sent nothing for {idle:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._too_large(limit)
            return message

        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = message.setdefault("headers", [])
                if not any(name.lower() == b"trace-id" for name, _ in headers):
                    headers.append((b"trace-id", trace_id.encode()))  # problems carry theirs
            await send(message)

        if _untimed(path, scope["method"]) or idle is not None:
            return await self.app(scope, counted, tracked)
        try:
            await asyncio.wait_for(self.app(scope, counted, tracked), self.timeout)
        except TimeoutError:
            if not started:
                detail = f"the request took longer than {self.timeout:g} s"
                await refuse(Problem("timeout", detail))

    def _admitted_by(self, scope) -> bool:
        """The bearer token, or a signed link to the one artifact asked for."""
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, value = given.partition(" ")
        # bytes: compare_digest refuses str with non-ASCII characters (a header may hold any)
        if scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode("latin-1", "replace"), self.token.encode()
        ):
            return True
        query = scope.get("query_string", b"")
        return self.links is not None and self.links.admits(scope["method"], scope["path"], query)

    def _too_large(self, limit: int) -> Problem:
        return Problem(
            "payload-too-large",
            f"the request body is over the server's limit ({limit} bytes)",
            meta={"max_body_bytes": limit},
        )


def _not_from_this_machine() -> Problem:
    return Problem(
        "unauthorized",
        "this server has no auth_token: it answers only requests to a loopback address or "
        "localhost that no page served from another machine sent; set auth_token to be reached otherwise",
        [FieldError("/headers/host", "unauthorized", "not addressed from this machine")],
    )


def _unauthorized(query: bytes) -> Problem:
    linked = "sig" in QueryParams(query)
    detail = (
        "the link is expired, or signed for something else; ask for a new one"
        if linked
        else "send the server's token as Authorization: Bearer <token>"
    )
    return Problem(
        "unauthorized",
        detail,
        [FieldError("/headers/authorization", "unauthorized", "missing or wrong token")],
        headers=CHALLENGE,
    )


class BoundedRoute(APIRoute):
    """A route of ours: where FastAPI parses the JSON body itself (a pydantic body parameter),
    the body's depth is checked first (nesting.py), since json.loads recurses once a level,
    and a string holding a lone surrogate or a number that is not finite is refused naming
    its place (`refuse_unwritable`). Routes that read their body themselves do both through
    nesting.loads and read_json_object (or refuse_unwritable)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request):
            body = await request.body()  # kept by the request: FastAPI reads it from there
            try:
                text = nesting.text_of(body)
                nesting.check_json(text)
            except nesting.TooDeep as error:
                raise too_deep(error, f"the body is {error}") from None
            except UnicodeDecodeError:
                return await handler(request)  # not text: FastAPI's own parse says so
            if _MAYBE_UNWRITABLE.search(text):  # an escape, NaN, Infinity, an exponent
                try:
                    data = nesting.loads(text)
                except ValueError:
                    pass  # not JSON: FastAPI's own parse says so
                else:
                    refuse_unwritable(data)
            return await handler(request)

        return bounded


def trace_of(request: Request) -> str:
    return request.scope.get("state", {}).get("trace_id", "")


def install_handlers(app: FastAPI, redact: bool) -> None:
    @app.exception_handler(Problem)
    async def on_problem(request: Request, problem: Problem):
        return problem_response(problem, trace_of(request), redact)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError):
        errors = [_field_error(e) for e in error.errors()]
        problem = Problem("invalid-request", "the request does not match its schema", errors)
        return problem_response(problem, trace_of(request), redact)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            problem = Problem("not-found", f"no route {request.url.path}")
        elif error.status_code == 405:
            problem = Problem(
                "method-not-allowed",
                f"{request.method} is not allowed on {request.url.path}",
                headers=dict(error.headers or {}),
            )
        else:
            problem = Problem("invalid-request", str(error.detail))
        return problem_response(problem, trace_of(request), redact)

    @app.exception_handler(RetrogradError)
    async def on_input(request: Request, error: RetrogradError):
        # what a handler read (a model, a data file) is wrong: the request's fault, said plainly
        problem = Problem("invalid-request", str(error))
        return problem_response(problem, trace_of(request), redact)

    @app.exception_handler(Exception)
    async def on_error(request: Request, error: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        problem = Problem("internal", f"{type(error).__name__}: {error}")
        return problem_response(problem, trace_of(request), redact)


def _field_error(error: dict) -> FieldError:
    loc = [p for p in error.get("loc", ()) if p != "body"]
    where = pointer(*loc)
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return FieldError(
            where, "unknown_field", f"unknown field {loc[-1]!r}" if loc else "unknown field"
        )
    if kind == "missing":
        return FieldError(where, "missing_field", "required")
    if kind.startswith(("greater", "less")):
        return FieldError(where, "out_of_range", error.get("msg", ""))
    return FieldError(where, "invalid_value", error.get("msg", ""))


def refuse_unwritable(data, where: str = "") -> None:
    """Problem (invalid-request) naming the first value of a parsed body (or of its line
    `where`) that the server could not keep or answer: a string holding a lone surrogate (a
    `\\ud800` escape is JSON, but no run file, template, tokenizer or record of ours takes
    it), or a number that is not finite (`NaN`, `Infinity`, `1e999`, TOML's `inf`: Python's
    readers take them, no JSON answer carries them)."""
    for path, what in (
        (not_text_at(data), "holds a lone surrogate (a \\ud800 escape), not text"),
        (first_at(data, _not_finite), "is not a finite number (NaN or an infinity)"),
    ):
        if path is not None:
            at = where + pointer(*path)
            message = f"{at or 'the body'}: {what}"
            raise Problem("invalid-request", message, [FieldError(at, "invalid_value", message)])


def _not_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def read_json_object(body: bytes, known: tuple[str, ...]) -> dict:
    """A JSON object body, nested at most nesting.MAX_DEPTH deep; unknown top-level fields
    refused with the closest known one."""
    try:
        data = nesting.loads(body or b"{}")
    except nesting.TooDeep as error:
        raise too_deep(error, f"the body is {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise Problem(
            "invalid-request",
            f"the body is not JSON: {error}",
            [FieldError("", "unsupported_format", f"not JSON: {error}")],
        ) from None
    refuse_unwritable(data)
    if not isinstance(data, dict):
        raise Problem(
            "invalid-request",
            "the body must be a JSON object",
            [FieldError("", "invalid_value", "must be a JSON object")],
        )
    unknown = [k for k in data if k not in known]
    if unknown:
        errors = [unknown_field(pointer(name), name, known) for name in unknown]
        raise Problem("invalid-request", "the body has unknown fields", errors)
    return data
