"""What a run wrote, over HTTP (formats.md §9.3, §5.3): artifacts, signed links, checkpoints,
trajectories.

Files download whole (`adapter`, `run`, `events`); folders are listed. A signed link
(links.py, checked by the guard) downloads one artifact for 60 seconds without the token. Paths are left out of the
listings when the server redacts them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from retrograd.server.documents import hide_keys
from retrograd.server.guard import BoundedRoute
from retrograd.server.problems import Problem, not_found
from retrograd.server.routes_runs import find_run, server_state
from retrograd.server.store import RunRecord, iso
from retrograd.text import json_dumps

router = APIRouter(tags=["artifacts"], route_class=BoundedRoute)


def _artifacts(request: Request, record: RunRecord) -> list[dict[str, Any]]:
    _, store, _ = server_state(request)
    folder = store.folder(record.id)
    cfg = record.effective_config
    places = {
        "adapter": cfg.get("output", {}).get("path"),
        "run": str(folder / "run.json"),
        "events": str(folder / "events.jsonl"),
        "checkpoints": cfg.get("checkpoint", {}).get("directory"),
        "tensorboard": cfg.get("metrics", {}).get("tensorboard_dir"),
        "wandb_export": cfg.get("metrics", {}).get("wandb_export_dir"),
        "observe": cfg.get("observe", {}).get("directory"),
    }
    out = []
    for name, place in places.items():
        if place is None:
            continue
        path = Path(place)
        kind = (
            "directory"
            if name in ("checkpoints", "tensorboard", "wandb_export", "observe")
            else "file"
        )
        present = path.is_dir() if kind == "directory" else path.is_file()
        item = {
            "name": name,
            "path": str(path),
            "kind": kind,
            "present": present,
            "downloadable": present and kind == "file",
        }
        if present and kind == "file":
            item["bytes"] = path.stat().st_size
        out.append(item)
    return out


@router.get("/runs/{run_id}/artifacts")
async def artifacts(request: Request, run_id: str):
    record = find_run(request, run_id)
    config = request.app.state.config
    items = _artifacts(request, record)
    if config.redact:
        for item in items:
            item.pop("path")
    return {"artifacts": items}


def _downloadable(request: Request, record: RunRecord, name: str) -> dict[str, Any]:
    found = {a["name"]: a for a in _artifacts(request, record)}.get(name)
    if found is None or not found["downloadable"]:
        why = "no such artifact" if found is None else "not present, or a directory"
        raise not_found(f"run {record.id} has no downloadable artifact {name!r} ({why})", "name")
    return found


@router.get("/runs/{run_id}/artifacts/{name}")
async def artifact(
    request: Request,
    run_id: str,
    name: str,
    sig: str | None = Query(None, description="a signed link's signature (checked by the guard)"),
    exp: str | None = Query(None, description="a signed link's expiry, unix seconds"),
):
    """The artifact's file. Without the token only through a signed link, which the guard
    checks before this runs (links.py): here the request is allowed either way."""
    record = find_run(request, run_id)
    found = _downloadable(request, record, name)
    suffix = {"adapter": ".gguf", "run": ".json", "events": ".jsonl"}.get(name, "")
    filename = f"{run_id}-{name}{suffix}"
    if name == "run":  # run.json as its view shows it: the catalogue's keys hidden
        return Response(
            _run_json(found["path"]),
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    return FileResponse(found["path"], filename=filename, media_type="application/octet-stream")


def _run_json(path: str) -> bytes:
    """run.json with the values of the catalogue's headers and env hidden (documents.hide_keys)
    in its effective config and its document."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for key in ("effective_config", "document"):
        if isinstance(data.get(key), dict):
            data[key] = hide_keys(data[key])
    return json_dumps(data, indent=1).encode("utf-8")


@router.post("/runs/{run_id}/artifacts/{name}/link")
async def link(request: Request, run_id: str, name: str):
    record = find_run(request, run_id)
    _downloadable(request, record, name)
    sig, exp = request.app.state.links.sign(run_id, name)
    return {
        "href": f"/v1/runs/{run_id}/artifacts/{name}?sig={sig}&exp={exp}",
        "expires_at": iso(exp * 1000),
    }


@router.get("/runs/{run_id}/checkpoints")
async def checkpoints(request: Request, run_id: str):
    """The run's checkpoints newest first (formats.md §5.3); `latest` is what a resume picks."""
    from retrograd.checkpoint.layout import latest_checkpoint, list_checkpoints

    record = find_run(request, run_id)
    directory = record.effective_config.get("checkpoint", {}).get("directory")
    if directory is None:
        return {"checkpoints": []}
    hide = request.app.state.config.redact
    items = []
    for c in list_checkpoints(directory):
        item = {
            "id": c.id,
            "path": str(c.path),
            "kind": c.kind,
            "global_step": c.global_step,
            "bytes": c.bytes,
            "complete": c.complete,
            "adapter": str(c.adapter) if c.adapter else None,
            "written_at": iso(int(c.written_at * 1000)) if c.written_at else None,
        }
        if hide:
            item.pop("path")
            item["adapter"] = c.adapter is not None or None
        items.append({k: v for k, v in item.items() if v is not None})
    latest = latest_checkpoint(directory)
    out: dict[str, Any] = {"checkpoints": items}
    if latest is not None:
        out["latest"] = latest.name.removesuffix(".state")
    if not hide:
        out["directory"] = directory
    return out


# -- trajectories: the run's rollouts, from its [observe] feed (trajectories.py) --------------


def _trajectories(request: Request, run_id: str):
    from retrograd.server.trajectories import Trajectories

    record = find_run(request, run_id)
    observe = record.effective_config.get("observe")
    return (Trajectories(Path(observe["directory"])), observe) if observe else (None, None)


@router.get("/runs/{run_id}/trajectories")
async def trajectories(request: Request, run_id: str):
    found, observe = _trajectories(request, run_id)
    if found is None:
        return {"observed": False, "segments": [], "skipped": 0, "updates": []}
    return found.overview(observe.get("every"))


@router.get("/runs/{run_id}/trajectories/updates/{update}")
async def trajectory_update(
    request: Request,
    run_id: str,
    update: int,
    cursor: int = Query(0, ge=0),
    limit: int = Query(50, ge=1, le=500),
    preview_chars: int = Query(400, ge=0),
):
    found, _ = _trajectories(request, run_id)
    if found is None:
        raise _not_observed(run_id)
    return found.groups(update, cursor, limit, preview_chars)


@router.get("/runs/{run_id}/trajectories/updates/{update}/groups/{group}")
async def trajectory_group(
    request: Request, run_id: str, update: int, group: str, member: int | None = None
):
    found, _ = _trajectories(request, run_id)
    if found is None:
        raise _not_observed(run_id)
    return found.group(update, group, member)


def _not_observed(run_id: str) -> Problem:
    return not_found(f"run {run_id} records no rollouts (no [observe])")
