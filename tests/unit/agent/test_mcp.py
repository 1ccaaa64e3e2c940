"""McpHub against real MCP servers built with the SDK (tests/factories/mcp_server.py), over
stdio and streamable HTTP; mcp.json files read from tmp_path."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from retrograd.agent.http_env import TRUNCATED, cap_text
from retrograd.agent.mcp import McpHub, McpServerError, list_tools
from retrograd.agent.mcp_config import read_mcp_json, server_plans
from retrograd.agent.types import Observation
from retrograd.config.agent import AgentSection
from retrograd.errors import ConfigError, EnvironmentFailure
from tests.factories.mcp_server import ROOT, http_server, stdio_command

TOOLS = ["add", "echo", "env", "cwd", "slow", "fail", "big", "header", "crash"]
VARIABLES = {
    "RETRO_PASS": "passed",
    "RETRO_HIDDEN": "hidden",
    "RETRO_SRC": "v1",
    "RETRO_NESTED": "${RETRO_SRC}",
}


def agent(servers=(), mcp_config=None, **keys) -> AgentSection:
    record = {"scenarios": "s.jsonl", "mcp_servers": list(servers), **keys}
    if mcp_config is not None:
        record["mcp_config"] = mcp_config
    return AgentSection.model_validate(record)


def write_json(path: Path, servers: dict) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


@pytest.fixture(scope="module")
def remote():
    with http_server() as url:
        yield url


@pytest.fixture(scope="module")
def hub(remote):
    """Four servers started together: policy, filters, environment and HTTP are each one's."""
    saved = {k: os.environ.get(k) for k in VARIABLES}
    os.environ.update(VARIABLES)
    servers = [
        {
            "name": "calc",
            "command": stdio_command(),
            "tool_timeout_secs": 0.5,
            "max_tool_result_bytes": 16,
            "env_passthrough": ["RETRO_PASS"],
            "env": {"RETRO_OWN": "own-${RETRO_SRC}", "RETRO_ONCE": "${RETRO_NESTED}"},
        },
        {
            "name": "picky",
            "command": [sys.executable, "-m", "tests.factories.mcp_server"],
            "cwd": str(ROOT),
            "allowed_tools": ["a*", "e*", "big"],
            "denied_tools": ["b*"],
        },
        {"name": "web", "url": remote, "headers": {"X-Run": "run-${RETRO_SRC}"}},
    ]
    try:
        with McpHub.open(agent(servers), ROOT) as hub:
            yield hub
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_tools_are_exposed_as_server__tool(hub):
    names = [t.name for t in hub.tools]
    assert names == [f"calc__{t}" for t in TOOLS] + ["picky__add", "picky__echo", "picky__env"] + [
        f"web__{t}" for t in TOOLS
    ]
    add = hub.tools[0]
    assert add.description == "Add two integers."
    assert add.input_schema["required"] == ["a", "b"]
    assert hub.owns("calc__add") and not hub.owns("add") and not hub.owns("picky__big")


def test_calls_over_stdio_and_http(hub):
    assert hub.call("calc__add", {"a": 2, "b": 3}) == Observation("5")
    assert hub.call("picky__echo", {"text": "hi"}) == Observation("hi")
    assert hub.call("web__add", {"a": 1, "b": 1}) == Observation("2")


def test_denied_tools_win_over_allowed_ones(hub):
    # picky allows a*, e* and big, but denies b*: big is withheld
    assert hub.call("picky__big", {"n": 3}) == Observation("unknown tool 'picky__big'", True)
    assert hub.call("picky__fail", {"message": "m"}) == Observation(
        "unknown tool 'picky__fail'", True
    )


def test_an_is_error_result_is_an_error_observation(hub):
    observation = hub.call("web__fail", {"message": "boom"})
    assert observation.is_error
    assert observation.content.endswith("boom")


