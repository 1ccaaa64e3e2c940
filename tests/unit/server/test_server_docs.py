"""docs/server.md's route table is the app's routes: each route it lists answers, and each
route the app answers is listed (a route added or removed must change the page)."""

from __future__ import annotations

import re
from pathlib import Path

from retrograd.server.app import create_app
from retrograd.server.config import load_server_config

DOC = Path(__file__).resolve().parents[3] / "docs" / "server.md"
METHODS = ("GET", "POST", "PATCH", "DELETE")


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def documented() -> set[tuple[str, str]]:
    """(method, path shape) of each route the table lists: `METHOD /v1/a/b` sets the method
    and the path, `/c` beside it is the sibling /v1/a/c; other cells' words are not routes."""
    table = DOC.read_text(encoding="utf-8").split("\n## Routes\n", 1)[1]
    found = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        method, path = None, None
        for item in re.findall(r"`([^`]*)`", row.split(" | ")[0]):
            head, _, rest = item.partition(" ")
            if head in METHODS and rest.startswith("/v1/"):
                method, path = head, rest.split("?")[0]
            elif item.startswith("/") and path is not None:
                path = path.rsplit("/", 1)[0] + item
            else:
                continue
            found.add((method, _shape(path)))
    return found


def test_the_route_table_lists_exactly_the_apps_routes(tmp_path):
    config = load_server_config(overrides={"state_dir": str(tmp_path)}, environ={})
    app = create_app(config)
    answered = {(m.upper(), _shape(p)) for p, item in app.openapi()["paths"].items() for m in item}
    answered |= {("POST", "/v1/chat/completions"), ("GET", "/v1/openapi.json")}  # not in it
    listed = documented()
    assert len(listed) > 40
    assert sorted(answered - listed) == [], "routes the page does not list"
    assert sorted(listed - answered) == [], "routes the page lists that nothing answers"
