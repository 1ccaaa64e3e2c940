"""Bodies nested too deep, on every route that reads one: refused before any recursive code
sees them, as problem+json naming the limit (OpenAI's error on the OpenAI route), never a 500.

100,000 levels overflow Python's own parsers (json, tomllib); 900 pass them and overflow what
reads the document next (merges, copies, validation); dotted TOML keys nest without brackets.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from retrograd.nesting import MAX_DEPTH
from retrograd.server.app import create_app
from retrograd.server.config import load_server_config
from retrograd.server.store import RunRecord, now_ms

RUN = "run_00000000000a1b2c3"
DEEP = "[" * 100_000 + "]" * 100_000
NINE_HUNDRED = "[" * 900 + "]" * 900
JSON, TOML, JSONL = "application/json", "application/toml", "application/x-ndjson"
CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}'


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("depth")
    config = load_server_config(overrides={"state_dir": str(tmp / "state")}, environ={})
    app = create_app(config)  # no token: it answers requests to a loopback name only
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        record = RunRecord(
            id=RUN, name=None, status="completed", algorithm="sft", model="m", created_at=now_ms()
        )
        with app.state.store.lock:
            app.state.store.add(record)
        yield client


def _valid_with_deep_params(deep: str) -> str:
    config = {"run": {"algorithm": "sft"}, "model": {"path": "m.gguf"}, "sft": {"data": "d"}}
    return json.dumps({"config": config, "params": {"training": {"lr": "PARAM"}}}).replace(
        '"PARAM"', deep
    )


REFUSED = [
    ("POST", "/v1/runs", JSON, '{"config": ' + DEEP + "}", ""),
    ("POST", "/v1/runs?dry_run=true", JSON, _valid_with_deep_params(NINE_HUNDRED), ""),
    ("POST", "/v1/runs", JSON, _valid_with_deep_params(NINE_HUNDRED), ""),
    ("POST", "/v1/runs", JSON, '{"params": ' + DEEP + "}", ""),
    ("POST", "/v1/plan", JSON, '{"config": ' + DEEP + "}", ""),
    ("POST", "/v1/plan", JSON, _valid_with_deep_params(NINE_HUNDRED), ""),
    ("POST", "/v1/plan", JSON, '{"recipe": {"model": "m", "x": ' + NINE_HUNDRED + "}}", ""),
    ("POST", "/v1/runs", TOML, '[run]\nalgorithm = "sft"\nx = ' + DEEP, ""),
    ("POST", "/v1/plan", TOML, "x = {a = " + "{a = " * 900 + "1" + "}" * 901, ""),
    ("POST", "/v1/plan", TOML, "x" + ".x" * 900 + " = 1", ""),
    ("POST", "/v1/datasets", JSON, DEEP, ""),
    ("POST", "/v1/datasets", JSON, "[" + CHAT + ", " + NINE_HUNDRED + "]", ""),
    ("POST", "/v1/datasets", JSONL, CHAT + "\n" + CHAT + "\n" + DEEP + "\n", "/line/3"),
    ("POST", "/v1/datasets", JSONL, CHAT + "\n" + NINE_HUNDRED + "\n", "/line/2"),
    ("POST", "/v1/preflight", JSON, '{"model": ' + DEEP + "}", ""),
    ("POST", "/v1/preflight", JSON, '{"model": "m", "targets": ' + NINE_HUNDRED + "}", ""),
    ("POST", f"/v1/runs/{RUN}/generate", JSON, '{"prompt": ' + DEEP + "}", ""),
    ("POST", f"/v1/runs/{RUN}/cancel", JSON, '{"at": ' + DEEP + "}", ""),
    ("POST", f"/v1/runs/{RUN}/evaluate", JSON, DEEP, ""),
    ("PATCH", f"/v1/runs/{RUN}", JSON, '{"training": ' + DEEP + "}", ""),
    ("POST", "/v1/datasets/ds_0/tokenize", JSON, '{"model": ' + DEEP + "}", ""),
]


def invalid_request(client, method: str, path: str, media: str, body: str) -> dict:
    """The problem document of a request the server refuses as invalid-request (422), with
    its trace id once, in the header as in the document."""
    r = client.request(method, path, content=body.encode(), headers={"Content-Type": media})
    assert r.status_code == 422, r.text[:300]
    assert r.headers["content-type"] == "application/problem+json"
    doc = r.json()
    assert doc["type"].endswith("/invalid-request")
    assert r.headers.get_list("trace-id") == [doc["trace_id"]]  # once
    return doc


@pytest.mark.parametrize(("method", "path", "media", "body", "where"), REFUSED)
def test_a_body_nested_too_deep_is_refused_naming_the_limit(
    client, method, path, media, body, where
):
    doc = invalid_request(client, method, path, media, body)
    assert f"nested more than {MAX_DEPTH} levels deep" in doc["detail"], doc["detail"]
    assert doc["meta"] == {"max_depth": MAX_DEPTH}
    assert [(e["pointer"], e["code"]) for e in doc["errors"]] == [(where, "unsupported_format")]


@pytest.mark.parametrize(
    "body",
    [
        '{"model": "' + RUN + '", "messages": ' + DEEP + "}",
        '{"model": "' + RUN + '", "messages": [{"role": "user", "content": ' + NINE_HUNDRED + "}]}",
    ],
)
def test_the_openai_route_answers_its_own_error_shape(client, body):
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": JSON})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert f"deeper than {MAX_DEPTH}" in error["message"]


def test_the_limit_itself_is_allowed(client):
    # 64 levels in all (the body's own object counts): read, then refused for what it says
    inner = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    for depth_of_config, nested in ((inner, False), ("[" + inner + "]", True)):
        r = client.post("/v1/plan", json=None, content='{"config": {"x": ' + depth_of_config + "}}")
        assert r.status_code == 422
        assert ("nested more than" in r.json()["detail"]) is nested, r.json()["detail"]


def test_a_recipes_data_line_nested_too_deep_names_the_line(client, tmp_path):
    # a file on the server's disk, read to fit the context: the same limit as a body's
    from tests.factories.agents import CHAT_TEMPLATE
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp_path / "tiny.gguf", "llama", chat_template=CHAT_TEMPLATE)
    data = tmp_path / "chat.jsonl"
    data.write_text(CHAT + "\n" + '{"messages": ' + DEEP + "}\n")
    recipe = {"model": str(model), "data": {"path": str(data)}, "objective": "instruction-tuning"}
    r = client.post("/v1/plan", json={"recipe": recipe})
    assert r.status_code == 422, r.text[:300]
    assert "chat.jsonl:2: not a chat-jsonl record (nested more than 64 levels deep" in r.text
