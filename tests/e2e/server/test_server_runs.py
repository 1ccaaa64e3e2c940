"""retrograd-server end to end: tiny SFT runs started over HTTP, followed over SSE, paused,
cancelled, and resumed after the server was killed; each against a real uvicorn on loopback."""

from __future__ import annotations

import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import TEXT, RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

TOML = {"Content-Type": "application/toml"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return write_tiny(path, "llama", chat_template=CHAT_TEMPLATE)


def start_run(client, toml: str, name: str | None = None) -> dict:
    response = client.post(
        "/runs", content=toml, headers=TOML, params={"name": name} if name else {}
    )
    assert response.status_code == 201, response.text
    return response.json()


def follow(server, run_id, **kw) -> list[tuple[str, dict]]:
    return list(server.events(run_id, **kw))


def test_sft_run_over_http_followed_to_the_end(model, tmp_path):
    with RunServer(tmp_path / "state") as server, server.client() as c:
        toml = sft_toml(model, tmp_path / "data.txt", text=TEXT[: len(TEXT) // 4])
        run = start_run(c, toml, name="first")
        assert run["status"] in ("queued", "starting") and run["name"] == "first"
        assert run["effective_config"]["checkpoint"]["directory"].endswith("checkpoints")
        events = follow(server, run["id"])
        seqs = [data["seq"] for _, data in events]
        assert seqs == list(range(1, len(seqs) + 1))  # gapless from 1
        kinds = [kind for kind, _ in events]
        assert kinds[-1] == "terminal" and events[-1][1]["status"] == "completed"
        statuses = [data["status"] for kind, data in events if kind == "status"]
        assert statuses == ["queued", "starting", "running", "completed"]
        progress = [data for kind, data in events if kind == "progress"]
        assert progress[-1]["global_step"] == len(progress) and "train_loss" in progress[-1]
        assert progress[-1]["iterations"] == 1

        view = c.get(f"/runs/{run['id']}").json()
        assert view["status"] == "completed" and view["progress"]["global_step"] == len(progress)
        assert view["started_at"] and view["finished_at"] and view["holds_device"] is False
        on_disk = json.loads((tmp_path / "state" / run["id"] / "run.json").read_text())
        assert on_disk["status"] == "completed"
        assert [t["status"] for t in on_disk["transitions"]] == statuses
        lines = (tmp_path / "state" / run["id"] / "events.jsonl").read_text().splitlines()
        assert [json.loads(line)["seq"] for line in lines] == seqs

        # replay: `since` and Last-Event-ID (which wins) give the tail, then the stream ends
        tail = follow(server, run["id"], since=len(seqs) - 3)
        assert [d["seq"] for _, d in tail] == seqs[-3:]
        tail = follow(server, run["id"], since=1, headers={"Last-Event-ID": str(len(seqs) - 1)})
        assert [d["seq"] for _, d in tail] == seqs[-1:]

        metrics = c.get(f"/runs/{run['id']}/metrics", params={"names": "train/loss"}).json()
        assert len(metrics["metrics"]) == len(progress)
        assert set(metrics["metrics"][0]["values"]) == {"train/loss"}
        page = c.get(
            f"/runs/{run['id']}/metrics", params={"since": metrics["next_since"], "limit": 5}
        ).json()
        assert page["metrics"] == [] and page["next_since"] == metrics["next_since"]

        adapter = c.get(f"/runs/{run['id']}/artifacts/adapter")
        assert adapter.status_code == 200 and adapter.content[:4] == b"GGUF"
        listed = {a["name"]: a for a in c.get(f"/runs/{run['id']}/artifacts").json()["artifacts"]}
        assert listed["adapter"]["bytes"] == len(adapter.content) and listed["events"]["present"]

        # the OpenAI routes answer with the run's adapter, or its base model
        api = openai.OpenAI(base_url=server.url, api_key="unused")
        ids = {m.id for m in api.models.list().data}
        assert {run["id"], f"{run['id']}@final", f"{run['id']}@base"} <= ids
        hello = [{"role": "user", "content": "the cat"}]
        for model_id in (f"{run['id']}@final", f"{run['id']}@base"):
            answer = api.chat.completions.create(
                model=model_id, messages=hello, max_tokens=4, temperature=0
            )
            assert answer.model == model_id and answer.usage.completion_tokens >= 1
        # both at once: one served model at a time, so the second waits for the first's answer
        # instead of unloading it mid-generation (greedy: the answers of one at a time)
        alone = {m: chat(api, m, hello) for m in (f"{run['id']}@final", f"{run['id']}@base")}
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda m: (m, chat(api, m, hello)), list(alone) * 2))
        assert all(text == alone[m] for m, text in together)
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model=f"{run['id']}@step-999", messages=hello)

        # the same run again, paused and asked to generate after its first step, trains the same
        second = start_run(c, toml, name="second")
        c.post(f"/runs/{second['id']}/pause")  # while it starts: it pauses after its first step
        events = server.events(second["id"])
        wait_for(events, "status", status="paused")
        asked = {"prompt": "the cat", "include_base": True, "max_new_tokens": 4}
        assert c.post(f"/runs/{second['id']}/generate", json=asked).status_code == 200
        c.post(f"/runs/{second['id']}/resume")
        assert wait_for(events, "terminal")["status"] == "completed"
        again = c.get(f"/runs/{second['id']}/artifacts/adapter").content
        assert again == adapter.content  # byte for byte
        runs = c.get("/runs", params={"limit": 1}).json()
        assert [r["id"] for r in runs["runs"]] == [second["id"]]  # newest first
        older = c.get("/runs", params={"limit": 1, "cursor": runs["next_cursor"]}).json()
        assert [r["id"] for r in older["runs"]] == [run["id"]] and "next_cursor" not in older
        assert c.get("/runs", params={"name": "first"}).json()["runs"][0]["id"] == run["id"]
        assert c.delete(f"/runs/{second['id']}").status_code == 204
        assert not (tmp_path / "state" / second["id"]).exists()
        assert c.get(f"/runs/{second['id']}").status_code == 404


