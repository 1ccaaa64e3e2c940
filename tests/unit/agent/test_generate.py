"""`retrograd scenarios generate` (formats.md §4.6) against a real scripted endpoint: batches,
retries, invalid and repeated scenarios dropped, the manifest and check_manifest, --dry-run
and --force."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from retrograd.agent.endpoint import ChatEndpoint, EndpointError
from retrograd.agent.generate import (
    build_prompt,
    catalog_text,
    check_manifest,
    generate,
    manifest_path,
    parse_reply,
    write_scenarios,
)
from retrograd.agent.scenarios import read_scenarios
from retrograd.cli.main import main
from retrograd.config.agent import ScenarioGeneration
from retrograd.errors import DataError
from tests.factories.env_server import env_server
from tests.factories.scripted_openai import raw, reply, scripted_openai, status
from tests.unit.agent.counter_env import TOOLS

KEY_ENV = "RETRO_TEST_GENERATE_KEY"
CATALOG = [spec.openai() for spec in TOOLS]


def settings(**kw) -> ScenarioGeneration:
    base = {"model": "gen-test", "base_url": "http://unused/v1", "api_key_env": KEY_ENV}
    return ScenarioGeneration.model_validate(base | kw)


def batch(*ids: str, **extra) -> dict:
    items = [{"id": i, "user": f"Task {i}.", "metadata": {"difficulty": 2}} | extra for i in ids]
    return reply(json.dumps({"scenarios": items}))


def endpoint(api) -> ChatEndpoint:
    return ChatEndpoint(api.base_url, "gen-test", "test-key", timeout=10, max_retries=2, backoff=0)


def test_batches_until_count():
    gen = settings(count=5, batch_size=2, shuffle=False, min_difficulty=2, max_difficulty=4)
    prompt = build_prompt(gen, CATALOG)
    with (
        scripted_openai([batch("a", "b"), batch("c", "d"), batch("e")]) as api,
        endpoint(api) as ep,
    ):
        result = generate(gen, prompt, ep, seed=9)
        requests = api.requests
    assert [s["id"] for s in result.scenarios] == ["a", "b", "c", "d", "e"]
    assert result.requests == 3 and result.invalid == result.duplicates == 0
    assert [r["response_format"] for r in requests] == [{"type": "json_object"}] * 3
    assert [r["seed"] for r in requests] == [9, 10, 11]
    asks = [r["messages"][1]["content"] for r in requests]
    assert asks[0].startswith("Write 2 new scenarios (batch 1 of 3") and asks[2].startswith(
        "Write 1 new"
    )
    system = requests[0]["messages"][0]["content"]
    assert all(r["messages"][0]["content"] == system for r in requests)
    assert "difficulties from 2 to 4" in system and '"name": "explode"' in system
    assert hashlib.sha256(system.encode()).hexdigest() == prompt.sha256


def test_invalid_and_repeated_scenarios_are_dropped_and_topped_up():
    gen = settings(count=3, batch_size=2, shuffle=False)
    bad = {
        "scenarios": [
            {"id": "a", "user": "Task a."},
            {"id": "b"},  # no user
            {"id": "c", "user": "Task c.", "rubric": "x"},  # unknown key
            {"id": "a", "user": "Again."},  # a repeated id
            {"id": "d", "user": "Task d.", "metadata": {"env": {"verify": {"cmd": []}}}},
        ]
    }
    script = [reply(json.dumps(bad)), reply("no json here"), batch("e", "f", "g")]
    with scripted_openai(script) as api, endpoint(api) as ep:
        result = generate(gen, build_prompt(gen, []), ep, seed=0)
    assert [s["id"] for s in result.scenarios] == ["a", "e", "f"]
    assert (result.invalid, result.duplicates, result.unreadable, result.requests) == (3, 1, 1, 3)
    assert any("missing" in w or '"user"' in w for w in result.warnings)
    assert any('unknown key "rubric"' in w for w in result.warnings)
    assert any('id "a" is taken already' in w for w in result.warnings)


def test_asking_stops_at_twice_the_planned_batches():
    gen = settings(count=2, batch_size=1)
    with scripted_openai([reply("{}")] * 10) as api, endpoint(api) as ep:
        result = generate(gen, build_prompt(gen, []), ep, seed=0)
        assert len(api.requests) == 4
    assert result.scenarios == [] and result.unreadable == 4


def test_replies_are_read_from_the_first_brace_to_the_last():
    fenced = 'Here you go:\n```json\n{"scenarios": [{"id": "x", "user": "u"}]}\n```\nEnjoy!'
    assert parse_reply(fenced) == [{"id": "x", "user": "u"}]
    assert parse_reply('{"id": "y", "user": "u"}') == [{"id": "y", "user": "u"}]
    assert parse_reply("[1, 2]") is None and parse_reply("{broken") is None
    assert parse_reply('{"other": 1}') is None


def test_a_reply_nested_too_deep_is_unreadable_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    assert parse_reply('{"scenarios": ' + deep + "}") is None
    gen = settings(count=1, batch_size=1)
    with scripted_openai([reply('Here: {"scenarios": ' + deep + "}"), batch("a")]) as api:
        with endpoint(api) as ep:
            result = generate(gen, build_prompt(gen, []), ep, seed=0)
    assert [s["id"] for s in result.scenarios] == ["a"] and result.unreadable == 1
    # the HTTP body itself: the endpoint is broken, said so, not a RecursionError
    body = '{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": '
    with scripted_openai([raw(body + deep + "}")]) as api, endpoint(api) as ep:
        with pytest.raises(EndpointError, match="not a chat completion"):
            generate(gen, build_prompt(gen, []), ep, seed=0)


def test_retries_on_server_errors():
    gen = settings(count=1, batch_size=1)
    with scripted_openai([status(500), status(503), batch("a")]) as api, endpoint(api) as ep:
        result = generate(gen, build_prompt(gen, []), ep, seed=0)
        assert len(api.requests) == 3
    assert [s["id"] for s in result.scenarios] == ["a"]


def test_shuffle_is_a_function_of_the_seed():
    gen = settings(count=6, batch_size=6)
    order = []
    for seed in (1, 1, 2):
        with scripted_openai([batch(*"abcdef")]) as api, endpoint(api) as ep:
            order.append(
                [s["id"] for s in generate(gen, build_prompt(gen, []), ep, seed).scenarios]
            )
    assert order[0] == order[1] and sorted(order[0]) == list("abcdef")
    assert order[0] != order[2]  # another seed, another order


def test_catalog_is_cut_to_max_catalog_bytes():
    full, left_out = catalog_text(CATALOG, 1 << 20)
    assert left_out == 0 and json.loads(full) == sorted(
        CATALOG, key=lambda t: t["function"]["name"]
    )
    cut, left_out = catalog_text(CATALOG, len(full.encode()) - 1)
    assert left_out >= 1 and len(cut.encode()) < len(full.encode())
    prompt = build_prompt(settings(max_catalog_bytes=len(cut.encode())), CATALOG)
    assert f"({left_out} more tools are not shown)" in prompt.system
    assert prompt.catalog_sha256 == hashlib.sha256(prompt.catalog.encode()).hexdigest()


def test_manifest_and_check_manifest(tmp_path):
    gen = settings(count=2, batch_size=2)
    prompt = build_prompt(gen, CATALOG)
    path = tmp_path / "s.jsonl"
    scenarios = [
        {"id": "a", "user": "A.", "metadata": {}},
        {"id": "b", "user": "B.", "metadata": {}},
    ]
    manifest = write_scenarios(path, scenarios, prompt, gen, seed=4)
    assert json.loads(manifest_path(path).read_text()) == manifest
    assert manifest["corpus_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (
        manifest["prompt_sha256"] == prompt.sha256
        and manifest["catalog_sha256"] == prompt.catalog_sha256
    )
    assert (manifest["model"], manifest["count"], manifest["seed"]) == ("gen-test", 2, 4)
    assert len(read_scenarios(path)) == 2
    check_manifest(path)
    path.write_text(path.read_text() + '{"id": "c", "user": "C."}\n')
    with pytest.raises(
        DataError, match=r"s.jsonl: the file changed since `retrograd scenarios generate`"
    ):
        check_manifest(path)
    manifest_path(path).write_text("{not json")
    with pytest.raises(DataError, match="not a scenario manifest"):
        check_manifest(path)
    manifest_path(path).unlink()
    check_manifest(path)  # no sidecar: not checked
    assert not list(tmp_path.glob("*.tmp*"))


# -- the command ------------------------------------------------------------------------------


def run_file(tmp: Path, api_url: str, env_url: str | None = None, extra: str = "") -> Path:
    env = f'[agent.environment]\ntype = "http"\nbase_url = "{env_url}"\n' if env_url else ""
    judge = "" if env_url else '[agent.judge]\ntype = "command"\ncommand = ["python3", "j.py"]\n'
    path = tmp / "run.toml"
    path.write_text(
        f"""[run]
