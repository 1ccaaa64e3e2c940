"""The guard (server/guard.py) alone, around an app that answers 200: which requests it counts
against max_concurrent_requests.

Event streams are counted apart (they last as long as their clients); everything else together. A
path that merely ends in `/events` (the `events` artifact's download, a dataset or run named
`events`) is no stream, and was left uncounted, and untimed, by a test of the path's end.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from retrograd.server.guard import Guard


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def full():
    """A guard that has no room for one more counted request."""
    guard = Guard(_ok, token=None, max_body=1024, timeout=5.0, redact=False, max_concurrent=1)
    guard.active = 1  # the one counted place is taken; the streams' own place is free
    return TestClient(guard, base_url="http://127.0.0.1")  # no lifespan: the app has none


@pytest.mark.parametrize("path", ["/v1/events", "/v1/runs/run_1/events"])
def test_event_streams_are_not_counted_with_requests(full, path):
    assert full.get(path).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/v1/runs/run_1/artifacts/events",  # a download, not a stream
        "/v1/datasets/events",
        "/v1/runs/events/events/x",
        "/v1/runs/run_1/trajectories/updates/1/groups/events",
    ],
)
def test_a_path_that_only_ends_like_a_stream_is_counted(full, path):
    r = full.get(path)
    assert r.status_code == 429, (path, r.status_code)
    assert r.json()["type"].endswith("/too-many-requests")
