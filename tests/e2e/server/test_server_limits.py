"""The server's limits over real requests: a served model's load refused (or made to wait)
while a run holds the device, the serving queue, and max_concurrent_requests."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.e2e.server.test_server_errors import problem
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

TOML = {"Content-Type": "application/toml"}
HELLO = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return write_tiny(path, "llama", chat_template=CHAT_TEMPLATE)


def chat(client: httpx.Client, model_id: str) -> httpx.Response:
    body = {"model": model_id, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    return client.post("/chat/completions", json=body)


def test_loads_wait_for_the_device_and_the_queue_is_bounded(model, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat. the dog sat on the log. ")  # a few steps a run
    toml = "[serving]\ndevice_wait_seconds = 2\nqueue = 1\n"
    with RunServer(tmp_path / "state", toml=toml) as server, server.client() as c:
        done = c.post("/runs", content=sft_toml(model, data), headers=TOML).json()
        assert list(server.events(done["id"]))[-1][1]["status"] == "completed"

        long = c.post("/runs", content=sft_toml(model, data, epochs=500), headers=TOML).json()
        events = server.events(long["id"])
        next(e for e in events if e[0] == "progress")
        view = c.get(f"/runs/{long['id']}").json()
        assert view["holds_device"] is True and view["queue_position"] is None
        queued = c.post("/runs", content=sft_toml(model, data), headers=TOML).json()
        assert queued["status"] == "queued" and queued["queue_position"] == 1
        assert queued["holds_device"] is False

        r = chat(c, f"{done['id']}@base")  # waits 2 s for the device, then is refused
        assert r.status_code == 503 and r.json()["error"]["code"] == "device-busy"
        assert r.headers["retry-after"] == "5"

        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(chat(c, f"{done['id']}@base")))
        waiting.start()  # this one waits while both runs are cancelled
        c.post(f"/runs/{queued['id']}/cancel", json={"at": "now"})
        c.post(f"/runs/{long['id']}/cancel", json={"at": "now"})
        waiting.join()
        assert answers[0].status_code == 200, answers[0].text

        # queue = 1: one answered, one waiting; the others are refused at once
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: results.append(chat(c, f"{done['id']}@final")))
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted(r.status_code for r in results)
        assert 200 in statuses and 503 in statuses, statuses
        refused = next(r for r in results if r.status_code == 503).json()["error"]
        assert refused["code"] == "queue_full"


def test_requests_past_max_concurrent_requests_are_refused(model, tmp_path):
    with RunServer(tmp_path / "state", toml="max_concurrent_requests = 1") as server:
        host, port = server.url.split("//")[1].split("/")[0].split(":")
        with server.client() as c, server.client() as stream:
            # an event stream is not counted
            with stream.stream("GET", "/events"):
                assert c.get("/health").status_code == 200
                # an upload that has sent half its body holds the one place
                upload = socket.create_connection((host, int(port)))
                upload.sendall(
                    b"POST /v1/datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                    b"Content-Length: 100\r\n\r\nthe cat"
                )
                doc = _until_refused(c)
                assert doc["status"] == 429 and doc["errors"] == []
                upload.sendall(b"x" * 93)
                assert upload.recv(100).startswith(b"HTTP/1.1 201")
                upload.close()
                assert c.get("/health").status_code == 200


def _until_refused(c: httpx.Client) -> dict:
    """The 429 once the upload's request has reached the server (it races the test)."""
    for _ in range(100):
        r = c.get("/health")
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            return problem(r, 429, "too-many-requests")
        threading.Event().wait(0.05)
    raise AssertionError("never refused")
