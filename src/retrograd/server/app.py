"""The run server's FastAPI app: discovery routes here, runs in routes_runs.py (formats.md §9.3).

`create_app(config)` builds the app without touching the disk; its lifespan loads the state
directory (marking runs that were live `interrupted`) and, at shutdown, asks live runs to
checkpoint and stop. Every error outside the OpenAI routes is problem+json (guard.py).
Importing this module imports no torch: runs train in their own processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

from fastapi import FastAPI, Request

from retrograd.server.config import CATALOGUES, ServerConfig
from retrograd.server.datasets import Datasets
from retrograd.server.documents import DERIVED
from retrograd.server.events import QUEUE, Hub
from retrograd.server.guard import Guard, TextJSON, install_handlers
from retrograd.server.links import Links
from retrograd.server.model_files import ModelFiles
from retrograd.server.openai_routes import CHAT, Serving, model_routes
from retrograd.server.runner import Runs
from retrograd.server.store import RunStore
from retrograd.version import __version__

DATASETS = "/v1/datasets"  # uploads: their own body limit, a limit on silences, no time limit
SHUTDOWN_SECONDS = 600  # formats.md §9.1: live runs get this long to checkpoint and stop


def create_app(
    config: ServerConfig,
    *,
    python: str = sys.executable,
    shutdown_seconds: float = SHUTDOWN_SECONDS,
    event_queue: int = QUEUE,
) -> FastAPI:
    """The app for `config`. `python` runs the runs' processes; `event_queue` is how far a
    stream may fall behind before it is lagged."""
    store = RunStore(config.state_dir)
    hub = Hub(event_queue)
    runs = Runs(store, hub, config.max_concurrent_runs, python)

    serving = Serving(
        store,
        config.serving.idle_seconds,
        config.serving.device_wait_seconds,
        lambda: bool(runs.live),  # a run's process holds the device from start to end
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        with store.lock:
            store.load()
        sweeper = asyncio.create_task(_sweep(serving))
        yield
        sweeper.cancel()
        serving.close()
        await asyncio.to_thread(runs.shutdown, shutdown_seconds)

    app = FastAPI(
        title="retrograd-server",
        version=__version__,
        openapi_url="/v1/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        default_response_class=TextJSON,
    )
    app.state.config, app.state.store, app.state.runs, app.state.hub = config, store, runs, hub
    app.state.links = Links()
    app.state.datasets = Datasets(
        config.state_dir / "datasets", config.max_dataset_bytes, config.max_datasets_bytes
    )
    app.add_middleware(
        Guard,
        token=config.auth_token,
        max_body=config.max_body_bytes,
        route_limits={CHAT: config.serving.max_body_bytes, DATASETS: config.max_dataset_bytes},
        idle_limits={DATASETS: config.upload_idle_timeout_seconds},
        timeout=config.request_timeout_seconds,
        redact=config.redact,
        max_concurrent=config.max_concurrent_requests,
        links=app.state.links,
    )
    install_handlers(app, config.redact)
    _discovery(app, config)
    if config.serving.enabled:
        model_routes(
            app, store, runs, serving, config.command_timeout_seconds, config.serving.queue
        )
    from retrograd.server import routes_artifacts, routes_datasets, routes_events, routes_runs

    for module in (routes_runs, routes_events, routes_artifacts, routes_datasets):
        app.include_router(module.router, prefix="/v1")
    if config.ui:
        from retrograd.server.ui import mount_web

        mount_web(app)
    return app


async def _sweep(serving: Serving) -> None:
    """Drop the served model once it has been idle for [serving].idle_seconds."""
    while True:
        await asyncio.sleep(min(30.0, max(1.0, serving.idle_seconds / 2)))
        serving.close_if_idle()


def backends() -> list[str]:
    """The compute backends of this machine, found without importing torch."""
    found = ["cpu"]
    if (
        importlib.util.find_spec("torch") is not None
        and Path("/proc/driver/nvidia/version").exists()
    ):
        found.append("cuda")
    return found


def _discovery(app: FastAPI, config: ServerConfig) -> None:
    @app.get("/v1/health", tags=["discovery"])
    async def health():
        return {"status": "ok", "version": __version__, "backends": backends()}

    @app.get("/v1/capabilities", tags=["discovery"])
    async def capabilities():
        from retrograd.server.plans import host_memory

        total, free = host_memory()
        cpu = {
            "kind": "cpu",
            "name": "cpu",
            "description": f"{os.cpu_count()} CPU threads",
            "total_bytes": total,
            "free_bytes": free,
        }
        from retrograd.server.plans import gpu, total_vram

        devices = [{k: v for k, v in cpu.items() if v is not None}]
        found = await asyncio.to_thread(gpu)
        if found is not None:
            devices.append(
                {"kind": "cuda", "name": "cuda:0", "description": found[0], "total_bytes": found[1]}
            )
        return {
            "execution_profile_schema_version": 1,
            "backends": backends(),
            "devices": devices,
            "unified_memory": False,
            "budgets": {
                "vram": config.vram_budget.describe(),
                "ram": config.ram_budget.describe(),
                "ram_bytes": config.ram_budget.bytes_of(total),
                "vram_bytes": config.vram_budget.bytes_of(total_vram()),
                "margin": config.margin,
            },
            "features": {
                "openapi": True,
                "max_concurrent_runs": config.max_concurrent_runs,
                "serving_enabled": config.serving.enabled,
                "ui": config.ui,
                "auth": config.auth_token is not None,
                "mode": "server",
            },
        }

    files = ModelFiles(config.path_roots)

    @app.get("/v1/model-files", tags=["discovery"])
    async def model_files(refresh: bool = False):
        return {"files": await asyncio.to_thread(files.listing, refresh)}

    @app.get("/v1/defaults", tags=["discovery"])
    async def defaults():
        from retrograd.server.recipes import DERIVED_RULES

        return {"derived": DERIVED + DERIVED_RULES, "active_defaults": []}

    @app.get("/v1/config-schema", tags=["discovery"])
    async def config_schema():
        from retrograd.server.documents import marked_schema

        return marked_schema()

    def catalogue(kind: str):
        async def listing():
            entries = []
            for entry in getattr(config, kind):
                shown = {"id": entry.id, "description": entry.description}
                for extra in ("mode", "type"):  # what a client may choose by; never commands
                    if hasattr(entry, extra):
                        shown[extra] = getattr(entry, extra)
                entries.append(shown)
            return {kind + "s": entries}

        return listing

    for kind in CATALOGUES:
        route = "/v1/" + kind.replace("_", "-") + "s"
        app.add_api_route(route, catalogue(kind), methods=["GET"], tags=["discovery"])


def app_of(request: Request):
    return request.app.state
