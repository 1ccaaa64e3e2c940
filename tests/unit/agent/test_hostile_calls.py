"""Whatever arguments a model writes, every tool answers with an observation and the episode
goes on: NUL bytes, lone surrogates, wrong types, missing and extra keys, enormous strings,
arguments that are not an object or nest 100,000 deep, paths out of the workspace (`..`,
absolute, through a symlink) and unknown names, for every built-in and exec tool of a local
and a container environment (through SandboxEnvironment's public interface), an HTTP
environment and MCP servers. Only a broken environment raises, and then EnvironmentFailure."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

from retrograd.agent.http_env import HttpEnvironment
from retrograd.agent.local import LocalPool
from retrograd.agent.mcp import McpHub
from retrograd.agent.sandbox_env import SandboxEnvironment
from retrograd.agent.scenarios import parse_scenario
from retrograd.agent.tools.catalog import load_catalog
from retrograd.agent.types import Observation
from retrograd.config.agent import AgentSection, ToolsConfig
from retrograd.config.agent import HttpEnvironment as HttpConfig
from retrograd.errors import EnvironmentFailure
from tests.factories.env_server import env_server
from tests.factories.mcp_server import ROOT, stdio_command
from tests.unit.agent.containers import cli, spec  # noqa: F401 (a fixture)

ENORMOUS = "x" * 1_000_000  # past what one argv element may hold (128 KiB)


def deep(levels: int) -> list:
    """A list nested `levels` deep, built without recursion."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


# what a string parameter may be given -> refused wherever the string reaches a command line
STRING_CASES = {
    "a NUL byte": "a\x00b",
    "a lone high surrogate": "a\ud800b",
    "a lone low surrogate (surrogateescape's raw byte)": "\udc80",
    "a list": ["ls"],
    "a huge integer": 10**100,
    "null": None,
    "a float": math.inf,
    "an object": {"a": 1},
    "an enormous string": ENORMOUS,
}
# where a string is data (it reaches the file through stdin), NUL and size are no fault
DATA_OK = {"a NUL byte", "an enormous string"}
PATH_CASES = {
    "..": "../escape.txt",
    "an absolute path": "/etc/hostname",
    "a symlink to a file outside": "host-file",
    "through a symlink to a directory outside": "root/etc/hostname",
    "a dangling symlink to a file outside": "dangling",
    "through a symlink to a parent": "up/escape.txt",
}
# whole-arguments cases: every tool refuses them
ARGUMENT_CASES = {
    "a lone surrogate in an extra key": {"\ud800": 1},
    "nested 100,000 deep": {"extra": deep(100_000)},
    "NaN": {"extra": math.nan},
}
# tool -> (its string parameters, the data ones among them, the path ones, a valid call)
BUILTINS = {
    "bash": (["command"], [], [], {"command": "echo ok"}),
    "python": (["code"], [], [], {"code": "print('ok')"}),
    "read_file": (["path"], [], ["path"], {"path": "notes.txt"}),
    "write_file": (["path", "content"], ["content"], ["path"], {"path": "w", "content": "ok"}),
    "edit_file": (
        ["path", "old_string", "new_string"],
        ["old_string", "new_string"],
        ["path"],
        {"path": "notes.txt", "old_string": "hello", "new_string": "hi"},
    ),
    "list_dir": (["path"], [], ["path"], {"path": "."}),
    "grep": (["pattern", "path"], [], ["path"], {"pattern": "hello"}),
    "submit": (["message"], ["message"], [], {"message": "done"}),
}
SETUP = [
    "ln -s /etc/hostname host-file",
    "ln -s / root",
    "ln -s /tmp/retrograd-escape-target dangling",
    "ln -s .. up",
    "mkdir -p inner && echo inside > inner/f && ln -s inner in-link && ln -s inner/f f-link",
]


def hostile_calls(tool: str):
    """(what, arguments, refused) for every hostile call of a built-in tool."""
    params, data, paths, valid = BUILTINS[tool]
    for param in params:
        for case, value in STRING_CASES.items():
            refused = not (param in data and case in DATA_OK)
            yield f"{param}: {case}", valid | {param: value}, refused
    for param in paths:
        for case, value in PATH_CASES.items():
            yield f"{param}: {case}", valid | {param: value}, True
    for case, extra in ARGUMENT_CASES.items():
        yield case, valid | extra, True
    yield "an extra key", valid | {"verbose": True}, True
    required = [p for p in params if p in valid and p not in ("message",)]
    if tool in ("list_dir", "grep"):
        required = [p for p in required if p != "path"]
    for param in required:
        yield f"{param} missing", {k: v for k, v in valid.items() if k != param}, True
    for shape in ([], "echo ok", None, 3):
        yield f"arguments that are {type(shape).__name__}", shape, True


