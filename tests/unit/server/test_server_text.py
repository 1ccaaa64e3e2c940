"""Text a client, a model or a file name puts in the run server's records: a lone surrogate (a
`\\ud800` escape in a JSON body, a file name's undecodable byte) and a NUL.

A body holding a lone surrogate is refused naming its place (problem+json, OpenAI's error on
the OpenAI route): no template, tokenizer or run file takes it. What reaches the server's own
files anyway (events a run's process reports, a run's record) is written as UTF-8 that reads
back to the same string, and streamed as frames that encode; a NUL is text, kept as it was.
"""

from __future__ import annotations

import json

import pytest

from retrograd.server.events import frame
from retrograd.server.store import EventLog, RunRecord, RunStore, now_ms
from tests.unit.server import test_server_depth as depth

client = depth.client  # the depth tests' server, a completed run RUN on it
RUN = depth.RUN

HOSTILE = ["\ud800", "a\udfffb", "\udcff.gguf", "a\x00b", "\x00"]
JSON, JSONL = "application/json", "application/x-ndjson"
SURROGATE = '"a\\ud800"'  # as a client sends it: an escape, valid JSON
CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}'
BAD_CHAT = CHAT.replace('"ho"', SURROGATE)


def _run_body(**replace: str) -> str:
    config = {"run": {"algorithm": "sft"}, "model": {"path": "m.gguf"}, "sft": {"data": "d"}}
    text = json.dumps({"config": config, "name": "n"})
    for old, new in replace.items():
        text = text.replace(f'"{old}"', new)
    return text


REFUSED = [
    ("POST", "/v1/runs", JSON, _run_body(n=SURROGATE), "/name"),
    ("POST", "/v1/runs?dry_run=true", JSON, _run_body(d=SURROGATE), "/config/sft/data"),
    ("POST", "/v1/plan", JSON, _run_body(d=SURROGATE), "/config/sft/data"),
    ("POST", "/v1/datasets", JSON, "[" + CHAT + ", " + BAD_CHAT + "]", "/1/messages/1/content"),
    ("POST", "/v1/datasets", JSONL, CHAT + "\n" + BAD_CHAT + "\n", "/line/2/messages/1/content"),
    ("POST", "/v1/preflight", JSON, '{"model": ' + SURROGATE + "}", "/model"),
    ("POST", f"/v1/runs/{RUN}/generate", JSON, '{"prompt": ' + SURROGATE + "}", "/prompt"),
    ("PATCH", f"/v1/runs/{RUN}", JSON, '{"training": {"lr": ' + SURROGATE + "}}", "/training/lr"),
]


@pytest.mark.parametrize(("method", "path", "media", "body", "where"), REFUSED)
def test_a_body_holding_a_lone_surrogate_is_refused_naming_its_place(
    client, method, path, media, body, where
):
    doc = depth.invalid_request(client, method, path, media, body)
    assert "lone surrogate" in doc["detail"]
    assert [e["pointer"] for e in doc["errors"]] == [where], doc


def test_the_openai_route_refuses_a_lone_surrogate_in_its_own_error_shape(client):
    body = '{"model": "' + RUN + '", "messages": [{"role": "user", "content": ' + SURROGATE + "}]}"
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": JSON})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "lone surrogate" in error["message"]


def test_a_dataset_holding_a_nul_is_stored_as_utf8(client, tmp_path):
    nul = CHAT.replace('"ho"', '"h\\u0000o"')
    r = client.post("/v1/datasets", content="[" + nul + "]", headers={"Content-Type": JSON})
    assert r.status_code == 201, r.text[:300]
    lines = client.get(f"/v1/datasets/{r.json()['id']}/preview").text
    assert "h\\u0000o" in lines or "h\x00o" in json.dumps(json.loads(lines))


# Line breaks to str.splitlines() that JSON keeps raw inside a string (json_dumps, collect).
BREAKS = ["\u2028", "\u2029", "\x85"]  # json.dumps escapes the C0 ones (\\x0b, \\x1c, ...)


