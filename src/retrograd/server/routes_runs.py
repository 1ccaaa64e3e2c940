"""Runs over HTTP (formats.md §9.3): create, list, view, delete, control, ask a live run
(events and metrics are in routes_events.py, artifacts in routes_artifacts.py).

A run is created from a whole run document: `{"config": {...}, "params": {...}, "name": ...}`
as JSON, or the TOML of a run file (`Content-Type: application/toml`, `?name=` beside it).
`?dry_run=true` (and `POST /v1/plan`) validate and answer the effective config without
creating anything. The recipe form (recipes.py) and `fork_from` (forks.py) make the document
the same checks then take. Control
routes answer CommandAccepted (202); their effect comes at the run's next boundary.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from retrograd.config import RunConfig, validate_run
from retrograd.config.load import parse_toml
from retrograd.errors import ConfigError
from retrograd.nesting import TooDeep
from retrograd.server import forks
from retrograd.server.documents import PATCHABLE, check_file, hide_keys, merge, prepare
from retrograd.server.guard import BoundedRoute, read_json_object, refuse_unwritable
from retrograd.server.problems import (
    FieldError,
    Problem,
    issues_to_errors,
    not_found,
    pointer,
    too_deep,
)
from retrograd.server.runner import LIVE
from retrograd.server.store import FINISHED, TERMINAL, RunRecord, iso, new_run_id, now_ms

router = APIRouter(tags=["runs"], route_class=BoundedRoute)
REQUEST_FIELDS = ("config", "params", "name", "recipe", "fork_from")


def server_state(request: Request):
    s = request.app.state
    return s.config, s.store, s.runs


def find_run(request: Request, run_id: str) -> RunRecord:
    _, store, _ = server_state(request)
    record = store.runs.get(run_id)
    if record is None:
        raise not_found(f"no run {run_id!r}")
    return record


def summary(record: RunRecord, runs) -> dict[str, Any]:
    return {
        "id": record.id,
        "name": record.name,
        "status": record.status,
        "algorithm": record.algorithm,
        "model": record.model,
        "created_at": iso(record.created_at),
        "started_at": iso(record.started_at),
        "finished_at": iso(record.finished_at),
        "error": record.error,
        "queue_position": runs.queue_position(record.id),
        "holds_device": record.id in runs.live,
        "progress": record.progress,
    }


def view(record: RunRecord, runs) -> dict[str, Any]:
    return {
        **summary(record, runs),
        "objective": record.objective,
        "observed": record.observed,
        "effective_config": hide_keys(record.effective_config),
        "provenance": record.provenance,
        "plan": record.plan,
    }


class PreflightRequest(BaseModel):
    """POST /v1/preflight (formats.md §9.3): `retrograd preflight`'s flags."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    device: Literal["auto", "cpu", "gpu"] | None = None
    targets: list[str] | str = "auto"


# -- creating ---------------------------------------------------------------------------------


@dataclass
class Asked:
    """What a PlanRequest asks for (formats.md §9.3), its form checked."""

    document: dict | None
    params: dict | None = None
    name: str | None = None
    where: str = "config"  # the document's pointer in the request ("" for TOML)
    fork: Any = None
    recipe: Any = None