TOOLS = ToolsConfig.model_validate(
    {
        "default": "everything",
        "toolset": {
            "everything": {"include": ["python"], "tools": ["echo", "judge"]},
        },
        "tool": [
            {"id": "echo", "version": 1, "exec": {"argv": ["cat"]}},
            {
                "id": "judge",
                "version": 1,
                "exec": {
                    "argv": ["sh", "-c", 'cat >/dev/null; echo \'{"content": "judged"}\''],
                    "protocol": "json",
                },
            },
        ],
    }
)


def scenario():
    record = {"id": "hostile", "user": "Break out.", "metadata": {"env": {"setup": SETUP}}}
    record["metadata"]["env"]["files"] = {"notes.txt": "hello\n"}
    return parse_scenario(record, "s.jsonl:1")


def outside_untouched() -> None:
    """No hostile write landed outside the workspace."""
    assert not Path("/tmp/retrograd-escape-target").exists()


@pytest.fixture
def local(tmp_path):
    (tmp_path / "work").mkdir()
    env = SandboxEnvironment(LocalPool(parent=tmp_path / "work"), load_catalog(TOOLS, tmp_path))
    yield env
    env.close()


@pytest.fixture
def container(cli, tmp_path):  # noqa: F811 (the fixture imported above)
    from retrograd.agent.container import ContainerPool

    pool = ContainerPool(spec(), None, cli=cli)
    env = SandboxEnvironment(pool, load_catalog(TOOLS, tmp_path))
    yield env
    env.close()


def every_hostile_call_is_answered(env: SandboxEnvironment) -> None:
    episode = env.open(scenario(), 0)
    try:
        for tool in BUILTINS:
            for what, arguments, refused in hostile_calls(tool):
                obs = episode.step(tool, arguments)
                assert isinstance(obs, Observation), (tool, what)
                if refused:
                    assert obs.is_error and not obs.done, (tool, what, obs)
                    assert len(obs.content) < 1000, (tool, what)  # never the argument echoed whole
                obs.content.encode()  # always text
                if obs.done:  # submit with a message that is only data: a fresh episode
                    episode.close()
                    episode = env.open(scenario(), 0)
            for name, arguments in _valid(tool):  # the episode goes on
                arguments = arguments or BUILTINS[name][3]
                assert episode.step(name, arguments).is_error is False, tool
            outside_untouched()
        for tool in ("echo", "judge"):
            for what, arguments in ARGUMENT_CASES.items():
                assert episode.step(tool, arguments).is_error, (tool, what)
            assert episode.step(tool, {"a": "\x00"}).is_error is False
        for name in ("no_such_tool", "\ud800", "x" * 100_000, ""):
            # NOTE: the rollout answers unknown names before an episode sees them (quoted)
            obs = episode.step(name, {})
            assert obs.is_error and obs.content.encode()
        for inside in ("in-link/f", "f-link"):  # symlinks that stay inside are followed
            assert episode.step("read_file", {"path": inside}).content == "inside\n"
        assert "file inner/f" in episode.step("list_dir", {"path": "in-link"}).content.replace(
            "in-link", "inner"
        )
        assert episode.step("bash", {"command": "echo alive"}).content.endswith("alive\n")
    finally:
        episode.close()


def _valid(tool: str) -> list[tuple[str, dict]]:
    """Calls that succeed after the hostile ones (submit would end the episode)."""
    if tool == "submit":
        return [("list_dir", {})]
    if tool == "edit_file":  # the hostile calls with data arguments edited notes.txt
        return [("write_file", {"path": "notes.txt", "content": "hello\n"}), ("edit_file", {})]
    return [(tool, BUILTINS[tool][3])]


def test_every_hostile_call_is_an_observation_in_a_local_environment(local):
    every_hostile_call_is_answered(local)


@pytest.mark.slow
def test_every_hostile_call_is_an_observation_in_a_container(container):
    every_hostile_call_is_answered(container)


def test_refusals_name_the_argument_and_the_fault(local):
    episode = local.open(scenario(), 0)
    try:
        said = {
            what: episode.step(tool, args).content
            for what, tool, args in [
                ("nul", "bash", {"command": "a\x00b"}),
                ("surrogate", "write_file", {"path": "a", "content": "\ud800"}),
                ("long", "bash", {"command": ENORMOUS}),
                ("extra", "read_file", {"path": "notes.txt", "verbose": True}),
                ("symlink", "read_file", {"path": "host-file"}),
                ("deep", "echo", {"a": deep(100_000)}),
            ]
        }
    finally:
        episode.close()
    assert said["nul"] == "argument 'command' holds a NUL byte, which a command line cannot carry"
    assert said["surrogate"] == "argument 'content' holds a lone surrogate, which is not text"
    assert said["long"] == "argument 'command' is too long (1000000 bytes; at most 100000)"
    assert said["extra"] == "unknown argument 'verbose'; read_file takes path"
    assert said["symlink"] == "path 'host-file' leads outside the workspace"
    assert said["deep"] == "arguments nested more than 64 levels deep"


