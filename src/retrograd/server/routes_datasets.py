"""Datasets over HTTP (formats.md §9.3): upload, list, view, preview, tokenize, delete.

`POST /v1/datasets?name=&format=auto|text|jsonl|preference-jsonl` takes JSON lines
(`application/x-ndjson`), a JSON array of records (`application/json`) or a text
(`text/plain`), up to `max_dataset_bytes`; 201 for a new dataset, 200 when the same content was
uploaded before. JSON lines and text are written to a temporary file as they arrive and
checked from it a line at a time, so an upload of max_dataset_bytes costs little memory; a JSON
array is read and parsed whole. A run names a dataset by its id where a file path goes. Storage and checks
are datasets.py's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from retrograd.server.datasets import check_format
from retrograd.server.documents import check_file
from retrograd.server.guard import BoundedRoute
from retrograd.server.problems import Problem

router = APIRouter(tags=["datasets"], route_class=BoundedRoute)
MEDIA = ("application/x-ndjson", "application/jsonl", "application/json", "text/plain")


def _datasets(request: Request):
    return request.app.state.datasets


@router.post("/datasets", status_code=201)
async def upload(
    request: Request, response: Response, name: str | None = None, format: str = "auto"
):
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in MEDIA:
        raise Problem(
            "unsupported-media-type",
            f"{media or 'no content type'}: send {', '.join(MEDIA)}",
        )
    media = "application/x-ndjson" if media == "application/jsonl" else media
    datasets = _datasets(request)
    if media == "application/json":  # one array: read and parsed whole
        body = await request.body()
        view, created = await asyncio.to_thread(datasets.add, body, media, format, name)
    else:  # JSON lines or text: spooled to disk as it arrives, then checked line by line
        check_format(format)
        spool = datasets.spool_path()
        try:
            with open(spool, "wb") as out:
                async for chunk in request.stream():
                    out.write(chunk)
            view, created = await asyncio.to_thread(datasets.add_file, spool, media, format, name)
        finally:
            spool.unlink(missing_ok=True)
    response.status_code = 201 if created else 200
    return view


@router.get("/datasets")
async def list_datasets(
    request: Request, limit: int = Query(50, ge=1, le=500), cursor: str | None = None
):
    views = _datasets(request).all()
    if cursor is not None:
        ids = [v["id"] for v in views]
        views = views[ids.index(cursor) + 1 :] if cursor in ids else []
    out: dict = {"datasets": views[:limit]}
    if len(views) > limit:
        out["next_cursor"] = views[limit - 1]["id"]
    return out


@router.get("/datasets/{dataset_id}")
async def get_dataset(request: Request, dataset_id: str):
    return _datasets(request).need(dataset_id)


@router.delete("/datasets/{dataset_id}", status_code=204)
async def delete_dataset(request: Request, dataset_id: str):
    _datasets(request).delete(dataset_id)
    return Response(status_code=204)


@router.get("/datasets/{dataset_id}/preview")
async def preview(request: Request, dataset_id: str, limit: int = Query(5, ge=1, le=100)):
    datasets = _datasets(request)
    view = datasets.need(dataset_id)
    return {
        "id": dataset_id,
        "format": view["format"],
        "examples": await asyncio.to_thread(datasets.examples, dataset_id, limit),
    }


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str


@router.post("/datasets/{dataset_id}/tokenize")
async def tokenize(request: Request, dataset_id: str, body: TokenizeRequest):
    datasets = _datasets(request)
    datasets.need(dataset_id)
    model = check_file(Path(body.model), request.app.state.config, ("model",))
    return await asyncio.to_thread(datasets.tokenize, dataset_id, model)