def chat(api, model_id: str, messages) -> str:
    answer = api.with_options(timeout=120, max_retries=0).chat.completions.create(
        model=model_id, messages=messages, max_tokens=24, temperature=0
    )
    return answer.choices[0].message.content


def wait_for(events, kind: str, **match):
    for k, data in events:
        if k == kind and all(data.get(key) == value for key, value in match.items()):
            return data
    raise AssertionError(f"the stream ended before a {kind} event {match}")


def test_pause_checkpoint_resume_and_cancel_with_a_slow_client_connected(model, tmp_path):
    data = tmp_path / "data.txt"
    held = f'[evaluation]\ndata = "{data}"\nevery_iterations = 1000'  # for evaluate only
    toml = sft_toml(model, data, epochs=200, extra=held)  # far longer than the test
    with RunServer(tmp_path / "state") as server, server.client() as c:
        run = start_run(c, toml)
        rid = run["id"]
        # a client that opens the stream and never reads from it
        host, port = server.url.split("//")[1].split("/")[0].split(":")
        slow = socket.create_connection((host, int(port)))
        slow.sendall(f"GET /v1/runs/{rid}/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        events = server.events(rid)
        wait_for(events, "progress")
        assert c.post(f"/runs/{rid}/pause").json()["status"] == "pausing"
        wait_for(events, "status", status="paused")
        paused = c.get(f"/runs/{rid}").json()
        assert paused["status"] == "paused" and paused["holds_device"] is True
        step = paused["progress"]["global_step"]
        # a paused run answers with its weights as they are, and with its base model
        asked = {"prompt": "the cat", "include_base": True, "max_new_tokens": 4, "temperature": 0}
        answer = c.post(f"/runs/{rid}/generate", json=asked).json()
        assert (answer["id"], answer["global_step"]) == (rid, step)
        assert answer["tokens"] >= 1 and answer["prompt_tokens"] > 2
        assert isinstance(answer["text"], str) and isinstance(answer["base_text"], str)
        api = openai.OpenAI(base_url=server.url, api_key="unused")
        assert rid in {m.id for m in api.models.list().data}  # its live weights
        hello = [{"role": "user", "content": "the cat"}]
        live = api.chat.completions.create(model=rid, messages=hello, max_tokens=4, temperature=0)
        assert live.model == rid and live.usage.completion_tokens >= 1
        streamed = api.chat.completions.create(
            model=rid, messages=hello, max_tokens=4, temperature=0, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
        assert "".join(pieces) == live.choices[0].message.content  # greedy: the same answer
        measured = c.post(f"/runs/{rid}/evaluate").json()
        assert (measured["global_step"], measured["examples"]) == (step, 18)
        assert 0 < measured["loss"] < 20 and measured["perplexity"] > 1
        assert c.get(f"/runs/{rid}").json()["progress"]["global_step"] == step  # still paused

        # from the next boundary on, a checkpoint every 3 steps instead of 50; kept on disk
        patched = c.patch(f"/runs/{rid}", json={"checkpoint": {"every_steps": 3}}).json()
        assert patched["applied"] == ["checkpoint.every_steps"]
        assert patched["applies_at_iteration"] == paused["progress"]["iteration"]
        record = json.loads((tmp_path / "state" / rid / "run.json").read_text())
        assert record["document"]["checkpoint"]["every_steps"] == 3
        assert record["effective_config"]["checkpoint"]["every_steps"] == 3
        assert c.post(f"/runs/{rid}/resume").status_code == 202
        wait_for(events, "status", status="running")
        every = wait_for(events, "checkpoint")
        assert every["global_step"] % 3 == 0 and every["global_step"] <= step + 3
        assert (
            c.patch(f"/runs/{rid}", json={"checkpoint": {"every_steps": 1000}}).status_code == 200
        )
        assert c.post(f"/runs/{rid}/checkpoints").status_code == 202
        saved = wait_for(events, "checkpoint")
        assert saved["global_step"] > step
        listed = c.get(f"/runs/{rid}/checkpoints").json()
        ours = [x for x in listed["checkpoints"] if x["global_step"] == saved["global_step"]]
        assert ours and ours[0]["kind"] == "step" and ours[0]["complete"]
        assert listed["latest"] == listed["checkpoints"][0]["id"]

        # cancel at the next boundary, after a checkpoint
        answer = c.post(f"/runs/{rid}/cancel", json={"at": "boundary", "checkpoint": True})
        assert answer.status_code == 202 and answer.json()["status"] == "cancelling"
        last = wait_for(events, "checkpoint")
        assert last["global_step"] > saved["global_step"]
        end = wait_for(events, "terminal")
        assert end["status"] == "cancelled"
        view = c.get(f"/runs/{rid}").json()
        assert view["status"] == "cancelled" and view["holds_device"] is False
        assert view["progress"]["global_step"] < 200  # it stopped long before its end
        slow.close()

        # a cancelled run cannot be paused (conflict); a queued run cancelled never starts
        assert c.post(f"/runs/{rid}/pause").json()["type"].endswith("/conflict")
        late = c.post(f"/runs/{rid}/generate", json={"prompt": "the cat"})
        assert late.status_code == 409


def test_killed_server_restarts_marks_the_run_interrupted_and_resumes_it(model, tmp_path):
    extra = f'[checkpoint]\ndirectory = "{tmp_path / "ck"}"\nmode = "steps"\nevery_steps = 2'
    toml = sft_toml(model, tmp_path / "data.txt", extra=extra, text=TEXT[: len(TEXT) // 2])
    server = RunServer(tmp_path / "state").start()
    try:
        with server.client() as c:
            rid = start_run(c, toml)["id"]
            # held after its first step, with a checkpoint there: killed mid-run on any machine
            c.post(f"/runs/{rid}/pause")
            events = server.events(rid)
            wait_for(events, "status", status="paused")
            # a new rate (0.005 in the file), followed from here, kept across the restart
            patched = c.patch(f"/runs/{rid}", json={"training": {"lr": 0.01}}).json()
            assert patched["applied"] == ["training.lr"]
            assert wait_for(events, "log")["patched"] == {"training": {"lr": 0.01}}
            c.post(f"/runs/{rid}/checkpoints")
            wait_for(events, "checkpoint")
        server.kill()  # a crash: no shutdown, the run's process loses its server
        record = json.loads((server.state / rid / "run.json").read_text())
        assert record["patched"] == {"training": {"lr": 0.01}}
        assert record["effective_config"]["training"]["lr"] == 0.01

        server.start()
        with server.client() as c:
            view = c.get(f"/runs/{rid}").json()
            assert view["status"] == "interrupted" and view["holds_device"] is False
            seen = statuses_on_disk(server, rid)
            assert seen[-1] == ("status", "interrupted")
            assert c.post(f"/runs/{rid}/resume").status_code == 202
            done = list(server.events(rid, since=0))
        kinds = [(k, d.get("status")) for k, d in done]
        assert kinds[-1] == ("terminal", "completed")
        seqs = [d["seq"] for _, d in done]
        assert seqs == list(range(1, len(seqs) + 1))  # one journal across the restart
        at = next(
            i for i, (k, d) in enumerate(done) if k == "log" and "resumed from" in d["message"]
        )
        step = int(done[at][1]["message"].rsplit(" ", 1)[1])  # "... at step N"
        saved = [d["global_step"] for k, d in done[:at] if k == "checkpoint"]
        assert step >= saved[0]  # its latest checkpoint (one written just before the kill counts)
        after = next(d for k, d in done[at:] if k == "progress")
        assert after["global_step"] == step + 1  # it went on from there, not from the start
        assert after["learning_rate"] == 0.01  # at the patched rate from its first step
        assert (tmp_path / "state" / rid / "output" / "adapter.gguf").exists()
    finally:
        server.stop()


def statuses_on_disk(server, rid) -> list[tuple[str, str]]:
    """The statuses in a run's journal on disk."""
    lines = (server.state / rid / "events.jsonl").read_text().splitlines()
    return [(e["type"], e.get("status")) for e in map(json.loads, lines) if e["type"] == "status"]


def test_grpo_run_with_a_catalogue_reward_stops_at_shutdown_and_shows_its_rollouts(model, tmp_path):
    from tests.e2e.test_train_grpo import PROMPTS, REWARD

    (tmp_path / "reward.py").write_text(REWARD)
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    catalogue = (
        f'[[reward]]\nid = "letters"\ncommand = ["{sys.executable}", "{tmp_path / "reward.py"}"]\n'
    )
    document = {
        "run": {"algorithm": "grpo"},
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "ffn_down"]},
        "training": {"lr": 0.02, "ctx": 64, "micro_batch": 64},
        "grpo": {
            "prompts": str(tmp_path / "prompts.jsonl"),
            "reward": {"id": "letters"},  # the operator's program, referenced by id
            "updates": 100,  # far more than the test waits for
            "prompts_per_update": 2,
            "group_size": 4,
            "grpo_epochs": 1,
            "clip_range_low": 0.2,
            "clip_range_high": 0.28,
            "kl_coefficient": 0.0,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 3},
        },
        "observe": {"directory": str(tmp_path / "observe")},
    }
    server = RunServer(tmp_path / "state", toml=catalogue).start()
    with server.client() as c:
        r = c.post("/runs", json={"config": document, "name": "letters"})
        assert r.status_code == 201, r.text
        run = r.json()
        assert run["effective_config"]["grpo"]["reward_command"][-1].endswith("reward.py")
        assert run["provenance"]["grpo.reward_command"] == {
            "source": "derived",
            "reason": "[[reward]] letters",
        }
        events = server.events(run["id"])
        first = wait_for(events, "progress")
        assert first["iteration"] == 1 and first["iterations"] == 100 and 0 <= first["reward"] <= 1
        assert wait_for(events, "progress")["iteration"] == 2  # update 1 is recorded whole
        events.close()
        assert c.get(f"/runs/{run['id']}").json()["observed"] is True
    server.stop()  # SIGTERM: the live run checkpoints at its next boundary and stops
    folder = tmp_path / "state" / run["id"]
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"
    journal = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert journal[-2]["type"] == "checkpoint"
    assert (journal[-1]["type"], journal[-1]["status"]) == ("status", "interrupted")
    assert (tmp_path / "observe" / "observe.jsonl").exists()

    # its rollouts, read back by a new server from the [observe] feed
    with server, server.client() as c:  # started again on the same state
        rid = run["id"]
        seen = c.get(f"/runs/{rid}/trajectories").json()
        assert seen["observed"] and seen["algorithm"] == "grpo" and seen["every"] == 1
        one = next(u for u in seen["updates"] if u["update"] == 1)
        assert (one["status"], one["groups"], one["rollouts"], one["texts"]) == (
            "completed",
            2,
            8,
            True,
        )
        assert 0 <= one["reward_min"] <= one["reward_mean"] <= one["reward_max"] <= 1
        page = c.get(f"/runs/{rid}/trajectories/updates/1", params={"limit": 1}).json()
        assert len(page["groups"]) == 1 and page["next_cursor"] == "1"
        group = page["groups"][0]
        assert group["members"] == 4 and group["prompt"] in PROMPTS
        rest = c.get(f"/runs/{rid}/trajectories/updates/1", params={"cursor": 1}).json()
        assert len(rest["groups"]) == 1 and "next_cursor" not in rest
        detail = c.get(f"/runs/{rid}/trajectories/updates/1/groups/{group['group']}").json()
        assert detail["prompt"]["messages"][0]["content"] == group["prompt"]
        assert [m["summary"]["member"] for m in detail["members"]] == [0, 1, 2, 3]
        assert all(isinstance(m["completion"], str) for m in detail["members"])
        only = c.get(
            f"/runs/{rid}/trajectories/updates/1/groups/{group['group']}", params={"member": 2}
        ).json()
        assert [m["summary"]["member"] for m in only["members"]] == [2]
        missing = c.get(f"/runs/{rid}/trajectories/updates/999")
        assert missing.status_code == 404


def test_a_patched_evaluation_cadence_and_patience_are_followed(model, tmp_path):
    """PATCH of [evaluation] over HTTP: from one evaluation (the last epoch's) to one after each
    epoch, and patience 2 instead of 1. The rate is too small to move the loss (the adapter's
    B starts at zero), so the held-out loss repeats: the run stops after its third epoch."""
    data = tmp_path / "data.txt"
    data.write_text(TEXT[: len(TEXT) // 2])
    held = f'[evaluation]\ndata = "{data}"\nevery_iterations = 1000\npatience = 1'
    training = (
        'lr = 1e-20\nlr_scheduler = "constant"\nwarmup_steps = 0'  # ctx, micro_batch: 128, 32
    )
    toml = sft_toml(model, data, epochs=5, extra=held, training=training)
    with RunServer(tmp_path / "state") as server, server.client() as c:
        run = start_run(c, toml)
        rid = run["id"]
        assert run["effective_config"]["training"]["ctx"] == 128  # the reference's defaults
        assert run["effective_config"]["training"]["micro_batch"] == 32
        c.post(f"/runs/{rid}/pause")  # while it starts: it pauses after its first step
        events = server.events(rid)
        wait_for(events, "status", status="paused")
        patch = {"evaluation": {"every_iterations": 1, "patience": 2}}
        patched = c.patch(f"/runs/{rid}", json=patch)
        assert patched.status_code == 200, patched.text
        assert patched.json()["applied"] == ["evaluation.every_iterations", "evaluation.patience"]
        assert c.post(f"/runs/{rid}/resume").status_code == 202
        rest = list(events)
        assert rest[-1][1]["status"] == "completed", server.log()
        per_epoch = run["plan"]["total_steps"] // 5
        assert per_epoch > 1  # the patch lands before the first epoch ends
        evaluations = [d for k, d in rest if k == "evaluation"]
        assert [e["global_step"] for e in evaluations] == [per_epoch * n for n in (1, 2, 3)]
        assert [e["improved"] for e in evaluations] == [True, False, False]
        losses = {e["values"]["eval/loss"] for e in evaluations}
        assert len(losses) == 1
        view = c.get(f"/runs/{rid}").json()
        assert view["progress"]["global_step"] == 3 * per_epoch  # patience 2 ended it
        assert view["effective_config"]["evaluation"]["patience"] == 2
