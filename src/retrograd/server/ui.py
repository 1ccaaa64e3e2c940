"""The web page (formats.md §9.4): static files served by the server itself, under `/`.

`/` is the page (web/index.html) and `/web/...` its modules and style: plain HTML, ES modules
and CSS, nothing built or downloaded. The files are public; everything the page shows comes
from `/v1`, which asks for the bearer token when the server has one. `ui = false` serves none.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).parent / "web"
NO_CACHE = {"Cache-Control": "no-cache"}  # a new server version's page is picked up at once


class _Files(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response


def mount_web(app: FastAPI) -> None:
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return FileResponse(WEB / "index.html", headers=NO_CACHE)

    app.mount("/web", _Files(directory=WEB), name="web")
