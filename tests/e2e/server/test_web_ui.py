"""The server's web page in headless Chromium, driven like a user over the DevTools protocol:
a tiny SFT run planned and started from the page, followed live, paused, resumed, downloaded
and chatted with; a run's rollouts browsed and a dataset uploaded, previewed, tokenized and
planned as a recipe; the login screen of a server with a token; no page with `ui = false`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from retrograd.agent.scenarios import Scenario
from retrograd.agent.trajectory import Trajectory, Turn
from retrograd.server.store import RunRecord, now_ms
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.browser import Browser
from tests.factories.rollouts import make_groups, write_run
from tests.factories.run_server import TEXT, RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

HOSTILE = "<b>not bold</b> & co"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return write_tiny(path, "llama", chat_template=CHAT_TEMPLATE)


def page_url(server: RunServer) -> str:
    return server.url.removesuffix("/v1") + "/"


def set_field(browser: Browser, selector: str, value: str) -> None:
    """Set a field's value and fire what a user's edit fires."""
    browser.eval(
        f"""(() => {{
            const e = document.querySelector({json.dumps(selector)});
            e.value = {json.dumps(value)};
            e.dispatchEvent(new Event('input', {{bubbles: true}}));
            e.dispatchEvent(new Event('change', {{bubbles: true}}));
        }})()"""
    )


def points(browser: Browser) -> int:
    return int(browser.eval("document.querySelector('#loss-chart').dataset.points"))


def test_a_run_started_from_the_page_is_followed_paused_and_resumed(model, tmp_path):
    data = tmp_path / "data.txt"
    # the reference defaults' geometry (ctx 128, micro_batch 32) on half the text: five steps
    toml = sft_toml(model, data, text=TEXT[: len(TEXT) // 2]).replace("ctx = 32", "ctx = 128")
    toml = toml.replace("micro_batch = 16", "micro_batch = 32").replace(str(model), "")
    with (
        RunServer(
            tmp_path / "state", toml=f'path_roots = ["{tmp_path}", "{model.parent}"]'
        ) as server,
        Browser(tmp_path) as browser,
    ):
        browser.open(page_url(server))
        browser.wait(
            "document.querySelector('#runs') && document.body.innerText.includes('No runs yet')"
        )
        browser.click('nav a[href="#/plan"]')

        # the model picker lists the server's model files and writes the choice into the TOML
        option = f'#model option[value="{model}"]'
        browser.wait(f"document.querySelector({json.dumps(option)}) !== null")
        set_field(browser, "#toml", toml)
        set_field(browser, "#model", str(model))
        assert f'path = "{model}"' in browser.eval("document.querySelector('#toml').value")
        browser.type("#run-name", HOSTILE)

        browser.click("#plan")
        browser.wait("document.querySelector('#plan-result table.config') !== null")
        source = "document.querySelector('#plan-result tr[data-key=\"{}\"] .chip').textContent"
        assert browser.eval(source.format("training.lr")) == "override"
        assert browser.eval(source.format("checkpoint.directory")) == "derived"
        assert browser.eval(source.format("training.warmup_steps")) == "default"

        # Start: the page goes to the run, which is paused as soon as it may be (a fast
        # machine would finish a tiny run before a slower click)
        browser.click("#start")
        run_id = browser.wait("location.hash.startsWith('#/runs/run_') && location.hash.slice(7)")
        browser.click('[data-action="pause"]')
        browser.wait("document.querySelector('#run-status').innerText === 'paused'")
        run_json = tmp_path / "state" / run_id / "run.json"
        assert json.loads(run_json.read_text())["status"] == "paused"
        paused_at = points(browser)
        assert paused_at >= 1  # it pauses after a step, whose loss is on the chart
        assert "progress" in browser.text("#journal")

        # resumed, the curve grows as progress events arrive, to the end of the run
        browser.click('[data-action="resume"]')
        browser.wait(f"+document.querySelector('#loss-chart').dataset.points > {paused_at}")
        browser.wait("document.querySelector('#run-status').innerText === 'completed'", 120)
        view = httpx.get(f"{server.url}/runs/{run_id}").json()
        assert points(browser) == view["progress"]["global_step"]
        assert json.loads(run_json.read_text())["status"] == "completed"
        # every reported metric can be picked and drawn
        names = browser.eval(
            "[...document.querySelectorAll('#metric-picker option')].map(o => o.value)"
        )
        assert "train/loss" in names
        set_field(browser, "#metric-picker", "train/loss")
        assert browser.eval("+document.querySelector('.metric .chart').dataset.points") == points(
            browser
        )
        browser.wait("document.querySelector('#artifacts tr[data-artifact=\"adapter\"] button')")

        # Download: the browser saves the adapter through a signed link (no header needed);
        # the wait ends on Chromium's event that the download completed
        downloads = tmp_path / "downloads"
        browser.save_downloads(downloads)
        saved = browser.download('#artifacts tr[data-artifact="adapter"] button')
        assert saved == downloads / f"{run_id}-adapter.gguf"
        assert (
            saved.read_bytes()
            == (tmp_path / "state" / run_id / "output" / "adapter.gguf").read_bytes()
        )

        # the compare pane chats with the run and with its base side by side
        browser.click(f'a[href="#/compare?run={run_id}"]')
        browser.wait(f"document.querySelector('#compare-right')?.value === '{run_id}@base'")
        set_field(browser, "#compare-max", "4")
        browser.type("#compare-prompt", "hello")
        browser.click("#compare-form button[type=submit]")
        browser.wait(
            "document.querySelectorAll('.chat .turn.assistant:not(.muted):not(.error)').length === 2"
        )

        # the table shows it finished, its name as text (never markup)
        browser.click('nav a[href="#/runs"]')
        row = f'#runs tr[data-run="{run_id}"]'
        browser.wait(f"document.querySelector({json.dumps(row)}) !== null")
        assert browser.text(f"{row} .chip") == "completed"
        assert browser.text(f"{row} a") == HOSTILE
        assert browser.eval("document.querySelectorAll('#runs b').length") == 0
        assert browser.errors() == []


def finished_run(state, run_id: str, model, losses: list[float], **fields) -> None:
    """A finished SFT run as a server leaves it on disk: run.json and its events."""
    (state / run_id).mkdir(parents=True)
    at = now_ms()
    known = {
        "id": run_id,
        "name": "earlier",
        "status": "completed",
        "algorithm": "sft",
        "model": str(model),
        "created_at": at,
        "progress": {"iteration": 1, "iterations": 1, "global_step": len(losses)},
    }
    record = RunRecord(**(known | fields))
    (state / run_id / "run.json").write_text(json.dumps(record.to_json()))
    events = [{"type": "status", "status": s} for s in ("queued", "starting", "running")]
    events += [
        {"type": "progress", "iteration": 1, "iterations": 1, "global_step": i + 1, "train_loss": x}
        for i, x in enumerate(losses)
    ]
    events += [
        {"type": "status", "status": "completed"},
        {"type": "terminal", "status": "completed"},
    ]
    lines = [json.dumps({"seq": i + 1, "at": at + i, **e}) for i, e in enumerate(events)]
    (state / run_id / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_with_a_token_the_page_asks_for_it_first(model, tmp_path):
    run_id = "run_000000000001aaaaaa"
    finished_run(tmp_path / "state", run_id, model, [3.0, 2.5, 2.25])
    with (
        RunServer(tmp_path / "state", token="open-sesame") as server,
        Browser(tmp_path) as browser,
    ):
        assert httpx.head(page_url(server)).status_code == 200  # the page and its files
        assert httpx.get(page_url(server) + "web/app.js").status_code == 200  # are public
        browser.open(page_url(server))
        browser.wait("document.querySelector('#login') !== null")
        browser.type("#token", "wrong")
        browser.click("#login button[type=submit]")
        browser.wait("document.querySelector('#login .message.error') !== null")
        set_field(browser, "#token", "")
        browser.type("#token", "open-sesame")
        browser.click("#login button[type=submit]")
        browser.wait(f"document.querySelector('#runs tr[data-run=\"{run_id}\"]') !== null")
        assert browser.eval("sessionStorage.getItem('retrograd-token')") == "open-sesame"
        # the run's events come over the stream with the token: its curve and its journal
        browser.click(f'#runs a[href="#/runs/{run_id}"]')
        browser.wait("document.querySelectorAll('#journal li').length === 8")
        assert points(browser) == 3
        assert browser.eval("localStorage.getItem('retrograd-token')") is None
        # the token opens the data too: another view loads with it
        browser.click('nav a[href="#/datasets"]')
        browser.wait("document.body.innerText.includes('No datasets uploaded yet')")
        assert [e for e in browser.errors() if "401" not in e] == []


def test_ui_false_serves_no_page(tmp_path):
    with RunServer(tmp_path / "state", toml="ui = false") as server, server.client() as c:
        for path in ("", "web/app.js"):
            response = httpx.get(page_url(server) + path)
            assert response.status_code == 404
            assert response.json()["type"].endswith("/not-found")
        assert c.get("/capabilities").json()["features"]["ui"] is False


def agent_groups(update: int):
    """An update's groups, group 1's members as agent conversations with a tool call."""
    groups = make_groups(update)
    for r in groups[1].members:
        call = {"id": "call_0", "name": "lookup", "arguments": {"word": f"mouse {r.member}"}}
        messages = [
            {"role": "user", "content": "What is the plural of mouse?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps(call["arguments"])},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": HOSTILE},
            {"role": "assistant", "content": f"mice, says member {r.member}"},
        ]
        turns = [Turn("", "", [call], True, 5, [messages[2]]), Turn("", "", [], True, 4)]
        scenario = Scenario(key="scenarios.jsonl:1", index=0, id="plural", user="mouse")
        traj = Trajectory(scenario, r.member, r.seed, [], messages, turns, step_rewards=[0.25])
        r.extra["sample"] = SimpleNamespace(traj=traj)
    return groups


def test_rollouts_and_datasets_from_the_page(model, tmp_path):
    """A finished GRPO run's rollouts (its [observe] feed, as a run leaves it) browsed and
    filtered; a dataset uploaded, previewed and tokenized with the tiny model."""
    observe = tmp_path / "observe"
    write_run(observe, range(1, 4), every=1, groups_of=agent_groups)
    state = tmp_path / "state"
    run_id = "run_000000000001abcdef"
    observed = {"directory": str(observe), "every": 1}
    finished_run(
        state,
        run_id,
        model,
        [],
        algorithm="grpo",
        effective_config={"observe": observed},
        observed=True,
    )
    roots = f'path_roots = ["{tmp_path}", "{model.parent}"]'
    with RunServer(state, toml=roots) as server, Browser(tmp_path) as browser:
        browser.open(page_url(server) + f"#/runs/{run_id}")
        browser.click(f'a[href="#/runs/{run_id}/rollouts"]')
        browser.click('#updates tr[data-update="2"]')
        browser.wait("document.querySelectorAll('#groups tr[data-group]').length === 3")
        rewards = browser.eval(
            "[...document.querySelectorAll('#groups tr[data-group] td:nth-child(2)')]"
            ".map(td => +td.textContent)"
        )
        assert rewards == sorted(rewards, reverse=True)  # sorted by reward

        # group 1: conversations with their tool calls, the tool's answer as text
        browser.click('#groups tr[data-group="1"]')
        browser.wait("document.querySelectorAll('#members .member').length === 4")
        assert browser.text("#members .member .tool-name").startswith("→ lookup")
        assert '"word": "mouse' in browser.text("#members .member .tool-call pre")
        assert browser.text("#members .member .turn.tool pre") == HOSTILE
        assert browser.eval("document.querySelectorAll('#members b').length") == 0
        assert "step reward 0.25" in browser.text("#members .member")

        # filters: trained only, a reward floor, a search
        trained = browser.eval(
            "document.querySelectorAll('#members .member .chip-completed').length"
        )
        browser.click("#trained-only")
        browser.wait(f"document.querySelectorAll('#members .member').length === {trained}")
        browser.click("#trained-only")
        set_field(browser, "#min-reward", "1000")
        browser.wait("document.querySelectorAll('#groups tr[data-group]').length === 0")
        set_field(browser, "#min-reward", "")
        set_field(browser, "#rollout-search", "says member 2")
        browser.wait("document.querySelectorAll('#members .member').length === 1")

        # datasets: upload, see it listed, preview, tokenize with the model file
        data = tmp_path / "notes.txt"
        data.write_text(TEXT.replace(". ", ".\n"))
        browser.click('nav a[href="#/datasets"]')
        browser.wait("document.body.innerText.includes('No datasets uploaded yet')")
        browser.choose_file("#dataset-file", data)
        browser.click("#upload button[type=submit]")
        browser.wait("document.querySelector('#datasets tr[data-dataset]') !== null")
        assert "notes.txt" in browser.text("#datasets")
        browser.click("#datasets tr[data-dataset] button")
        browser.wait("document.querySelectorAll('#dataset-detail .examples li').length === 5")
        assert browser.text("#dataset-detail .examples li") == "the cat sat on the mat."
        browser.click("#tokenize")
        browser.wait("document.querySelector('#dataset-detail .stat') !== null")
        assert "total_tokens" in browser.text("#dataset-detail")

        # a recipe on that dataset: the server writes the run, the page shows its plan
        browser.click('nav a[href="#/plan"]')
        browser.wait(f"document.querySelector('#model option[value=\"{model}\"]') !== null")
        browser.wait("document.querySelectorAll('#dataset option').length === 2")
        set_field(browser, "#model", str(model))
        set_field(
            browser,
            "#dataset",
            browser.eval("document.querySelectorAll('#dataset option')[1].value"),
        )
        browser.click("#recipe summary")
        browser.click("#plan-recipe")
        browser.wait("document.querySelector('#plan-result table.config') !== null")
        chip = "document.querySelector('#plan-result tr[data-key=\"{}\"] td:nth-child({})').textContent"
        assert browser.eval(chip.format("run.algorithm", 2)) == "sft"
        assert browser.eval(chip.format("lora.rank", 3)).startswith("derived")
        assert browser.wait("document.querySelector('#memory tr.post') !== null")
        assert browser.errors() == []
