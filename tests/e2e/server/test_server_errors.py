"""Every problem type the server answers today, each produced by a real request to a real
server (token, path roots, a small body limit, a catalogue), and path escapes refused.

formats.md §9.2's types and the test that produces each (insufficient-memory: test_server_plans
and test_server_recipes; device-busy, an OpenAI-route error: test_server_limits):
unauthorized (test_bearer_token_guards_everything_under_v1), method-not-allowed,
unsupported-media-type (test_routes_methods_media_and_sizes; not-implemented: no route answers
it now),
payload-too-large (there and test_datasets_...), timeout (test_slow_requests_...),
invalid-request (test_invalid_documents_...), server-declared and unknown-catalog-id
(test_server_declared_fields_and_catalogue_ids), forbidden-path (test_paths_outside_the_roots_...,
test_path_escapes_...), not-found and conflict (test_conflicts_patch_whitelist_...), internal
(test_an_unexpected_failure_is_an_internal_problem).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket

import httpx
import pytest

from tests.factories.run_server import TEXT, RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    model = write_tiny(root / "tiny.gguf", "llama")
    (outside / "secret.txt").write_text("not yours")
    os.symlink(outside / "secret.txt", root / "link.txt")
    toml = f"""
path_roots = ["{root}"]
max_body_bytes = "64KiB"
request_timeout_seconds = 2
upload_idle_timeout_seconds = 1
max_datasets_bytes = "3KiB"
redact_error_paths = true
[[reward]]
id = "plurals"
description = "1 for the right plural"
command = ["python3", "reward.py"]
"""
    server = RunServer(tmp_path_factory.mktemp("srv") / "state", toml=toml, token=TOKEN).start()
    yield server, root, outside, model
    server.stop()


def problem(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == f"https://retrograd.dev/problems/{kind}" and doc["status"] == status
    assert doc["trace_id"] and doc["title"] and isinstance(doc["errors"], list)
    return doc


def codes(doc: dict) -> list[tuple[str, str]]:
    return [(e["pointer"], e["code"]) for e in doc["errors"]]


def test_bearer_token_guards_everything_under_v1(setup):
    server = setup[0]
    for token in (None, "wrong"):
        with server.client(token=token) as c:
            for method, path in (("GET", "/health"), ("GET", "/runs"), ("POST", "/runs")):
                r = c.request(method, path)
                problem(r, 401, "unauthorized")
                assert r.headers["www-authenticate"].startswith("Bearer")
    with server.client() as c:
        assert c.get("/health").json()["status"] == "ok"
        rewards = c.get("/rewards").json()["rewards"]
        assert rewards == [
            {"id": "plurals", "description": "1 for the right plural", "mode": "persistent"}
        ]  # never the command
        files = c.get("/model-files", params={"refresh": "true"}).json()["files"]
        assert [(f["name"], f["role"], f["architecture"]) for f in files] == [
            ("tiny-llama", "model", "llama")  # general.name
        ]
        assert files[0]["path"] == str(setup[3]) and files[0]["bytes"] == setup[3].stat().st_size
        derived = {d["path"] for d in c.get("/defaults").json()["derived"]}
        assert {"output.path", "checkpoint"} <= derived
        schema = c.get("/config-schema").json()
        grpo = schema["$defs"]["GrpoSection"]["properties"]
        assert grpo["reward_command"]["x-retrograd-server-declared"] is True
        assert schema["$defs"]["TrainingSection"]["properties"]["lr"]["x-retrograd-patchable"]


def test_routes_methods_media_and_sizes(setup):
    server, root, _, model = setup
    with server.client() as c:
        problem(c.get("/runs/run_nope"), 404, "not-found")
        problem(c.get("/nothing-here"), 404, "not-found")
        problem(c.delete("/health"), 405, "method-not-allowed")
        problem(c.post("/runs", content="x", headers={"Content-Type": "text/plain"}), 415,
                "unsupported-media-type")  # fmt: skip
        big = "#" * (70 << 10)
        problem(c.post("/runs", content=big, headers={"Content-Type": "application/toml"}), 413,
                "payload-too-large")  # fmt: skip

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(70):
                yield b"#" * 1024

        r = c.post("/runs", content=chunks(), headers={"Content-Type": "application/toml"})
        problem(r, 413, "payload-too-large")


def stalled(server, path: str, media: str) -> tuple[bytes, dict]:
    """A POST whose body stops after one byte: the status line and the problem it got."""
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as raw:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: {media}\r\n"
            "Content-Length: 100\r\n\r\n{"
        )
        raw.sendall(head.encode())  # then nothing: the body never completes
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = raw.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return status_line, json.loads(rest.split(b"\r\n\r\n", 1)[1])


def test_slow_requests_and_stalled_uploads_time_out(setup):
    server = setup[0]
    status, doc = stalled(server, "/v1/runs", "application/json")  # request_timeout_seconds
    assert b" 504 " in status and doc["type"].endswith("/timeout") and doc["errors"] == []
    status, doc = stalled(server, "/v1/datasets", "application/x-ndjson")  # upload idle
    assert b" 504 " in status and "sent nothing for 1 s" in doc["detail"]


def test_invalid_documents_name_the_place_and_the_closest_key(setup):
    server, root, _, model = setup
    good = sft_toml(model, root / "data.txt")
    with server.client() as c:
        doc = problem(c.post("/runs", json={"confg": {}}), 422, "invalid-request")
        assert doc["errors"][0] | {"message": ""} == {
            "pointer": "/confg",
            "code": "unknown_field",
            "hint": "config",
            "message": "",
        }
        bad = good.replace("[training]\nlr = 0.005", "[training]\nlrr = 0.005").replace(
            "[lora]", "[lroa]"
        )
        doc = problem(c.post("/runs", content=bad, headers={"Content-Type": "application/toml"}),
                      422, "invalid-request")  # fmt: skip
        found = {e["pointer"]: e for e in doc["errors"]}
        assert found["/training/lrr"]["code"] == "unknown_field"
        assert found["/training/lrr"]["hint"] == "lr"
        assert found["/lroa"]["hint"] == "lora"
        no_run = good.replace('[run]\nalgorithm = "sft"', "")
        r = c.post("/runs", json={"config": _toml_to_json(no_run)})
        assert ("/config/run", "missing_field") in codes(problem(r, 422, "invalid-request"))
        r = c.post("/runs", content="[run\n", headers={"Content-Type": "application/toml"})
        assert codes(problem(r, 422, "invalid-request")) == [("", "unsupported_format")]


def _toml_to_json(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


GRPO = """
[run]
algorithm = "grpo"
[model]
path = "{model}"
[grpo]
prompts = "{root}/prompts.jsonl"
updates = 1
prompts_per_update = 1
group_size = 2
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
[grpo.sampling]
temperature = 1.0
top_p = 1.0
max_new_tokens = 4
seed = 1
[lora]
rank = 2
"""


def test_server_declared_fields_and_catalogue_ids(setup):
    server, root, _, model = setup
    base = _toml_to_json(GRPO.format(model=model, root=root))
    with server.client() as c:
        declared = {**base, "grpo": {**base["grpo"], "reward_command": ["python3", "r.py"]}}
        doc = problem(c.post("/runs", json={"config": declared}), 422, "server-declared")
        assert codes(doc) == [("/config/grpo/reward_command", "server_declared")]
        unknown = {**base, "grpo": {**base["grpo"], "reward": {"id": "plural"}}}
        doc = problem(c.post("/runs", json={"config": unknown}), 422, "unknown-catalog-id")
        assert codes(doc) == [("/config/grpo/reward", "unknown_catalog_id")]
        (root / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        known = {**base, "grpo": {**base["grpo"], "reward": {"id": "plurals"}}}
        r = c.post("/runs", json={"config": known}, params={"dry_run": "true"})
        assert r.status_code == 200, r.text
        effective = r.json()["effective_config"]["grpo"]
        assert effective["reward_command"] == ["python3", "reward.py"]
        assert r.json()["provenance"]["grpo.reward_command"]["source"] == "derived"
        assert c.get("/runs").json()["runs"] == []  # a dry run creates nothing


def test_paths_outside_the_roots_are_refused_and_redacted(setup):
    server, root, outside, model = setup
    good = sft_toml(model, root / "data.txt")
    escapes = {
        "absolute": str(outside / "secret.txt"),
        "dotdot": f"{root}/../{outside.name}/secret.txt",
        "symlink": str(root / "link.txt"),
    }
    with server.client() as c:
        for how, data in escapes.items():
            text = good.replace(f'data = "{root / "data.txt"}"', f'data = "{data}"')
            r = c.post("/runs", content=text, headers={"Content-Type": "application/toml"})
            doc = problem(r, 403, "forbidden-path")
            assert codes(doc) == [("/sft/data", "forbidden_path")], how
            assert str(outside) not in r.text and str(root) not in r.text, how  # redacted
            assert "<path>" in doc["errors"][0]["message"]
        text = good.replace("[sft]", f'[output]\npath = "{outside}/adapter.gguf"\n[sft]')
        r = c.post("/runs", content=text, headers={"Content-Type": "application/toml"})
        assert codes(problem(r, 403, "forbidden-path")) == [("/output/path", "forbidden_path")]


def test_conflicts_patch_whitelist_and_idempotency(setup):
    server, root, _, model = setup
    text = sft_toml(model, root / "data.txt", epochs=200)
    headers = {"Content-Type": "application/toml", "Idempotency-Key": "k1"}
    with server.client() as c, server.client() as watcher:
        with watcher.stream("GET", "/events") as merged:  # every run's live events
            first = c.post("/runs", content=text, headers=headers)
            assert first.status_code == 201
            rid = first.json()["id"]
            lines = merged.iter_lines()
            data = next(json.loads(x[6:]) for x in lines if x.startswith("data: "))
            assert (data["run"], data["type"], data["status"]) == (rid, "status", "queued")
        again = c.post("/runs", content=text, headers=headers)
        assert again.status_code == 200 and again.json()["id"] == rid

        # max_concurrent_runs = 1: a second run waits in the queue; cancelled there, it never starts
        queued = c.post("/runs", content=text, headers={"Content-Type": "application/toml"}).json()
        assert (queued["status"], queued["queue_position"]) == ("queued", 1)
        assert c.get(f"/runs/{rid}").json()["holds_device"] is True
        assert c.post(f"/runs/{queued['id']}/cancel", json={}).status_code == 202
        view = c.get(f"/runs/{queued['id']}").json()
        assert (view["status"], view["started_at"], view["queue_position"]) == (
            "cancelled",
            None,
            None,
        )
        capabilities = c.get("/capabilities").json()
        assert capabilities["features"]["max_concurrent_runs"] == 1
        assert capabilities["features"]["auth"] is True
        doc = problem(c.delete(f"/runs/{rid}"), 409, "conflict")  # still live
        assert codes(doc) == [("/id", "conflict")]
        r = c.patch(f"/runs/{rid}", json={"training": {"lr": 0.1, "epochs": 3}})
        assert codes(problem(r, 409, "conflict")) == [("/training/epochs", "override_conflict")]
        patched = c.patch(f"/runs/{rid}", json={"training": {"lr": 0.1}})  # at its next step
        assert patched.status_code == 200 and patched.json()["applied"] == ["training.lr"]
        assert c.get(f"/runs/{rid}").json()["effective_config"]["training"]["lr"] == 0.1
        r = c.patch(f"/runs/{rid}", json={"checkpoint": {"mode": "best_eval"}})
        doc = problem(r, 422, "invalid-request")  # best_eval needs [evaluation]
        assert "evaluation" in doc["detail"]
        assert codes(problem(c.post(f"/runs/{rid}/evaluate"), 409, "conflict")) == [
            ("/evaluation/data", "missing_field")
        ]  # no [evaluation]
        r = c.post(f"/runs/{rid}/cancel", json={"at": "now", "checkpoint": True})
        assert codes(problem(r, 422, "invalid-request")) == [("/checkpoint", "invalid_value")]
        assert c.post(f"/runs/{rid}/cancel", json={"at": "now"}).status_code == 202
        end = [d for k, d in server.events(rid) if k == "terminal"]
        assert end[0]["status"] == "cancelled"
        problem(c.post(f"/runs/{rid}/resume"), 409, "conflict")

        # a signed link downloads one artifact without the token; a forged one does not
        link = c.post(f"/runs/{rid}/artifacts/run/link").json()
        listed = c.get(f"/runs/{rid}/artifacts").json()["artifacts"]
        assert all("path" not in a for a in listed)  # redacted off loopback (here: forced)
        with server.client(token=None) as anonymous:
            got = anonymous.get(server.url.removesuffix("/v1") + link["href"])
            assert got.status_code == 200 and got.json()["id"] == rid
            forged = link["href"].replace("sig=", "sig=0")
            problem(anonymous.get(server.url.removesuffix("/v1") + forged), 401, "unauthorized")
            problem(anonymous.get(f"/runs/{rid}/artifacts/run"), 401, "unauthorized")
        problem(c.post(f"/runs/{rid}/artifacts/adapter/link"), 404, "not-found")  # none written
        assert c.delete(f"/runs/{rid}").status_code == 204


def test_missing_inputs_are_refused_and_a_run_that_fails_says_why(setup):
    server, root, _, model = setup
    good = sft_toml(model, root / "data.txt")
    with server.client() as c:
        text = good.replace(f'data = "{root / "data.txt"}"', f'data = "{root / "nope.txt"}"')
        r = c.post("/runs", content=text, headers={"Content-Type": "application/toml"})
        assert codes(problem(r, 422, "invalid-request")) == [("/sft/data", "path_not_found")]
        (root / "junk.gguf").write_bytes(b"GGUF but nothing more")  # refused by its plan
        text = good.replace(f'path = "{model}"', f'path = "{root / "junk.gguf"}"')
        r = c.post("/runs", content=text, headers={"Content-Type": "application/toml"})
        assert codes(problem(r, 422, "invalid-request")) == [("/model/path", "unsupported_format")]
        (root / "blank.txt").write_text("  \n")  # the plan warns; the run fails and says why
        text = good.replace(f'data = "{root / "data.txt"}"', f'data = "{root / "blank.txt"}"')
        run = c.post("/runs", content=text, headers={"Content-Type": "application/toml"}).json()
        assert [w["code"] for w in run["plan"]["warnings"]] == ["data_not_counted"]
        end = [d for k, d in server.events(run["id"]) if k == "terminal"][0]
        assert end["status"] == "failed" and "blank.txt" in end["error"]
        view = c.get(f"/runs/{run['id']}").json()
        assert view["status"] == "failed" and view["error"] == end["error"]
        assert c.delete(f"/runs/{run['id']}").status_code == 204


def test_datasets_by_content_preview_tokenize_and_use(setup):
    server, root, outside, model = setup
    chats = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    ndjson = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chats)
    lines = {"Content-Type": "application/x-ndjson"}
    with server.client() as c:
        r = c.post("/datasets", content=ndjson, headers=lines, params={"name": "tiny chats"})
        assert r.status_code == 201, r.text
        chat = r.json()
        assert (
            chat["id"] == "ds_" + chat["sha256"]
            and chat["sha256"] == hashlib.sha256(ndjson.encode()).hexdigest()
        )
        assert (chat["format"], chat["examples"], chat["name"]) == ("chat-jsonl", 2, "tiny chats")
        assert chat["stats"] == {"measured": False}
        again = c.post("/datasets", json=chats)  # the same records as a JSON array
        assert again.status_code == 200 and again.json()["id"] == chat["id"]

        text = c.post("/datasets", content=TEXT, headers={"Content-Type": "text/plain"}).json()
        assert (text["format"], text["examples"]) == ("text", 1)
        pair = {"prompt": chats[0]["messages"][:1], "chosen": chats[0]["messages"][1:],
                "rejected": chats[1]["messages"][1:]}  # fmt: skip
        r = c.post("/datasets", content=json.dumps(pair), headers=lines)
        doc = problem(r, 422, "invalid-request")
        assert codes(doc) == [("/0", "unsupported_format")] and "preference-jsonl" in r.text
        r = c.post("/datasets", content=json.dumps(pair), headers=lines,
                   params={"format": "preference-jsonl"})  # fmt: skip
        assert r.status_code == 201 and r.json()["format"] == "preference-jsonl"
        r = c.post("/datasets", content=ndjson + "{oops\n", headers=lines)
        assert codes(problem(r, 422, "invalid-request")) == [("/line/3", "unsupported_format")]
        problem(c.post("/datasets", content=b"x", headers={"Content-Type": "image/png"}), 415,
                "unsupported-media-type")  # fmt: skip

        listed = c.get("/datasets", params={"limit": 2}).json()
        assert len(listed["datasets"]) == 2 and listed["next_cursor"]
        rest = c.get("/datasets", params={"cursor": listed["next_cursor"]}).json()["datasets"]
        assert {d["id"] for d in listed["datasets"] + rest} >= {chat["id"], text["id"]}
        preview = c.get(f"/datasets/{chat['id']}/preview", params={"limit": 1}).json()
        assert preview["examples"] == chats[:1]

        measured = c.post(f"/datasets/{text['id']}/tokenize", json={"model": str(model)}).json()
        stats = measured["stats"]
        assert stats["measured"] and stats["total_tokens"] == stats["max"] > 100
        assert measured["truncation"]["128"] == 1.0 and measured["truncation"]["8192"] == 0.0
        assert c.get(f"/datasets/{text['id']}").json()["stats"] == stats
        r = c.post(f"/datasets/{chat['id']}/tokenize", json={"model": str(model)})
        assert "no chat template" in problem(r, 422, "invalid-request")["detail"]
        r = c.post(f"/datasets/{text['id']}/tokenize", json={"model": str(outside / "m.gguf")})
        assert codes(problem(r, 403, "forbidden-path")) == [("/model", "forbidden_path")]

        # a run names the dataset where its file goes
        toml = sft_toml(model, root / "data.txt").replace(
            f'data = "{root / "data.txt"}"', f'data = "{text["id"]}"'
        )
        r = c.post("/runs", content=toml, headers={"Content-Type": "application/toml"},
                   params={"dry_run": "true"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["effective_config"]["sft"]["data"].endswith(f"{text['id']}/data.txt")

        big = "a line of text that fills the store\n" * 70  # 2.5 KiB beside ~1 KiB stored
        r = c.post("/datasets", content=big, headers={"Content-Type": "text/plain"})
        assert problem(r, 413, "payload-too-large")["meta"]["max_datasets_bytes"] == 3072

        assert c.delete(f"/datasets/{chat['id']}").status_code == 204
        problem(c.get(f"/datasets/{chat['id']}"), 404, "not-found")


def test_path_escapes_are_refused_for_run_documents_datasets_and_model_files(setup):
    """`..`, a symlink in a root pointing outside it, and an absolute path outside the roots:
    refused wherever a request names a file (a run's model and data, a dataset's tokenizer
    model), and never listed among the model files."""
    server, root, outside, model = setup
    (outside / "m.gguf").write_bytes(model.read_bytes())
    os.symlink(outside / "m.gguf", root / "escape.gguf")
    escapes = {
        "absolute": str(outside / "m.gguf"),
        "dotdot": f"{root}/../{outside.name}/m.gguf",
        "symlink": str(root / "escape.gguf"),
    }
    good = sft_toml(model, root / "data.txt")
    with server.client() as c:
        text = c.post("/datasets", content="the cat\n", headers={"Content-Type": "text/plain"})
        assert text.status_code in (200, 201), text.text
        for how, path in escapes.items():
            run = good.replace(f'path = "{model}"', f'path = "{path}"')
            r = c.post("/runs", content=run, headers={"Content-Type": "application/toml"})
            assert codes(problem(r, 403, "forbidden-path")) == [("/model/path", "forbidden_path")]
            r = c.post(f"/datasets/{text.json()['id']}/tokenize", json={"model": path})
            assert codes(problem(r, 403, "forbidden-path")) == [("/model", "forbidden_path")], how
        files = c.get("/model-files", params={"refresh": "true"}).json()["files"]
        assert [f["path"] for f in files] == [str(model)]  # not the symlink's target


def test_an_unexpected_failure_is_an_internal_problem(setup):
    """A dataset whose file vanished from the state directory behind the server's back."""
    server, _, _, _ = setup
    with server.client() as c:
        r = c.post("/datasets", content="a dog\n", headers={"Content-Type": "text/plain"})
        assert r.status_code in (200, 201), r.text
        dataset = r.json()["id"]
        (server.state / "datasets" / dataset / "data.txt").unlink()
        doc = problem(c.get(f"/datasets/{dataset}/preview"), 500, "internal")
        assert doc["errors"] == [] and "FileNotFoundError" in doc["detail"]
        assert str(server.state) not in doc["detail"]  # paths redacted here
        assert c.delete(f"/datasets/{dataset}").status_code == 204