def test_a_slow_call_times_out_and_the_session_goes_on(hub):
    started = time.monotonic()
    observation = hub.call("calc__slow", {"seconds": 5})
    assert observation == Observation("tool call timed out after 0.5 s", is_error=True)
    assert time.monotonic() - started < 3
    assert hub.call("calc__add", {"a": 1, "b": 2}) == Observation("3")


def test_results_are_capped(hub):
    assert hub.call("calc__big", {"n": 100}).content == "x" * 16 + TRUNCATED
    assert hub.call("calc__big", {"n": 16}).content == "x" * 16
    assert hub.call("web__big", {"n": 100}).content == "x" * 100


def test_a_local_server_inherits_only_path_home_and_passthrough(hub):
    env = {name: hub.call("calc__env", {"name": name}).content for name in VARIABLES}
    assert env == {
        "RETRO_PASS": "passed",
        "RETRO_HIDDEN": "<unset>",
        "RETRO_SRC": "<unset>",
        "RETRO_NESTED": "<unset>",
    }
    for name in ("PATH", "HOME"):  # calc caps results at 16 bytes
        assert hub.call("calc__env", {"name": name}).content == cap_text(os.environ[name], 16)
    # without env_passthrough a local server inherits everything
    assert hub.call("picky__env", {"name": "RETRO_HIDDEN"}).content == "hidden"


def test_variables_are_expanded_once(hub):
    assert hub.call("calc__env", {"name": "RETRO_OWN"}).content == "own-v1"
    assert hub.call("calc__env", {"name": "RETRO_ONCE"}).content == "${RETRO_SRC}"
    assert hub.call("web__header", {"name": "X-Run"}).content == "run-v1"


def test_eight_calls_in_parallel(hub):
    results: dict[int, Observation] = {}

    def call(i: int) -> None:
        tool = "web__slow" if i % 2 else "calc__slow"
        results[i] = hub.call(tool, {"seconds": 0.3})
        results[i + 100] = hub.call("calc__add", {"a": i, "b": 1000})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 8 * 0.3  # the sleeps overlapped
    assert [results[i].content for i in range(8)] == ["slept 0.3"] * 8
    assert [results[i + 100].content for i in range(8)] == [str(1000 + i) for i in range(8)]


def test_missing_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.delenv("RETRO_NOT_SET", raising=False)
    servers = [{"name": "s", "command": ["x"], "env": {"TOKEN": "${RETRO_NOT_SET}"}}]
    with pytest.raises(
        ConfigError, match=r"\[agent.mcp_servers\] s: env.TOKEN uses \$\{RETRO_NOT_SET\}"
    ):
        server_plans(agent(servers), ROOT)


def test_literal_secrets_are_warned(caplog, monkeypatch):
    monkeypatch.setenv("RETRO_KEY", "k")
    servers = [
        {
            "name": "s",
            "command": ["x"],
            "env": {"API_KEY": "sk-123", "OTHER_TOKEN": "${RETRO_KEY}"},
        },
        {"name": "r", "url": "http://h/mcp", "headers": {"Authorization": "Bearer abc"}},
    ]
    with caplog.at_level(logging.WARNING, logger="retrograd.agent.mcp_config"):
        plans = server_plans(agent(servers), ROOT)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert warned[0].startswith("[agent.mcp_servers] s: env.API_KEY holds a literal secret")
    assert warned[1].startswith("[agent.mcp_servers] r: headers.Authorization holds")
    assert plans[0].env == {"API_KEY": "sk-123", "OTHER_TOKEN": "k"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"command": "x", "port": 1}, 'mcpServers.s: unknown key "port"'),
        ({"url": "http://h/sse", "type": "sse"}, 'mcpServers.s.type: "sse" is not supported'),
        ({"command": "x", "url": "http://h"}, "mcpServers.s: needs exactly one of command"),
        ({"args": ["a"]}, "mcpServers.s: needs exactly one of command"),
        ({"command": "x", "type": "http"}, 'mcpServers.s.type: "http" does not go with command'),
        ({"url": "http://h", "env": {}}, "mcpServers.s.env: only for a local server"),
        ({"command": "x", "headers": {}}, "mcpServers.s.headers: only for a remote server"),
        ({"command": "x", "args": "a"}, "mcpServers.s.args: must be a list"),
        ({"command": "x", "env": {"A": 1}}, "mcpServers.s.env.A: must be a string"),
        ({"command": "x", "timeout": 0}, "mcpServers.s.timeout: must be a number of seconds"),
        ({"url": "ftp://h"}, "mcpServers.s.url: must be an http or https URL"),
    ],
)
def test_mcp_json_errors_name_file_and_key(tmp_path, entry, message):
    path = write_json(tmp_path / "mcp.json", {"s": entry})
    with pytest.raises(ConfigError) as e:
        read_mcp_json(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)


