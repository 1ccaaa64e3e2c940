"""What one client with the token can make the server hold or spend: a long run's event
replay and its metrics are read from events.jsonl a bounded piece at a time (the whole journal
was parsed into memory per stream, and under the store's lock per metrics query); event streams
have a limit of their own (they were not counted at all); a body of 100,000 unknown keys
answers 101 problems (it answered 100,000); a dataset upload is spooled to disk and checked a
line at a time, and a preview reads no further than it shows (both read the whole dataset).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tracemalloc

import pytest
from fastapi.testclient import TestClient

from retrograd.server.app import create_app
from retrograd.server.config import load_server_config
from retrograd.server.guard import Guard
from retrograd.server.store import EventLog, RunRecord, now_ms

RUN = "run_00000000000a1b2c4"
EVENTS = 20_000
NOTE = "x" * 300  # an event of about 400 bytes: a journal of about 8 MB


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    config = load_server_config(overrides={"state_dir": str(tmp / "state")}, environ={})
    app = create_app(config)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        record = RunRecord(
            id=RUN, name=None, status="completed", algorithm="sft", model="m", created_at=now_ms()
        )
        with app.state.store.lock:
            app.state.store.add(record)
        path = app.state.store.folder(RUN) / "events.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for seq in range(1, EVENTS + 1):
                kind = "metrics" if seq % 2 else "progress"
                event = {"seq": seq, "at": seq, "type": kind, "iteration": seq, "global_step": seq}
                event |= {"values": {"loss": 1.0, "note": NOTE}}
                out.write(json.dumps(event) + "\n")
        with app.state.store.lock:  # read back as a restarted server does: its ring the last
            app.state.store.logs[RUN] = EventLog(path)
        yield client


def _peak_of(
    client, path: str, body: bytes = b"", media: str = "", chunk: int = 65536
) -> tuple[int, int, int]:
    """(status, answer bytes, peak of Python's allocations) of a request served in the app's
    own loop: a GET, or a POST of `body` sent in chunks as a network would, its answer
    counted and dropped as it comes (a client that reads slowly costs the same)."""
    state = {"status": 0, "bytes": 0}
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def call():
        gone = asyncio.Event()

        async def receive():
            if pieces:
                piece = pieces.pop(0)
                return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body":
                state["bytes"] += len(message.get("body", b""))

        route, _, query = path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST" if body else "GET",
            "scheme": "http",
            "path": route,
            "raw_path": route.encode(),
            "root_path": "",
            "query_string": query.encode(),
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", media.encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await client.app(scope, receive, send)
        gone.set()

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        client.portal.call(call)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return state["status"], state["bytes"], peak


def test_a_long_replay_is_streamed_from_the_journal(client):
    journal = (client.app.state.store.folder(RUN) / "events.jsonl").stat().st_size
    status, sent, peak = _peak_of(client, f"/v1/runs/{RUN}/events?since=0")
    assert status == 200 and sent > journal  # every event went out, framed
    assert peak < journal / 8, (peak, journal)  # was about 3.4 times the journal


def test_a_metrics_query_reads_no_more_of_the_journal_than_it_answers(client):
    journal = (client.app.state.store.folder(RUN) / "events.jsonl").stat().st_size
    status, sent, peak = _peak_of(client, f"/v1/runs/{RUN}/metrics?since=0&limit=10")
    assert status == 200 and 0 < sent < 10_000
    assert peak < journal / 4, (peak, journal)
    page = client.get(f"/v1/runs/{RUN}/metrics", params={"since": 19_000, "limit": 1000}).json()
    assert [m["seq"] for m in page["metrics"]] == list(range(19_001, EVENTS, 2))
    assert page["next_since"] == EVENTS - 1


def test_event_streams_have_a_limit_of_their_own():
    """Two streams open at max_concurrent_requests = 2: a third is 429, an ordinary request
    still goes through, and a stream that ends frees its place."""

    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            if scope["path"].endswith("/events"):
                await release.wait()  # a stream lasts as long as its client
            await send({"type": "http.response.body", "body": b"ok"})

        guard = Guard(app, token=None, max_body=1024, timeout=5.0, redact=False, max_concurrent=2)

        async def status(path: str) -> int:
            got = []

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                if message["type"] == "http.response.start":
                    got.append(message["status"])

            scope = {"type": "http", "path": path, "method": "GET", "query_string": b""}
            await guard({**scope, "headers": [(b"host", b"127.0.0.1")]}, receive, send)
            return got[0]

        open_ = [asyncio.create_task(status(p)) for p in ("/v1/events", f"/v1/runs/{RUN}/events")]
        await asyncio.sleep(0.05)
        try:  # admitted, the third would wait for `release` as the others do
            third = await asyncio.wait_for(status("/v1/events"), 2.0)
        except TimeoutError:
            third = "admitted"
        ordinary = await status("/v1/runs")
        release.set()
        first_two = await asyncio.gather(*open_)
        again = await status("/v1/events")
        return third, ordinary, first_two, again

    third, ordinary, first_two, again = asyncio.run(scenario())
    assert third == 429 and ordinary == 200 and first_two == [200, 200] and again == 200


def _many_keys(media: str) -> str:
    if media == "application/toml":
        head = '[run]\nalgorithm = "sft"\n[model]\npath = "m.gguf"\n[sft]\ndata = "d"\n[training]\n'
        return head + "".join(f"{i:x}=1\n" for i in range(100_000))
    config = {"run": {"algorithm": "sft"}, "model": {"path": "m.gguf"}, "sft": {"data": "d"}}
    keys = {f"{i:x}": 1 for i in range(100_000)}
    return json.dumps({"config": config | {"training": keys}}, separators=(",", ":"))


@pytest.mark.parametrize("media", ["application/json", "application/toml"])
def test_a_body_of_many_unknown_keys_answers_a_hundred_problems(client, media):
    """A 1 MiB body of 100,000 unknown keys answered 3.8 MB of errors."""
    body = _many_keys(media)
    assert len(body) < 1 << 20
    r = client.post("/v1/runs?dry_run=true", content=body.encode(), headers={"Content-Type": media})
    assert r.status_code == 422 and len(r.content) < 64 * 1024, (r.status_code, len(r.content))
    doc = r.json()
    assert len(doc["errors"]) == 101 and doc["detail"].endswith("and 99900 more problems")
    assert doc["errors"][0]["code"] == "unknown_field"


@pytest.mark.parametrize("media", ["application/x-ndjson", "text/plain"])
def test_an_upload_is_spooled_to_disk_and_checked_a_line_at_a_time(client, media):
    """A dataset upload was read whole, decoded whole and parsed whole: a 200 MiB upload
    peaked 1.5 GB over the process's size (8 GB for the 1 GiB max_dataset_bytes)."""
    line = {"messages": [{"role": "user", "content": "hi " * 40}, {"role": "assistant"}]}
    line["messages"][1]["content"] = f"{media} " * 10
    text = json.dumps(line) + "\n"
    body = (text * (16 * 2**20 // len(text))).encode()
    name = "big-" + media.split("/")[1]
    status, _, peak = _peak_of(client, f"/v1/datasets?name={name}", body, media)
    assert status == 201 and peak < 2 * 2**20, (status, peak)  # was 7 times the upload
    (view,) = [v for v in client.get("/v1/datasets").json()["datasets"] if v["name"] == name]
    assert view["bytes"] == len(body) and view["examples"] == len(body) // len(text)
    assert view["id"] == "ds_" + hashlib.sha256(body).hexdigest()
    assert not [p for p in client.app.state.datasets.root.iterdir() if p.name.startswith(".")]


def test_a_preview_reads_no_more_of_the_dataset_than_it_shows(client):
    """The preview of 2 examples read and parsed the whole dataset (in the server's loop)."""
    text = json.dumps({"messages": [{"role": "user", "content": "preview " * 40}]}) + "\n"
    body = (text * (8 * 2**20 // len(text))).encode()
    lines = {"Content-Type": "application/x-ndjson"}
    dataset = client.post("/v1/datasets", content=body, headers=lines).json()["id"]
    status, sent, peak = _peak_of(client, f"/v1/datasets/{dataset}/preview?limit=2")
    assert status == 200 and sent < 4096 and peak < 2**20, (status, sent, peak)
    shown = client.get(f"/v1/datasets/{dataset}/preview", params={"limit": 2}).json()
    assert shown["examples"] == [json.loads(text)] * 2