async def _run_request(request: Request) -> Asked:
    """The PlanRequest of a JSON body, or the run file of a TOML one."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    body = await request.body()
    if media in ("application/toml", "text/toml", "application/x-toml"):
        try:
            document = parse_toml(body.decode("utf-8"), "the TOML body")
        except (ConfigError, UnicodeDecodeError) as error:
            if isinstance(error.__cause__, TooDeep):
                raise too_deep(error.__cause__, str(error)) from None
            raise Problem(
                "invalid-request", str(error), [FieldError("", "unsupported_format", str(error))]
            ) from None
        refuse_unwritable(document)  # TOML's nan and inf: no JSON answer carries them
        return Asked(document, name=request.query_params.get("name"), where="")
    if media != "application/json":
        raise Problem(
            "unsupported-media-type",
            f"{media}: send application/json (a PlanRequest) or application/toml (a run file)",
        )
    data = read_json_object(body, REQUEST_FIELDS)
    fork, recipe = data.get("fork_from"), data.get("recipe")
    if recipe is not None and ("config" in data or fork is not None):
        other = "config" if "config" in data else "fork_from"
        raise _invalid(other, "invalid_value", "send exactly one of recipe, config, a TOML body")
    if recipe is None and not isinstance(data.get("config"), dict):
        if not (fork and "config" not in data):
            raise _invalid("config", "missing_field", "required: the run document (or a TOML body)")
    params = data.get("params")
    if params is not None and not isinstance(params, dict):
        raise _invalid("params", "invalid_value", "must be an object: a partial run document")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise _invalid("name", "invalid_value", "must be a string")
    where = "recipe" if recipe is not None else "config"
    return Asked(data.get("config"), params, name, where, fork, recipe)


async def _prepared(request: Request, run_dir: Path, calibrate: bool = False):
    """(the run prepared from the request, the request, its plan): documents.prepare over the
    document, the recipe's (recipes.py) or the fork's (forks.py); the plan within budgets."""
    config, store, _ = server_state(request)
    asked = await _run_request(request)
    if calibrate:
        _can_calibrate(config)
    if asked.recipe is not None:
        return await _from_recipe(request, asked, run_dir)
    own, why = [], None
    document = asked.document
    if asked.fork is not None:
        with store.lock:
            adapter, theirs, why = forks.source(asked.fork, store, config)
        if document is None and theirs is None:
            raise _invalid("config", "missing_field", "required with fork_from {path}")
        document = forks.apply(document if document is not None else theirs, adapter, run_dir)
        if adapter.is_relative_to(store.root.resolve()):
            own.append(adapter.parent)  # another run's folder: the server's own files
    datasets = request.app.state.datasets
    prepared = prepare(document, asked.params, config, run_dir, asked.where, datasets, own)
    if why is not None:
        prepared.provenance["lora.init_adapter"] = {"source": "derived", "reason": why}
    return prepared, asked, await planned(request, prepared)


async def _from_recipe(request: Request, asked: Asked, run_dir: Path):
    """A recipe's run: its document (recipes.py) with the params over it, the derived values'
    reasons in the provenance, and the plan's levers applied while it is over the budgets."""
    from retrograd.server import plans, recipes

    config, datasets = request.app.state.config, request.app.state.datasets
    recipe = await asyncio.to_thread(recipes.Recipe, asked.recipe, config, datasets, run_dir)
    document, applied = recipe.document, []
    while True:
        prepared = prepare(document, asked.params, config, run_dir, "", datasets)
        locked = set(plans.leaves(asked.params or {}))
        for path, reason in recipe.reasons.items():
            if path not in locked:
                prepared.provenance[path] = {"source": "derived", "reason": reason}
        try:
            plan = await planned(request, prepared, recipe.limits, applied)
        except Problem as problem:
            unlocks = problem.meta.get("unlocks") if problem.kind == "insufficient-memory" else None
            if not unlocks:
                raise
            for lever in unlocks:
                document = recipe.apply_lever(document, lever)
                applied.append(lever)
            continue
        plan["levers_applied"] = applied
        if recipe.minutes is not None:  # the run ends after this long (child.py)
            plan["time_budget_minutes"] = recipe.minutes
        for lever in applied:
            prepared.provenance[lever["path"]] = {
                "source": "derived",
                "reason": "a lever of the plan, to fit the memory budget",
            }
        return prepared, asked, plan


def _invalid(field: str, code: str, message: str) -> Problem:
    return Problem(
        "invalid-request", f"{field}: {message}", [FieldError(pointer(field), code, message)]
    )


async def planned(request: Request, prepared, limits=None, applied=None) -> dict[str, Any]:
    """The prepared run's plan (plans.py), refused over the memory budgets."""
    from retrograd.server import plans

    config = request.app.state.config
    prefix = (prepared.where,) if prepared.where else ()
    plan = await asyncio.to_thread(plans.build_plan, prepared.config, prepared.provenance, prefix)
    plans.check_budget(plan, config, limits, applied)
    return plan


def _dry(prepared, plan) -> dict[str, Any]:
    return {
        "effective_config": hide_keys(prepared.config.model_dump(mode="json", exclude_none=True)),
        "provenance": prepared.provenance,
        "plan": plan,
    }