@pytest.mark.parametrize("media", [JSON, JSONL])
def test_a_dataset_whose_text_holds_unicode_line_breaks_is_read_as_written(client, media):
    """What `retrograd collect` writes (json_dumps keeps U+2028 and the like raw) is one
    record a line: the server must not cut a record at them, at upload or when it reads the
    stored file back."""
    records = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": f"a{b}b"},
            ]
        }
        for b in BREAKS
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    assert all(len(line.splitlines()) == 2 for line in lines)  # each would be cut in two
    body = "[" + ", ".join(lines) + "]" if media == JSON else "\n".join(lines) + "\n"
    r = client.post("/v1/datasets", content=body.encode(), headers={"Content-Type": media})
    assert r.status_code in (200, 201), r.text[:300]  # 200: the other media stored it first
    assert r.json()["examples"] == len(BREAKS), r.json()
    preview = client.get(f"/v1/datasets/{r.json()['id']}/preview")
    assert preview.status_code == 200, preview.text[:300]
    shown = preview.json()
    shown = shown.get("examples", shown) if isinstance(shown, dict) else shown
    assert shown[: len(records)] == records


@pytest.mark.parametrize("text", HOSTILE)
def test_the_event_log_writes_utf8_that_reads_back_the_same(tmp_path, text):
    log = EventLog(tmp_path / "events.jsonl")
    log.append("note", {"message": text, "sample": {text: [text]}})
    log.append("status", {"status": "running"})  # the writer goes on
    raw = (tmp_path / "events.jsonl").read_bytes()
    raw.decode("utf-8")  # strict: no lone surrogate reached the file
    assert raw.count(b"\n") == 2
    again = EventLog(tmp_path / "events.jsonl")
    assert [e["type"] for e in again.since(0)] == ["note", "status"] and again.seq == 2
    note = again.since(0)[0]
    assert note["message"] == text and note["sample"] == {text: [text]}


@pytest.mark.parametrize("text", HOSTILE)
def test_a_runs_record_writes_utf8_that_reads_back_the_same(tmp_path, text):
    store = RunStore(tmp_path)
    record = RunRecord(
        id=RUN, name=text, status="queued", algorithm="sft", model=text, created_at=now_ms()
    )
    store.add(record)
    store.transition(record, "failed", error=f"{text}: no such file")
    (tmp_path / RUN / "run.json").read_bytes().decode("utf-8")
    again = RunStore(tmp_path)
    again.load()
    back = again.runs[RUN]
    assert (back.name, back.model, back.error) == (text, text, f"{text}: no such file")


@pytest.mark.parametrize("text", HOSTILE)
def test_an_event_frame_encodes_and_reads_back_the_same(text):
    sse = frame({"seq": 1, "type": "note", "message": text})
    data = sse.encode("utf-8").decode("utf-8").split("data: ", 1)[1]
    assert json.loads(data)["message"] == text


def test_a_record_holding_a_lone_surrogate_is_answered_as_utf8(client):
    # a run's error naming a file whose name is not UTF-8 (Python decodes its bytes to lone
    # surrogates: os.fsdecode), as a run's process reports it
    run = "run_00000000000a1b2c4"
    record = RunRecord(
        id=run, name=None, status="queued", algorithm="sft", model="m", created_at=now_ms()
    )
    store = client.app.state.store
    with store.lock:
        store.add(record)
        store.transition(record, "failed", error="data/\udcff.jsonl: no such file")
    for path in (f"/v1/runs/{run}", "/v1/runs"):
        r = client.get(path)
        assert r.status_code == 200, r.text[:300]
        r.content.decode("utf-8")
        assert "data/\udcff.jsonl: no such file" in json.dumps(r.json(), ensure_ascii=False)


U_D800 = b"\xed\xa0\x80"  # U+D800 as UTF-8 would write it: Python's JSON reader takes it


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        ("/v1/preflight", b'{"model": "a' + U_D800 + b'"}', "/model"),
        ("/v1/runs?dry_run=true", b'{"config": {}, "name": "' + U_D800 + b'"}', "/name"),
    ],
)
def test_a_lone_surrogate_sent_as_bytes_is_refused_too(client, path, body, where):
    r = client.post(path, content=body, headers={"Content-Type": JSON})
    assert r.status_code == 422, r.text[:300]
    assert [e["pointer"] for e in r.json()["errors"]] == [where], r.text[:300]
