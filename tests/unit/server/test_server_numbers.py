"""Numbers a client writes that no JSON answer carries: NaN, an infinity (`Infinity`, `1e999`,
TOML's `inf`), and integers of more digits than Python converts (4300).

Python's JSON reader takes `NaN`, `Infinity` and `1e999` (an infinity), and the run file's
floats took them too: a run created with `lr = 1e999` was stored, then every answer showing it
(the create itself, `GET /v1/runs/ID`, a dataset's preview) was a 500, as JSON answers hold no
infinity. An integer of 5,000 digits ended the request in a 500 ValueError. Each is refused
naming its place, before anything stores it.
"""

from __future__ import annotations

import json

import pytest

from tests.unit.server import test_server_depth as depth

client = depth.client  # the depth tests' server, a completed run RUN on it
RUN = depth.RUN

JSON, TOML, JSONL = "application/json", "application/toml", "application/x-ndjson"
CHAT = depth.CHAT
HUGE = "9" * 5000  # past sys.get_int_max_str_digits()


def _run_body(**replace: str) -> str:
    config = {
        "run": {"algorithm": "sft"},
        "model": {"path": "m.gguf"},
        "sft": {"data": "d"},
        "training": {"lr": "LR"},
    }
    text = json.dumps({"config": config, "params": {"training": {"max_grad_norm": "NORM"}}})
    for old, new in replace.items():
        text = text.replace(f'"{old}"', new)
    return text


TOML_RUN = '[run]\nalgorithm = "sft"\n[model]\npath = "m.gguf"\n[training]\nlr = LR\n'

NOT_FINITE = [
    ("POST", "/v1/runs", JSON, _run_body(LR="1e999", NORM="1"), "/config/training/lr"),
    ("POST", "/v1/runs?dry_run=true", JSON, _run_body(LR="NaN", NORM="1"), "/config/training/lr"),
    (
        "POST",
        "/v1/plan",
        JSON,
        _run_body(LR="0.1", NORM="Infinity"),
        "/params/training/max_grad_norm",
    ),
    (
        "POST",
        "/v1/plan",
        JSON,
        _run_body(LR="0.1", NORM="-1e400"),
        "/params/training/max_grad_norm",
    ),
    ("POST", "/v1/plan", TOML, TOML_RUN.replace("LR", "inf"), "/training/lr"),
    ("POST", "/v1/runs", TOML, TOML_RUN.replace("LR", "nan"), "/training/lr"),
    ("PATCH", f"/v1/runs/{RUN}", JSON, '{"training": {"lr": 1e999}}', "/training/lr"),
    ("POST", "/v1/datasets", JSONL, CHAT + "\n" + CHAT[:-1] + ', "w": NaN}\n', "/line/2/w"),
    ("POST", "/v1/datasets", JSON, "[" + CHAT[:-1] + ', "w": [-Infinity]}]', "/0/w/0"),
    ("POST", f"/v1/runs/{RUN}/generate", JSON, '{"prompt": "a", "top_p": 1e999}', "/top_p"),
]


@pytest.mark.parametrize(("method", "path", "media", "body", "where"), NOT_FINITE)
def test_a_number_json_cannot_carry_is_refused_naming_its_place(
    client, method, path, media, body, where
):
    before = set(client.app.state.store.runs)
    doc = depth.invalid_request(client, method, path, media, body)
    assert "not a finite number" in doc["detail"], doc["detail"]
    assert [(e["pointer"], e["code"]) for e in doc["errors"]] == [(where, "invalid_value")], doc
    assert set(client.app.state.store.runs) == before  # nothing was created


HUGE_INTS = [
    ("POST", "/v1/plan", JSON, _run_body(LR=HUGE, NORM="1")),
    ("POST", "/v1/runs", JSON, '{"name": ' + HUGE + "}"),
    ("POST", f"/v1/runs/{RUN}/cancel", JSON, '{"checkpoint": ' + HUGE + "}"),
    ("PATCH", f"/v1/runs/{RUN}", JSON, '{"training": {"lr": ' + HUGE + "}}"),
    ("POST", "/v1/datasets", JSONL, CHAT + "\n" + CHAT[:-1] + ', "w": ' + HUGE + "}\n"),
    ("POST", "/v1/datasets", JSON, "[" + CHAT[:-1] + ', "w": ' + HUGE + "}]"),
    ("POST", "/v1/plan", TOML, TOML_RUN.replace("LR", HUGE)),
]


@pytest.mark.parametrize(("method", "path", "media", "body"), HUGE_INTS)
def test_an_integer_of_more_digits_than_python_converts_is_malformed(
    client, method, path, media, body
):
    doc = depth.invalid_request(client, method, path, media, body)
    assert "digits" in doc["detail"], doc["detail"]
    assert [e["code"] for e in doc["errors"]] == ["unsupported_format"], doc


def test_the_openai_route_refuses_them_in_its_own_error_shape(client):
    for number in (HUGE,):
        body = '{"model": "' + RUN + '", "seed": ' + number + ', "messages": [{"role": "user"}]}'
        r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": JSON})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["code"] == "invalid_json" and "digits" in error["message"], error


def test_a_runs_value_that_is_not_finite_is_answered_as_null(client):
    # a run's process reports NaN (eval/loss of a held-out set without a trained token) or an
    # infinity (a perplexity past a float): the run's view, the runs' listing and its metrics
    # were a 500 from then on, and its event frames were not JSON
    from types import SimpleNamespace

    from retrograd.server.runner import Live
    from retrograd.server.store import RunRecord, now_ms

    app = client.app
    run = "run_00000000000a1b2c5"
    record = RunRecord(
        id=run, name=None, status="running", algorithm="sft", model="m", created_at=now_ms()
    )
    lines = [
        '{"type": "evaluation", "global_step": 1, "values": {"eval/loss": NaN}, "improved": false}',
        '{"type": "progress", "iteration": 1, "global_step": 1, "train_loss": Infinity}',
        '{"type": "metrics", "iteration": 1, "global_step": 1, "values": {"x": -Infinity}}',
    ]
    process = SimpleNamespace(stdout=iter(line + "\n" for line in lines), wait=lambda: 0)
    with app.state.store.lock:
        app.state.store.add(record)
    live = Live(record, process)
    live.reported = "completed"
    app.state.runs._supervise(live)  # reads the lines as the process's supervisor does

    strict = {"parse_constant": lambda c: pytest.fail(f"{c} in an answer")}
    for path in (f"/v1/runs/{run}", "/v1/runs", f"/v1/runs/{run}/metrics"):
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:300])
        json.loads(r.text, **strict)
    view = client.get(f"/v1/runs/{run}").json()
    assert view["progress"].get("eval_loss") is None and view["progress"]["train_loss"] is None
    for event in app.state.store.logs[run].since(0):
        json.loads(json.dumps(event, allow_nan=False))  # every event is JSON
    events = client.get(f"/v1/runs/{run}/events").text
    assert "NaN" not in events and "Infinity" not in events


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ('{"prompt": "a", "temperature": true}', "/temperature"),
        ('{"prompt": "a", "max_new_tokens": "7"}', "/max_new_tokens"),
        ('{"prompt": "a", "chat": "no"}', "/chat"),
    ],
)
def test_generate_takes_its_types_strictly_as_serve_does(client, body, where):
    """A boolean is not 1.0 and "7" is not 7 (serve's own requests refuse them too)."""
    doc = depth.invalid_request(client, "POST", f"/v1/runs/{RUN}/generate", JSON, body)
    assert [e["pointer"] for e in doc["errors"]] == [where], doc
