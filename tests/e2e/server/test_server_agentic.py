"""retrograd-server end to end: runs whose programs, judges, MCP servers and environments are
the operator's, named by id from the server's catalogue; evaluated while they train."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.server.test_server_runs import wait_for
from tests.e2e.test_train_agent import JUDGE
from tests.e2e.test_train_grpo import PROMPTS, REWARD
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.mcp_server import stdio_command
from tests.factories.run_server import RunServer, grpo_document
from tests.factories.tiny_gguf import write_tiny


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server whose catalogue declares a reward, a command judge, an MCP server (the test
    one, over stdio) and a local environment; and the tiny chat model."""
    tmp = tmp_path_factory.mktemp("agentic")
    model = write_tiny(tmp / "tiny.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "judge.py").write_text(JUDGE)
    py = json.dumps(sys.executable)
    catalogue = f"""
[[reward]]
id = "letters"
command = [{py}, "{tmp / "reward.py"}"]
[[judge]]
id = "letters-judge"
type = "command"
command = [{py}, "{tmp / "judge.py"}"]
[[mcp_server]]
id = "calc"
command = {json.dumps(stdio_command())}
stateless = true
allowed_tools = ["add"]
[[environment]]
id = "sandbox"
type = "local"
allow_unsandboxed = true
[environment.tools]
default = "mini"
[environment.tools.toolset.mini]
tools = ["write_file"]
"""
    with RunServer(tmp / "state", toml=catalogue) as server:
        yield server, model, tmp


def start(client, document: dict) -> dict:
    r = client.post("/runs", json={"config": document})
    assert r.status_code == 201, r.text
    return r.json()


def test_grpo_with_a_catalogue_reward_and_judge_followed_to_its_end_and_evaluated(served):
    server, model, tmp = served
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    document = grpo_document(
        model,
        tmp / "prompts.jsonl",
        {"reward": {"id": "letters"}, "judge": {"id": "letters-judge"}, "judge_weight": 0.5},
        training={"lr": 0.02, "ctx": 64, "micro_batch": 64},
        evaluation={"data": str(tmp / "prompts.jsonl"), "every_iterations": 1000},
    )
    with server.client() as c:
        run = start(c, document)
        judge = run["effective_config"]["grpo"]["judge"]
        assert judge["type"] == "command" and judge["command"][-1].endswith("judge.py")
        assert run["provenance"]["grpo.judge"]["reason"] == "[[judge]] letters-judge"
        c.post(f"/runs/{run['id']}/pause")  # while it starts: held after its first update
        wait_for(server.events(run["id"]), "status", status="paused")
        measured = c.post(f"/runs/{run['id']}/evaluate").json()  # asked while paused
        assert (measured["examples"], measured["iteration"]) == (len(PROMPTS), 1)
        low, mean, high = (measured[k] for k in ("reward_min", "mean_reward", "reward_max"))
        assert 0 <= low <= mean <= high <= 1 and 0 <= measured["accuracy"] <= 1
        assert c.post(f"/runs/{run['id']}/resume").status_code == 202
        events = list(server.events(run["id"], since=0))  # all of it, to its terminal event
    seqs = [data["seq"] for _, data in events]
    assert seqs == list(range(1, len(seqs) + 1))  # gapless from 1
    statuses = [data["status"] for kind, data in events if kind == "status"]
    assert statuses[:2] == ["queued", "starting"] and statuses[-1] == "completed"
    assert statuses.index("paused") < statuses.index("running", statuses.index("paused"))
    assert events[-1] == ("terminal", {**events[-1][1], "status": "completed"})
    progress = [data for kind, data in events if kind == "progress"]
    assert [p["iteration"] for p in progress] == [1, 2] and progress[-1]["iterations"] == 2
    assert [k for k, d in events].count("evaluation") == 1  # its own, after the last update


def test_agent_grpo_with_a_catalogue_mcp_server_and_environment_trains_and_evaluates(served):
    server, model, tmp = served
    scenarios = [
        {
            "id": f"file-{i}",
            "user": f"write {i} into answer.txt",
            "metadata": {"env": {"verify": {"command": ["grep", "-qx", str(i), "answer.txt"]}}},
        }
        for i in range(4)
    ]
    (tmp / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
    document = {
        "run": {"algorithm": "agent_grpo"},
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]},
        "training": {"lr": 0.02, "ctx": 512, "micro_batch": 512},
        "agent": {
            "scenarios": str(tmp / "scenarios.jsonl"),
            "updates": 100,
            "scenarios_per_update": 2,
            "group_size": 2,
            "epochs_per_update": 1,
            "max_turns": 2,
            "max_new_tokens_per_turn": 16,
            # a random tiny model rarely ends a turn: its cut trajectories train at the
            # group's lowest reward rather than stop the run
            "truncation": "min_reward",
            "max_dropped_fraction": 1.0,
            "skip_empty_updates": True,
            "mcp_servers": [{"id": "calc"}],
            "environment": {"id": "sandbox"},
        },
        "evaluation": {"data": str(tmp / "scenarios.jsonl"), "every_iterations": 1000},
    }
    with server.client() as c:
        run = start(c, document)
        agent = run["effective_config"]["agent"]
        assert agent["environment"]["type"] == "local"
        [mcp] = agent["mcp_servers"]
        assert mcp["name"] == "calc" and mcp["allowed_tools"] == ["add"]
        events = server.events(run["id"])
        first = wait_for(events, "progress")  # its first update, rolled out and trained
        assert first["iteration"] == 1 and "reward" in first
        measured = c.post(f"/runs/{run['id']}/evaluate").json()  # one trajectory a scenario
        assert measured["examples"] == 4 and 0 <= measured["accuracy"] <= 1
        assert measured["reward_min"] <= measured["mean_reward"] <= measured["reward_max"]
        assert c.post(f"/runs/{run['id']}/cancel", json={"at": "now"}).status_code == 202
        assert wait_for(events, "terminal")["status"] == "cancelled"