def test_a_write_through_a_symlink_lands_nowhere(local, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    episode = local.open(scenario(), 0)
    try:
        episode.step("bash", {"command": f"ln -s {outside} out && ln -s {outside}/new new"})
        for path in ("out/x", "new", "out/a/b/c"):
            obs = episode.step("write_file", {"path": path, "content": "escaped"})
            assert obs.is_error, path
        assert episode.step(
            "edit_file", {"path": "out/x", "old_string": "a", "new_string": "b"}
        ).is_error
    finally:
        episode.close()
    assert list(outside.iterdir()) == []


# --- HTTP ------------------------------------------------------------------------------------


@pytest.fixture
def server():
    with env_server() as env:
        yield env


def http(server) -> HttpEnvironment:
    return HttpEnvironment(HttpConfig.model_validate({"type": "http", "base_url": server.url}))


def test_http_arguments_that_cannot_be_sent_never_reach_the_server(server):
    env = http(server)
    episode = env.open(parse_scenario({"id": "c", "user": "count"}, "s.jsonl:1"), 0)
    try:
        for what, arguments in {
            **ARGUMENT_CASES,
            "a lone surrogate": {"text": "\ud800"},
            "infinity": {"by": math.inf},
            "a list": [1],
            "a string": '{"by": 1}',
            "null": None,
        }.items():
            obs = episode.step("echo", arguments)
            assert obs.is_error and "arguments" in obs.content, what
        for name in ("\ud800", "x" * 100_000):
            obs = episode.step(name, {})
            assert obs.is_error and len(obs.content) < 1000
        assert server.routes().count("/step") == 0
        assert episode.step("echo", {"text": "a\x00b"}).content == "a\x00b"  # NUL is text
    finally:
        episode.close()
        env.close()


@pytest.mark.parametrize(
    "reply,outcome",
    [
        ('{"result": {"content": "x\\ud800y"}}', "x\ufffdy"),
        ('{"result": {"content": "ok"}, "reward": 1e999}', "finite"),
        ('{"result": {"content": "ok"}, "reward": NaN}', "finite"),
        ('{"result": {"content": "ok"}, "reward": 1' + "0" * 400 + "}", "finite"),
        ('{"result": {"content": "ok"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON"),
    ],
)
def test_a_hostile_http_reply_is_text_or_a_failure_of_the_environment(server, reply, outcome):
    env = http(server)
    episode = env.open(parse_scenario({"id": "c", "user": "count"}, "s.jsonl:1"), 0)
    server.raw_step = reply
    try:
        if outcome.startswith("x"):
            assert episode.step("echo", {"text": "a"}).content == outcome
        else:
            with pytest.raises(EnvironmentFailure, match=outcome):
                episode.step("echo", {"text": "a"})
    finally:
        server.raw_step = None
        episode.close()
        env.close()


# --- MCP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub():
    agent = AgentSection.model_validate(
        {"scenarios": "s.jsonl", "mcp_servers": [{"name": "calc", "command": stdio_command()}]}
    )
    with McpHub.open(agent, ROOT) as hub:
        yield hub


def test_mcp_arguments_that_cannot_be_sent_are_observations(hub):
    for what, arguments in {
        **ARGUMENT_CASES,
        "a lone surrogate": {"text": "\ud800"},
        "a list": ["x"],
        "null": None,
    }.items():
        obs = hub.call("calc__echo", arguments)
        assert obs.is_error and "arguments" in obs.content, what
    for what, arguments in {
        "a wrong type": {"a": "one", "b": 2},
        "a missing key": {"a": 1},
        "a huge integer": {"a": 10**100, "b": [1]},
    }.items():
        obs = hub.call("calc__add", arguments)
        assert obs.is_error, what
    assert hub.call("\ud800", {}).is_error
    assert hub.call("calc__echo", {"text": "a\x00b"}).content == "a\x00b"
    # the session goes on
    assert hub.call("calc__add", {"a": 2, "b": 3}) == Observation("5")


def test_concurrent_hostile_calls_keep_the_hub(hub):
    out: list = []

    def go(k: int) -> None:
        out.append(hub.call("calc__echo", {"text": "\ud800"} if k % 2 else {"text": str(k)}))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(o.is_error for o in out) == 4
    assert json.dumps([o.content for o in out])
