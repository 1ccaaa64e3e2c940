"""A run's events and metrics over HTTP (formats.md §9.3): SSE with replay, the merged live
stream, metric records.

`GET /v1/runs/{id}/events` replays what came after `since` (or `Last-Event-ID`) from the run's
journal, then goes on live until `terminal`; a client too slow to keep up is told `lagged` and
its stream ends. `GET /v1/events` is every run's live events, without replay. Delivery is
events.py's, storage store.py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from retrograd.server.events import frame, lagged_frame
from retrograd.server.guard import BoundedRoute
from retrograd.server.problems import FieldError, Problem, pointer
from retrograd.server.routes_runs import find_run, server_state
from retrograd.server.store import TERMINAL

router = APIRouter(tags=["events"], route_class=BoundedRoute)
KEEPALIVE_SECONDS = 15.0


def _since(request: Request, since: int | None) -> int:
    given = request.headers.get("last-event-id")
    value: Any = given if given is not None else (since or 0)
    try:
        value = int(value)
    except ValueError:
        value = -1
    if value < 0:
        where = "/headers/last-event-id" if given is not None else pointer("since")
        raise Problem(
            "invalid-request",
            "the replay position must be a sequence number (0 or more)",
            [FieldError(where, "invalid_value", "must be an integer of 0 or more")],
        )
    return value


@router.get("/runs/{run_id}/events")
async def run_events(request: Request, run_id: str, since: int | None = Query(None)):
    _, store, runs = server_state(request)
    first = _since(request, since)
    with store.lock:
        record = find_run(request, run_id)
        sub = runs.hub.subscribe(run_id)
        log = store.logs[run_id]
        recent, upto = log.ring_since(first), log.seq
        ended = record.status in TERMINAL

    async def stream():
        last = first
        try:
            yield f": events of run {run_id}\n\n"  # headers go out now, not with the first event
            async for batch in _replay(log, first, upto, recent):
                for event in batch:
                    yield frame(event)
                    last = event["seq"]
                    if event["type"] == "terminal":
                        return
            if ended:
                return
            async for event in _live(sub):
                if isinstance(event, str):  # a keepalive, or the end of a lagged stream
                    yield event if event != LAGGED else lagged_frame(last)
                    continue
                if event["seq"] > last:
                    yield frame(event)
                    last = event["seq"]
                    if event["type"] == "terminal":
                        return
        finally:
            runs.hub.unsubscribe(sub)

    return _sse(stream())


@router.get("/events")
async def all_events(request: Request):
    _, _, runs = server_state(request)
    sub = runs.hub.subscribe(None)

    async def stream():
        try:
            yield ": live events of every run\n\n"
            async for event in _live(sub):
                if isinstance(event, str):
                    yield event if event != LAGGED else lagged_frame(0)
                else:
                    yield frame(event, with_id=False)
        finally:
            runs.hub.unsubscribe(sub)

    return _sse(stream())


LAGGED = "lagged"


async def _replay(log, first: int, upto: int, recent: list | None):
    """What came after `first` up to `upto`: the ring's copy when it reached back that far,
    else events.jsonl read a batch at a time off the loop (never the whole journal at once)."""
    if recent is not None:
        yield recent
        return
    batches = log.batches(first, upto)
    try:
        while (batch := await asyncio.to_thread(next, batches, None)) is not None:
            yield batch
    finally:
        batches.close()


async def _live(sub):
    """A subscription's events as they come, a keepalive comment when none came for a while,
    and LAGGED last when the client fell too far behind."""
    while True:
        try:
            event = await asyncio.wait_for(sub.next(), KEEPALIVE_SECONDS)
        except TimeoutError:
            yield ": keepalive\n\n"
            continue
        if event is None:
            yield LAGGED
            return
        yield event


def _sse(body) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


@router.get("/runs/{run_id}/metrics")
async def metrics(
    request: Request,
    run_id: str,
    since: int = Query(0, ge=0),
    names: str | None = None,
    limit: int = Query(1000, ge=1, le=1000),
):
    _, store, _ = server_state(request)
    with store.lock:
        find_run(request, run_id)
        log = store.logs[run_id]
        recent, upto = log.ring_since(since), log.seq
    events = await asyncio.to_thread(_first_metrics, log, since, upto, recent, limit)
    wanted = set(names.split(",")) if names else None
    out = []
    for e in events:
        values = {k: v for k, v in e["values"].items() if wanted is None or k in wanted}
        out.append(
            {k: e[k] for k in ("seq", "at", "iteration", "global_step")} | {"values": values}
        )
    return {"metrics": out, "next_since": out[-1]["seq"] if out else since}


def _first_metrics(log, since: int, upto: int, recent: list | None, limit: int) -> list[dict]:
    """The first `limit` metrics events after `since`: the journal is read only as far as
    they reach, one batch at a time, outside the store's lock."""
    found: list[dict] = []
    for batch in [recent] if recent is not None else log.batches(since, upto):
        found += [e for e in batch if e["type"] == "metrics"][: limit - len(found)]
        if len(found) >= limit:
            break
    return found