def _can_calibrate(config) -> None:
    if not config.calibrate_runs:
        raise Problem(
            "conflict",
            "this server does not calibrate plans (calibrate_runs = false)",
            [FieldError("/calibrate", "conflict", "calibrate_runs = false")],
        )


async def calibrated(request: Request, prepared, plan: dict[str, Any]) -> None:
    """plan.memory.measured: one step of the run measured in a process of its own (probe.py)."""
    _can_calibrate(request.app.state.config)
    measured = await run_probe(
        request,
        "calibrate",
        {"document": prepared.document, "base_dir": str(prepared.base_dir)},
    )
    plan["memory"]["measured"] = measured


async def run_probe(request: Request, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """probe.py's answer for `kind`; timeout past command_timeout_seconds."""
    state = request.app.state
    process = await asyncio.create_subprocess_exec(
        state.runs.python,
        "-m",
        "retrograd.server.probe",
        kind,
        stdin=asyncio.subprocess.PIPE,  # the request: an argument holds 128 KiB at most
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    request = json.dumps(body).encode("utf-8")
    try:
        out, _ = await asyncio.wait_for(
            process.communicate(request), state.config.command_timeout_seconds
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        raise Problem(
            "timeout", f"{kind} took more than {state.config.command_timeout_seconds:g} s"
        ) from None
    try:
        answer = json.loads(out.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Problem("internal", f"{kind} ended without an answer") from None
    if "error" in answer:
        raise Problem("invalid-request", f"{kind}: {answer['error']}")
    return answer


@router.post("/plan")
async def plan(request: Request, calibrate: bool = False):
    _, store, _ = server_state(request)
    prepared, _asked, found = await _prepared(request, store.folder("run_plan"), calibrate)
    if calibrate:
        await calibrated(request, prepared, found)
    return _dry(prepared, found)


@router.post("/runs", status_code=201)
async def create_run(request: Request, response: Response, dry_run: bool = False):
    _, store, runs = server_state(request)
    key = request.headers.get("idempotency-key")
    if key is not None:
        with store.lock:
            for record in store.runs.values():
                if record.identity.get("idempotency_key") == key:
                    response.status_code = 200
                    return view(record, runs)
    run_id = new_run_id()
    prepared, asked, found = await _prepared(request, store.folder(run_id).resolve())
    if dry_run:
        response.status_code = 200
        return _dry(prepared, found)
    cfg = prepared.config
    record = RunRecord(
        id=run_id,
        name=asked.name,
        status="queued",
        algorithm=cfg.run.algorithm,
        model=str(cfg.model.path),
        objective=asked.recipe.get("objective") if asked.recipe is not None else None,
        created_at=now_ms(),
        effective_config=cfg.model_dump(mode="json", exclude_none=True),
        provenance=prepared.provenance,
        plan=found,
        document=prepared.document,
        base_dir=str(prepared.base_dir),
        observed=cfg.observe is not None,
        identity={"idempotency_key": key} if key is not None else {},
        artifacts={"adapter": str(cfg.output.path)},
    )
    with store.lock:
        store.add(record)
        runs.emit(record, "status", {"status": "queued"})
        runs.enqueue(record)
        return view(record, runs)


@router.post("/preflight")
async def preflight(request: Request, body: PreflightRequest):
    """`retrograd preflight` as JSON: one audited LoRA step, in a process of its own."""
    config = request.app.state.config
    model = check_file(Path(body.model), config, ("model",))
    targets = body.targets if isinstance(body.targets, list) else body.targets.split(",")
    asked = {"model": str(model), "device": body.device, "targets": [t.strip() for t in targets]}
    return await run_probe(request, "preflight", asked)


# -- reading ----------------------------------------------------------------------------------


@router.get("/runs")
async def list_runs(
    request: Request,
    status: str | None = None,
    algorithm: str | None = None,
    name: str | None = None,
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = None,
):
    _, store, runs = server_state(request)
    with store.lock:
        chosen = [
            r
            for r in sorted(store.runs.values(), key=lambda r: r.id, reverse=True)
            if (status is None or r.status in status.split(","))
            and (algorithm is None or r.algorithm == algorithm)
            and (name is None or r.name == name)
            and (cursor is None or r.id < cursor)
        ]
        page = [summary(r, runs) for r in chosen[:limit]]
    out: dict[str, Any] = {"runs": page}
    if len(chosen) > limit:
        out["next_cursor"] = page[-1]["id"]
    return out


@router.get("/runs/{run_id}")
async def get_run(request: Request, run_id: str):
    _, store, runs = server_state(request)
    with store.lock:
        return view(find_run(request, run_id), runs)


@router.delete("/runs/{run_id}", status_code=204)
async def delete_run(request: Request, run_id: str):
    _, store, _ = server_state(request)
    with store.lock:
        record = find_run(request, run_id)
        if record.status not in FINISHED:
            raise Problem(
                "conflict",
                f"run {run_id} is {record.status}; cancel it first",
                [FieldError(pointer("id"), "conflict", f"the run is {record.status}")],
            )
        store.delete(run_id)
    return Response(status_code=204)


# -- control ----------------------------------------------------------------------------------


def _accepted(record: RunRecord, applied: list[str] | None = None) -> dict[str, Any]:
    out = {"id": record.id, "status": record.status, "applied": applied or []}
    if "iteration" in record.progress:
        out["applies_at_iteration"] = record.progress["iteration"]
    return out


def _control(action: str):
    """A control route without a body: Runs.<action> on the run, answered CommandAccepted."""

    async def route(request: Request, run_id: str):
        record = find_run(request, run_id)
        getattr(request.app.state.runs, action)(record)
        return _accepted(record)

    route.__name__ = action
    return route


for _path, _action in (("pause", "pause"), ("resume", "resume"), ("checkpoints", "checkpoint")):
    router.add_api_route(
        f"/runs/{{run_id}}/{_path}", _control(_action), methods=["POST"], status_code=202
    )


@router.post("/runs/{run_id}/cancel", status_code=202)
async def cancel(request: Request, run_id: str):
    _, _, runs = server_state(request)
    record = find_run(request, run_id)
    body = read_json_object(await request.body(), ("at", "checkpoint"))
    at = body.get("at", "boundary")
    checkpoint = body.get("checkpoint", False)
    errors = []
    if at not in ("boundary", "now"):
        errors.append(FieldError(pointer("at"), "invalid_value", "must be boundary or now"))
    if not isinstance(checkpoint, bool):
        errors.append(FieldError(pointer("checkpoint"), "invalid_value", "must be true or false"))
    elif checkpoint and at == "now":
        errors.append(
            FieldError(pointer("checkpoint"), "invalid_value", 'a checkpoint needs at = "boundary"')
        )
    if errors:
        raise Problem("invalid-request", "the cancel request is not valid", errors)
    runs.cancel(record, at, checkpoint)
    return _accepted(record)


@router.patch("/runs/{run_id}")
async def patch(request: Request, run_id: str):
    """Whitelisted keys changed during a run (formats.md §9.3): [training].lr, [evaluation]
    every_iterations and patience, [checkpoint] every_steps and mode. The run file as it would
    be is checked against every rule; a live run follows the keys from its next boundary; run.json
    keeps them (`patched`) for a resume, and an event says what changed."""
    config, store, runs = server_state(request)
    record = find_run(request, run_id)
    body = read_json_object(await request.body(), tuple(PATCHABLE))
    errors = []
    for section, table in body.items():
        keys = table if isinstance(table, dict) else {"": None}
        for key in keys:
            if key not in PATCHABLE[section]:
                errors.append(
                    FieldError(
                        pointer(section, key),
                        "override_conflict",
                        f"[{section}].{key} cannot change during a run; start a new run "
                        "with fork_from",
                    )
                )
    if errors:
        raise Problem("conflict", "only the whitelisted keys change during a run", errors)
    if record.status in TERMINAL:
        raise Problem("conflict", f"run {run_id} is {record.status}")
    patched = merge(record.patched, body)
    # the run's document takes every key but the rate, which its checkpoints' identity holds
    # (the run's process starts from the patched rate itself: child.py)
    document = merge(record.document, {s: keys for s, keys in body.items() if s != "training"})
    whole = merge(document, {"training": patched.get("training", {})})
    try:  # the run file as it would be: every rule still holds (best_eval needs [evaluation])
        cfg = validate_run(whole, source="the patched run", base_dir=record.base_dir)
    except ConfigError as error:
        issues = getattr(error, "issues", None) or []
        raise Problem("invalid-request", str(error), issues_to_errors(issues, RunConfig)) from None
    if "lr" in body.get("training", {}):
        _check_rate(run_id, cfg)
    names = [f"{s}.{k}" for s, keys in body.items() for k in keys]
    applied: dict[str, Any] = {"applied": names}
    if record.id in runs.live and record.status in LIVE:
        applied = await _ask(request, run_id, "patch", body)
    with store.lock:
        record.document, record.patched = document, patched
        record.effective_config = cfg.model_dump(mode="json", exclude_none=True)
        for name in names:
            record.provenance[name] = {"source": "override", "reason": "PATCH"}
        store.save(record)
        out = _accepted(record, applied["applied"])
        if "iteration" in applied:
            out["applies_at_iteration"] = applied["iteration"]
        changes = ", ".join(f"{s}.{k} = {v}" for s, keys in body.items() for k, v in keys.items())
        at = out.get("applies_at_iteration")
        runs.emit(
            record,
            "log",
            {
                "message": f"patched: {changes}" + (f" (from iteration {at})" if at else ""),
                "patched": body,
                "applies_at_iteration": at,
            },
        )
    return out


def _check_rate(run_id: str, cfg) -> None:
    """Refuse a new [training].lr that the run would not follow."""
    from retrograd.optim.build import base_lr  # torch: only when a rate changes

    if base_lr(cfg.training, cfg.optimizer) != cfg.training.lr:
        raise Problem(
            "conflict",
            f"run {run_id} does not follow [training].lr: Muon leaves its adapter to AdamW at "
            "[optimizer.muon].fallback_learning_rate",
            [FieldError(pointer("training", "lr"), "conflict", "not the rate this run follows")],
        )


class GenerateRequest(BaseModel):
    """POST /v1/runs/{id}/generate (formats.md §9.3)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not 7, true not 1.0

    prompt: str = Field(min_length=1)
    chat: bool = True
    include_base: bool = False
    max_new_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)


@router.post("/runs/{run_id}/generate")
async def generate(request: Request, run_id: str, body: GenerateRequest):
    """An answer from the run's weights as they are at its next boundary (paused runs too)."""
    return await _ask(request, run_id, "generate", body.model_dump(exclude_none=True))


async def _ask(request: Request, run_id: str, op: str, asked: dict[str, Any]) -> dict[str, Any]:
    config, _, runs = server_state(request)
    waiting = runs.ask(find_run(request, run_id), op, asked)
    try:
        reply = await asyncio.wait_for(asyncio.wrap_future(waiting), config.command_timeout_seconds)
    except TimeoutError:
        raise Problem(
            "timeout",
            f"run {run_id} reached no boundary within {config.command_timeout_seconds:g} s",
        ) from None
    if "error" in reply:
        raise Problem("invalid-request", f"the run could not answer: {reply['error']}")
    return {"id": run_id, **reply["body"]}


@router.post("/runs/{run_id}/evaluate")
async def evaluate(request: Request, run_id: str):
    """The run's own evaluation at its next boundary, with the weights as they are: loss and
    perplexity (sft, offline distillation on its corpus), loss and reward accuracy
    (preference), teacher KL (on-policy distillation), mean, lowest and highest reward and
    accuracy (ppo, grpo, agent_grpo). Neither its best checkpoint nor its patience see it."""
    record = find_run(request, run_id)
    read_json_object(await request.body(), ())
    offline = record.effective_config.get("distill", {}).get("mode") == "topk_offline"
    if "evaluation" not in record.effective_config and not offline:
        how = "add [evaluation] with data = a held-out file in the run's training format"
        raise Problem(
            "conflict",
            f"run {run_id} has no evaluation data; {how} to a new run (fork_from this one)",
            [FieldError(pointer("evaluation", "data"), "missing_field", how)],
        )
    return await _ask(request, run_id, "evaluate", {})