algorithm = "agent_grpo"
[output]
path = "out.gguf"
[lora]
[agent]
scenarios = "data/s.jsonl"
seed = 3
{env}{judge}[agent.scenario_generation]
model = "gen-test"
base_url = "{api_url}"
api_key_env = "{KEY_ENV}"
count = 3
batch_size = 2
max_retries = 1
custom_instructions = "Use small numbers."
{extra}"""
    )
    (tmp / "data").mkdir(exist_ok=True)
    return path


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "test-key")


def test_generate_command_writes_the_file_and_its_manifest(tmp_path, key, capsys):
    with env_server() as env, scripted_openai([status(500), batch("a", "b"), batch("c")]) as api:
        cfg = run_file(tmp_path, api.base_url, env.url)
        assert main(["scenarios", "generate", str(cfg)]) == 0
        requests = api.requests
    assert len(requests) == 3  # one retry after the 500
    system = requests[1]["messages"][0]["content"]
    assert '"name": "add"' in system and "Use small numbers." in system  # the environment's tools
    path = tmp_path / "data" / "s.jsonl"
    assert sorted(s.id for s in read_scenarios(path).scenarios) == ["a", "b", "c"]
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["seed"] == 3 and manifest["count"] == 3
    check_manifest(path)
    assert "wrote" in capsys.readouterr().out
    # a second run refuses the file without --force, replaces it with --force
    with scripted_openai([batch("x", "y"), batch("z")]) as api:
        cfg = run_file(tmp_path, api.base_url)
        assert main(["scenarios", "generate", str(cfg)]) == 1
        assert "exists; pass --force" in capsys.readouterr().err and api.requests == []
        assert main(["scenarios", "generate", str(cfg), "--force"]) == 0
    assert sorted(s.id for s in read_scenarios(path).scenarios) == ["x", "y", "z"]
    check_manifest(path)


def test_dry_run_prints_the_prompt_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)  # no key needed: nothing is asked
    with scripted_openai([]) as api:
        cfg = run_file(tmp_path, api.base_url)
        assert main(["scenarios", "generate", str(cfg), "--dry-run"]) == 0
        assert api.requests == []
    out = capsys.readouterr().out
    assert "You write training scenarios" in out and "Use small numbers." in out
    assert "Write 2 new scenarios" in out
    assert list((tmp_path / "data").iterdir()) == []


def test_generate_command_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with scripted_openai([batch("a")]) as api:
        cfg = run_file(tmp_path, api.base_url)
        assert main(["scenarios", "generate", str(cfg)]) == 1
        assert (
            f"api_key_env = {KEY_ENV}: the environment variable is not set"
            in capsys.readouterr().err
        )
        assert api.requests == []
    monkeypatch.setenv(KEY_ENV, "test-key")
    with scripted_openai([status(500)] * 4) as api:
        cfg = run_file(tmp_path, api.base_url)
        assert main(["scenarios", "generate", str(cfg)]) == 1
        assert "failed 2 times" in capsys.readouterr().err
    assert not (tmp_path / "data" / "s.jsonl").exists()
    cfg.write_text(cfg.read_text().split("[agent.scenario_generation]")[0])
    assert main(["scenarios", "generate", str(cfg)]) == 1
    assert "[agent.scenario_generation]: required" in capsys.readouterr().err


def test_generate_shows_a_local_environment_default_toolset(tmp_path, key):
    local = '[agent.environment]\ntype = "local"\nallow_unsandboxed = true\n'
    local += '[agent.environment.tools]\ndefault = "python"\n'
    with scripted_openai([batch("a", "b"), batch("c")]) as api:
        cfg = run_file(tmp_path, api.base_url)
        text = cfg.read_text().replace(
            '[agent.judge]\ntype = "command"', local + '[agent.judge]\ntype = "command"'
        )
        cfg.write_text(text)
        assert main(["scenarios", "generate", str(cfg)]) == 0
        system = api.requests[0]["messages"][0]["content"]
    catalog = json.loads(system.split("(OpenAI function format):\n")[1].split("\n\nAlso follow")[0])
    names = [t["function"]["name"] for t in catalog]
    assert names == sorted(names) and {"bash", "python", "run_tests", "submit"} <= set(names)


def test_a_scenario_holding_a_lone_surrogate_is_dropped_or_refused(tmp_path):
    """A generated scenario whose text holds a lone surrogate (a \\ud800 escape) is invalid,
    dropped like any other, where writing the file raised UnicodeEncodeError; in a scenario
    file it is an error naming the line, not a crash when the chat template renders it."""
    gen = settings(count=2, batch_size=2, shuffle=False)
    hostile = '{"scenarios": [{"id": "a", "user": "Task \\ud800."}, {"id": "b", "user": "B."}, '
    hostile += '{"id": "c", "user": "C.", "metadata": {"\\udc80": 1}}]}'
    script = [reply(hostile), batch("d")]
    with scripted_openai(script) as api, endpoint(api) as ep:
        prompt = build_prompt(gen, [])
        result = generate(gen, prompt, ep, seed=0)
    assert [s["id"] for s in result.scenarios] == ["b", "d"] and result.invalid == 2
    assert sum("lone surrogate" in w for w in result.warnings) == 2
    out = tmp_path / "scenarios.jsonl"
    write_scenarios(out, result.scenarios, prompt, gen, 0)
    assert len(read_scenarios(out)) == 2
    out.write_text('{"id": "a", "user": "fine"}\n{"id": "b", "user": "x\\ud800"}\n')
    with pytest.raises(DataError, match=r"scenarios\.jsonl:2: .*lone surrogate"):
        read_scenarios(out)