def test_mcp_json_syntax_and_shape(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {\n  "s": {"command": "x",}\n}}')
    with pytest.raises(ConfigError, match=rf"{path}:2:\d+: not valid JSON"):
        read_mcp_json(path)
    path.write_text('{"mcpServers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=rf"{path}:1:79: not valid JSON: nested more than 64"):
        read_mcp_json(path)
    path.write_text('{"servers": {}}')
    with pytest.raises(ConfigError, match=r'expected \{"mcpServers"'):
        read_mcp_json(path)
    path.write_text('{"mcpServers": {}, "extra": 1}')
    with pytest.raises(ConfigError, match='unknown key "extra"'):
        read_mcp_json(path)
    with pytest.raises(ConfigError, match="cannot read it"):
        server_plans(agent(mcp_config="missing.json"), tmp_path)


def test_a_name_in_two_files_is_refused(tmp_path):
    one = write_json(tmp_path / "one.json", {"s": {"command": "x"}})
    two = write_json(tmp_path / "two.json", {"s": {"url": "http://h/mcp"}})
    with pytest.raises(ConfigError, match=f"{two}: mcpServers.s: already declared by {one}"):
        server_plans(agent(mcp_config=["one.json", "two.json"]), tmp_path)


def test_disabled_entries_are_skipped_with_a_warning(tmp_path, caplog):
    write_json(
        tmp_path / "mcp.json", {"a": {"command": "x", "disabled": True}, "b": {"command": "y"}}
    )
    overlay = [{"name": "a", "command": ["x"], "required": False}]
    with caplog.at_level(logging.WARNING, logger="retrograd.agent.mcp_config"):
        plans = server_plans(agent(overlay, mcp_config="mcp.json"), tmp_path)
    assert [p.name for p in plans] == ["b"]
    assert (
        caplog.records[0].getMessage()
        == f"{tmp_path / 'mcp.json'}: mcpServers.a: disabled; skipped"
    )


def test_toml_entry_overlays_policy_of_a_file_server(tmp_path):
    write_json(
        tmp_path / "mcp.json",
        {"s": {"command": "srv", "args": ["--x"], "timeout": 5, "env": {"A": "1"}, "cwd": "sub"}},
    )
    overlay = [{"name": "s", "command": ["ignored"], "allowed_tools": ["add"], "required": False}]
    (plan,) = server_plans(agent(overlay, mcp_config="mcp.json"), tmp_path)
    assert plan.command == ("srv", "--x") and plan.env == {"A": "1"}
    assert plan.cwd == tmp_path / "sub"  # against the json file
    assert plan.allowed_tools == ("add",) and plan.required is False
    assert plan.tool_timeout_secs == 5.0  # left at its default in the overlay: the file's
    assert plan.max_tool_result_bytes == 65536


def test_a_server_from_mcp_json_runs_in_its_cwd(tmp_path):
    (tmp_path / "work").mkdir()
    cmd = stdio_command()
    write_json(tmp_path / "mcp.json", {"f": {"command": cmd[0], "args": cmd[1:], "cwd": "work"}})
    rows = list_tools(agent(mcp_config=str(tmp_path / "mcp.json")), ROOT)
    assert rows[0] == {
        "server": "f",
        "name": "f__add",
        "tool": "add",
        "description": "Add two integers.",
    }
    assert [r["name"] for r in rows] == [f"f__{t}" for t in TOOLS]
    with McpHub.open(agent(mcp_config="mcp.json"), tmp_path) as hub:
        assert hub.call("f__cwd", {}).content == str(tmp_path / "work")


def test_servers_beside_an_environment_must_be_stateless(tmp_path):
    write_json(tmp_path / "mcp.json", {"s": {"url": "http://h/mcp"}})
    env = {"type": "http", "base_url": "http://e"}
    with pytest.raises(ConfigError, match="mcpServers.s: must be stateless"):
        server_plans(agent(mcp_config="mcp.json", environment=env), tmp_path)
    overlay = [{"name": "s", "url": "http://h/mcp", "stateless": True}]
    assert server_plans(agent(overlay, mcp_config="mcp.json", environment=env), tmp_path)


DEAD = {"name": "dead", "command": [sys.executable, "-c", "import sys; sys.exit(3)"]}


def test_an_optional_server_that_fails_is_skipped(remote, caplog):
    servers = [{**DEAD, "required": False}, {"name": "web", "url": remote}]
    with caplog.at_level(logging.WARNING, logger="retrograd.agent.mcp"):
        with McpHub.open(agent(servers), ROOT) as hub:
            assert {t.name.split("__")[0] for t in hub.tools} == {"web"}
    assert "[agent.mcp_servers] dead: cannot connect" in caplog.text
    assert "skipped (required = false)" in caplog.text


def test_a_required_server_that_fails_is_an_error(remote):
    servers = [DEAD, {"name": "web", "url": remote}]
    with pytest.raises(McpServerError, match=r"\[agent.mcp_servers\] dead: cannot connect"):
        McpHub.open(agent(servers), ROOT)
    missing = [{"name": "nope", "command": ["/nonexistent/retrograd-mcp"]}]
    with pytest.raises(McpServerError, match="nope: cannot connect .FileNotFoundError"):
        McpHub.open(agent(missing), ROOT)


def test_every_server_failing_is_an_error():
    servers = [
        {**DEAD, "required": False},
        {"name": "far", "url": "http://127.0.0.1:9/mcp", "required": False},
    ]
    with pytest.raises(McpServerError, match="every MCP server failed to connect: .*dead.*far"):
        McpHub.open(agent(servers), ROOT)


def test_no_servers_is_an_empty_hub():
    with McpHub.open(agent(), ROOT) as hub:
        assert hub.tools == []
        assert hub.call("x__y", {}) == Observation("unknown tool 'x__y'", is_error=True)


def test_a_server_lost_mid_call_fails_the_trajectory():
    with McpHub.open(agent([{"name": "c", "command": stdio_command()}]), ROOT) as hub:
        with pytest.raises(
            EnvironmentFailure, match=r"\[agent.mcp_servers\] c: the server is gone"
        ):
            hub.call("c__crash", {})


def test_a_reply_past_the_cap_fails_naming_it():
    """A remote server answering in JSON bodies had no size limit on them (only the text kept
    was cut): 17 MB were read and parsed. Past 8 x max_tool_result_bytes, at least 16 MiB,
    reading stops; the SDK closes the session on it, so the call is a broken environment
    (EnvironmentFailure, the trajectory dropped, never the run) that names the cap. (The SDK
    bounds each server-sent event to 1 MiB itself.)"""
    with (
        http_server(json_response=True) as url,
        McpHub.open(agent([{"name": "web", "url": url, "tool_timeout_secs": 20}]), ROOT) as hub,
    ):
        assert hub.call("web__big", {"n": 1_000_000}).content == "x" * 65536 + TRUNCATED
        with pytest.raises(EnvironmentFailure, match=r"web.*a reply over 16777216 bytes"):
            hub.call("web__big", {"n": 17_000_000})
