"""The keys of the server's catalogues stay the operator's: a run that references an MCP server
or an environment by id runs with its headers and environment, but no answer shows their
values to a client (the dry run and plan, the run's view, the `run` artifact).

The catalogue's listings never showed them; the resolved entries did: a POST /v1/plan naming
`{"id": "remote"}` answered the operator's bearer token in its effective config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from retrograd.server.app import create_app
from retrograd.server.config import load_server_config
from retrograd.server.documents import HIDDEN
from tests.factories.adapters import write_adapter
from tests.factories.agents import tiny_chat_model

SECRETS = ("opsecret", "mcpsecret", "envsecret")
CATALOGUE = """
[[mcp_server]]
id = "remote"
url = "http://127.0.0.1:9/mcp"
headers = { Authorization = "Bearer opsecret" }
required = false
stateless = true
[[mcp_server]]
id = "local"
command = ["python3", "x.py"]
env = { API_KEY = "mcpsecret" }
required = false
stateless = true
[[environment]]
id = "web"
type = "http"
base_url = "http://127.0.0.1:9"
headers = { Authorization = "Bearer envsecret" }
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secrets")
    model, _ = tiny_chat_model(tmp)
    (tmp / "s.jsonl").write_text('{"id": "a", "user": "hi"}\n{"id": "b", "user": "ho"}\n')
    (tmp / "server.toml").write_text(f'state_dir = "{tmp / "state"}"\n' + CATALOGUE)
    app = create_app(load_server_config(tmp / "server.toml", environ={}))
    app.state.runs.max_concurrent = 0  # the run stays queued: no process
    document = {
        "run": {"algorithm": "agent_grpo"},
        "model": {"path": str(model)},
        "lora": {"rank": 2},
        "training": {"ctx": 64},
        "agent": {
            "scenarios": str(tmp / "s.jsonl"),
            "scenarios_per_update": 1,
            "group_size": 2,
            "environment": {"id": "web"},
            "mcp_servers": [{"id": "remote"}, {"id": "local"}],
        },
    }
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        yield client, {"config": document}


def _no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, secret


def test_a_plan_and_a_dry_run_hide_the_catalogues_keys(served):
    client, body = served
    for route in ("/v1/plan", "/v1/runs?dry_run=true"):
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text[:300]
        _no_secret(r.text)
        agent = r.json()["effective_config"]["agent"]
        assert agent["environment"]["headers"] == {"Authorization": HIDDEN}
        remote, local = agent["mcp_servers"]
        assert remote["headers"] == {"Authorization": HIDDEN} and local["env"] == {
            "API_KEY": HIDDEN
        }
        assert remote["url"] == "http://127.0.0.1:9/mcp"  # what is not a key is shown


def test_a_runs_view_and_its_run_artifact_hide_them_and_the_run_keeps_them(served):
    client, body = served
    r = client.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text[:300]
    _no_secret(r.text)
    run_id = r.json()["id"]
    _no_secret(client.get(f"/v1/runs/{run_id}").text)
    download = client.get(f"/v1/runs/{run_id}/artifacts/run")
    assert download.status_code == 200
    _no_secret(download.text)
    shown = json.loads(download.text)
    assert shown["id"] == run_id and shown["document"]["agent"]["environment"]["headers"] == {
        "Authorization": HIDDEN
    }
    on_disk = (client.app.state.store.folder(run_id) / "run.json").read_text()
    for secret in SECRETS:  # the run's process reads them from there
        assert secret in on_disk


def test_a_fork_of_a_run_that_references_the_catalogue_references_it_too(served):
    # its document holds the entries resolved (the process runs them): sent back through the
    # server's checks as they were, they were the client's own, refused as server-declared
    client, body = served
    r = client.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text[:300]
    source = client.app.state.store.runs[r.json()["id"]]
    adapter = Path(source.effective_config["output"]["path"])
    adapter.parent.mkdir(parents=True, exist_ok=True)  # what the run would have exported:
    write_adapter(adapter, source.model, ["blk.0.attn_q.weight"], rank=2)
    forked = client.post("/v1/plan", json={"fork_from": {"run": source.id}})
    assert forked.status_code == 200, forked.text[:400]
    _no_secret(forked.text)
    agent = forked.json()["effective_config"]["agent"]
    assert agent["environment"]["base_url"] == "http://127.0.0.1:9"
    assert [s["name"] for s in agent["mcp_servers"]] == ["remote", "local"]
    provenance = forked.json()["provenance"]
    assert provenance["agent.environment"]["reason"] == "[[environment]] web"
