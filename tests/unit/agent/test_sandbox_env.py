"""The local environment end to end: a scenario's files and setup, its toolset, tool calls,
verify and summary, and the sandbox handed back on close."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrograd.agent.local import LocalPool, local_environment
from retrograd.agent.sandbox_env import SandboxEnvironment
from retrograd.agent.scenarios import parse_scenario
from retrograd.agent.tools.catalog import load_catalog
from retrograd.agent.types import Observation, Verification
from retrograd.config.agent import LocalEnvironment, ToolsConfig
from retrograd.errors import DataError, EnvironmentFailure

FIX_ADD = {
    "files": {"calc.py": "def add(a, b):\n    return a - b\n", "tests/README": "run me\n"},
    "setup": ["echo prepared > setup.log", "mkdir -p build"],
    "verify": {
        "command": ["python3", "-c", "import calc; assert calc.add(2, 3) == 5"],
        "reward_on_success": 2.5,
    },
    "summary": ["cat", "calc.py"],
    "toolset": "python",
}


def scenario(env: dict | None = None, sid: str = "fix-add", index: int = 0):
    record = {"id": sid, "user": "Fix add."}
    if env is not None:
        record["metadata"] = {"env": env}
    return parse_scenario(record, f"scenarios.jsonl:{index + 1}", index)


def environment(tmp_path: Path, **keys) -> SandboxEnvironment:
    tools = ToolsConfig.model_validate({"default": "base", "scenario_toolsets": ["python"]})
    catalog = load_catalog(tools, tmp_path)
    return SandboxEnvironment(LocalPool(parent=tmp_path / "work"), catalog, **keys)


@pytest.fixture
def env(tmp_path):
    (tmp_path / "work").mkdir()
    environment_ = environment(tmp_path, setup_timeout_secs=20.0, verify_timeout_secs=20.0)
    yield environment_
    environment_.close()


def test_files_setup_tools_verify_summary(env, tmp_path):
    s = scenario(FIX_ADD)
    assert env.grades(s) and not env.grades(scenario())
    assert [t.name for t in env.catalog(s)][-2:] == ["python", "run_tests"]
    episode = env.open(s, seed=7)
    try:
        assert [t.name for t in episode.tools] == [t.name for t in env.catalog(s)]
        assert episode.step("list_dir", {}).content == (
            "dir  build\nfile calc.py (32 bytes)\nfile setup.log (9 bytes)\ndir  tests"
        )
        assert episode.step("read_file", {"path": "tests/README"}) == Observation("run me\n")
        failing = episode.verify()
        assert failing.reward == 0.0 and not failing.passed
        assert "AssertionError" in failing.output
        edit = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
        assert episode.step("edit_file", edit) == Observation("edited 'calc.py'")
        assert episode.step("submit", {}) == Observation("submitted", done=True)
        assert episode.step("bash", {"command": "true"}).is_error  # nothing after the end
        assert episode.verify() == Verification(2.5, True, "exit code: 0\n")
        assert episode.summary() == "def add(a, b):\n    return a + b"
    finally:
        episode.close()
    assert list((tmp_path / "work").iterdir()) == []  # the workspace went with the close
    episode.close()  # idempotent


def test_episodes_do_not_share_a_workspace(env):
    one, two = env.open(scenario(FIX_ADD), 0), env.open(scenario(FIX_ADD), 1)
    try:
        one.step("write_file", {"path": "mine", "content": "1"})
        assert two.step("read_file", {"path": "mine"}).content == "cannot read 'mine'"
    finally:
        one.close()
        two.close()


def test_unknown_tools_and_bad_arguments_are_observations(env):
    episode = env.open(scenario(), 0)  # no env task: the default toolset, an empty workspace
    try:
        assert episode.verify() is None and episode.summary() is None
        assert episode.step("python", {"code": "1"}) == Observation("unknown tool 'python'", True)
        assert episode.step("bash", ["ls"]).content == "arguments must be a JSON object"
        assert episode.step("list_dir", {}).content == "(empty)"
    finally:
        episode.close()


def test_setup_failure_names_scenario_and_command(env, tmp_path):
    broken = scenario({"setup": ["true", "echo boom >&2; exit 3"]}, sid="broken")
    with pytest.raises(EnvironmentFailure) as error:
        env.open(broken, 0)
    message = str(error.value)
    assert "scenario broken" in message and "'echo boom >&2; exit 3'" in message
    assert "exit code 3: boom" in message
    assert list((tmp_path / "work").iterdir()) == []  # released despite the failure


def test_setup_timeout(tmp_path):
    (tmp_path / "work").mkdir()
    env = environment(tmp_path, setup_timeout_secs=0.5)
    try:
        with pytest.raises(EnvironmentFailure, match="scenario slow: setup command 'sleep 30'"):
            env.open(scenario({"setup": ["sleep 30"]}, sid="slow"), 0)
    finally:
        env.close()


def test_verify_timeout_fails_the_verdict(tmp_path):
    (tmp_path / "work").mkdir()
    env = environment(tmp_path, verify_timeout_secs=0.5)
    episode = env.open(scenario({"verify": {"command": ["sleep", "30"]}}), 0)
    try:
        verdict = episode.verify()
        assert verdict.reward == 0.0 and not verdict.passed
        assert verdict.output.startswith("command timed out and was killed")
    finally:
        episode.close()
        env.close()


def test_toolset_must_be_selectable(env):
    good = [scenario(FIX_ADD), scenario({"toolset": "base"}, "b", 1), scenario(None, "c", 2)]
    env.check_scenarios(good)
    bad = scenario({"toolset": "typescript"}, "ts", 3)
    with pytest.raises(DataError, match=r"scenarios.jsonl:4: metadata.env.toolset = 'typescript'"):
        env.check_scenarios([*good, bad])
    with pytest.raises(EnvironmentFailure, match="scenario ts: toolset 'typescript'"):
        env.open(bad, 0)
    with pytest.raises(DataError, match="scenarios.jsonl:3: scenario c has no metadata.env.verify"):
        env.check_scenarios([good[0], good[2]], require_verify=True)


def test_a_broken_tool_fails_the_trajectory_naming_the_scenario(tmp_path):
    tools = ToolsConfig.model_validate(
        {
            "default": "t",
            "tool": [
                {
                    "id": "judge",
                    "version": 1,
                    "exec": {"argv": ["echo", "not json"], "protocol": "json"},
                },
                {
                    "id": "finish",
                    "version": 1,
                    "exec": {
                        "argv": ["echo", '{"content": "bye", "done": true}'],
                        "protocol": "json",
                    },
                },
            ],
            "toolset": {"t": {"tools": ["judge", "finish"]}},
        }
    )
    env = SandboxEnvironment(LocalPool(parent=tmp_path), load_catalog(tools, tmp_path))
    episode = env.open(scenario(sid="json"), 0)
    try:
        with pytest.raises(EnvironmentFailure, match="scenario json: exec tool 'judge' broke"):
            episode.step("judge", {})
        assert episode.step("finish", {}) == Observation("bye", done=True)
    finally:
        episode.close()
        env.close()


def test_local_environment_from_the_config_section(tmp_path):
    (tmp_path / "check.sh").write_text('echo "{\\"content\\": \\"checked\\"}"\n')
    section = LocalEnvironment.model_validate(
        {
            "type": "local",
            "allow_unsandboxed": True,
            "verify_timeout_secs": 5.0,
            "tools": {
                "default": "c",
                "tool": [
                    {
                        "id": "check",
                        "version": 1,
                        "exec": {"argv": ["sh", "-c"], "script": "check.sh", "protocol": "json"},
                    }
                ],
                "toolset": {"c": {"include": ["base"], "tools": ["check"]}},
            },
        }
    )
    env = local_environment(section, tmp_path)  # inline scripts resolve against it
    try:
        assert env.verify_timeout_secs == 5.0 and env.setup_timeout_secs == 300.0
        assert env.pool.exec_timeout == 30.0 and env.pool.max_output_bytes == 65536
        episode = env.open(scenario(), 0)
        assert episode.step("check", {}) == Observation("checked")
        episode.close()
    finally:
        env.close()


def test_env_metrics_count_acquires_timeouts_and_broken_sandboxes(tmp_path):
    (tmp_path / "work").mkdir()
    env = environment(tmp_path, setup_timeout_secs=20.0)
    try:
        assert env.metrics()["env/acquire_ms_mean"] == 0.0
        episode = env.open(scenario(), seed=0)
        episode.step("bash", {"command": "true"})
        episode.sandbox.exec(["sleep", "5"], timeout=0.2)  # as a tool would: timed out
        episode.close()
        with pytest.raises(EnvironmentFailure):
            env.open(scenario({"setup": ["exit 3"]}, sid="broken"), seed=0)
        m = env.metrics()
        assert m["env/sandbox_broken_fraction"] == 0.5  # one of two episodes
        assert m["env/exec_timeout_fraction"] == pytest.approx(1 / 3)  # bash, sleep, setup
        assert m["env/acquire_ms_mean"] > 0 and m["env/pool_reuse_fraction"] == 0.0
        assert env.metrics()["env/sandbox_broken_fraction"] == 0.0  # counted once
    finally:
        env.close()
