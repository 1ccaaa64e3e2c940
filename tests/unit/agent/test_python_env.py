"""An agentic run's environment and verify function in Python (agent/python_env.py): what the
caller's code raises or answers wrong fails its trajectory as a failing environment does,
never the run; a verify function sees the scenario, the calls and the workspace."""

from __future__ import annotations

import logging
import math

import pytest

from retrograd.agent.arena import Arena
from retrograd.agent.limits import Limits
from retrograd.agent.python_env import (
    PythonEnvironment,
    VerifiedEnvironment,
    VerifyRequest,
    Workspace,
)
from retrograd.agent.rollout import AgentRoller
from retrograd.agent.scenarios import parse_scenario
from retrograd.agent.types import ExecResult, Observation, Sandbox, Verification
from retrograd.config import validate_run
from retrograd.errors import ConfigError, DataError, EnvironmentFailure
from tests.factories.agents import (
    ADD,
    FINISH,
    CounterEnvironment,
    CounterEpisode,
    Scripted,
    call,
    tiny_chat_model,
)

SCENARIO = parse_scenario(
    {"id": "count", "user": "reach the target", "metadata": {"target": 3}}, "s.jsonl:1"
)


class Plain:
    """A duck-typed environment (no base class) whose episodes answer as told."""

    def __init__(self, step=None, verify=None, summary="state", **methods):
        self.answer, self.verdict, self.state = step, verify, summary
        self.__dict__.update(methods)

    def open(self, scenario, seed):
        return PlainEpisode(self)


class PlainEpisode:
    tools = [ADD]

    def __init__(self, env):
        self.env = env

    def step(self, name, arguments):
        answer = self.env.answer
        return answer(name, arguments) if callable(answer) else answer

    def verify(self):
        verdict = self.env.verdict
        return verdict() if callable(verdict) else verdict

    def summary(self):
        return self.env.state

    def close(self):
        pass


def failure(fn, *args) -> EnvironmentFailure:
    with pytest.raises(EnvironmentFailure) as caught:
        fn(*args)
    return caught.value


# -- a caller's environment ---------------------------------------------------------------------


def test_a_plain_object_with_open_is_an_environment_with_the_defaults():
    env = PythonEnvironment(Plain(step="ok", verify=None))
    episode = env.open(SCENARIO, 1)
    assert episode.step("add", {"n": 1}) == Observation("ok")  # text is an observation
    assert episode.tools == [ADD] and episode.opening is None
    assert episode.verify() is None and episode.summary() == "state"
    assert env.grades(SCENARIO) is False and env.catalog() == [] and env.metrics() == {}
    env.check_scenarios([SCENARIO])
    env.close()


def test_what_the_callers_environment_raises_fails_the_trajectory_naming_it():
    def broken(name, arguments):
        raise KeyError(name)

    episode = PythonEnvironment(Plain(step=broken)).open(SCENARIO, 1)
    error = failure(episode.step, "add", {"n": 1})
    assert str(error) == "scenario count: environment Plain step 'add' raised KeyError: 'add'"
    assert isinstance(error.__cause__, KeyError)

    class Refuses(Plain):
        def open(self, scenario, seed):
            raise OSError("no room")

    error = failure(PythonEnvironment(Refuses()).open, SCENARIO, 1)
    assert str(error) == "scenario count: environment Refuses.open raised OSError: no room"
    # an EnvironmentFailure of the caller's own passes as it is
    env = PythonEnvironment(CounterEnvironment(fail_open_seeds={7}))
    assert str(failure(env.open, SCENARIO, 7)) == "scenario count: set-up failed"


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (3, r"step 'add' returned 3, not an Observation or text"),
        (None, r"step 'add' returned None, not an Observation or text"),
        (Observation("x", reward=math.nan), r"step 'add' gave the reward nan, not a finite"),
        (Observation("x", reward=True), r"step 'add' gave the reward True, not a finite"),
    ],
)
def test_a_wrong_step_answer_fails_the_trajectory(answer, match):
    episode = PythonEnvironment(Plain(step=answer)).open(SCENARIO, 1)
    with pytest.raises(EnvironmentFailure, match=match):
        episode.step("add", {"n": 1})


@pytest.mark.parametrize(
    ("verdict", "match"),
    [
        (1.0, r"Plain.verify returned 1.0, not a Verification or None"),
        (Verification(math.inf, True), r"Plain.verify gave the reward inf"),
    ],
)
def test_a_wrong_verdict_fails_the_trajectory(verdict, match):
    episode = PythonEnvironment(Plain(verify=verdict)).open(SCENARIO, 1)
    with pytest.raises(EnvironmentFailure, match=match):
        episode.verify()


def test_wrong_answers_of_the_other_methods_are_named():
    env = PythonEnvironment(Plain(grades=lambda s: "yes", catalog=lambda s: ["add"]))
    assert "returned 'yes', not a bool" in str(failure(env.grades, SCENARIO))
    assert "must be a list of ToolSpec" in str(failure(env.catalog, SCENARIO))

    class NoClose:
        tools = [ADD]

        def step(self, name, arguments):
            return "ok"

    env = PythonEnvironment(Plain(open=lambda scenario, seed: NoClose()))
    assert "returned an episode without close()" in str(failure(env.open, SCENARIO, 1))
    env = PythonEnvironment(Plain(summary=5))
    assert "must return text or None" in str(failure(env.open(SCENARIO, 1).summary))
    with pytest.raises(ConfigError, match="an environment has open"):
        PythonEnvironment(object())


def test_checks_before_the_run_keep_data_errors_and_name_bugs():
    def check(scenarios, require_verify):
        raise DataError("s.jsonl:1: no such task")

    with pytest.raises(DataError, match="no such task"):
        PythonEnvironment(Plain(check_scenarios=check)).check_scenarios([SCENARIO])
    env = PythonEnvironment(Plain(check_scenarios=lambda scenarios, required: 1 / 0))
    with pytest.raises(EnvironmentFailure, match="check_scenarios raised ZeroDivisionError"):
        env.check_scenarios([SCENARIO])


def test_bad_metrics_are_logged_and_left_out(caplog):
    env = PythonEnvironment(Plain(metrics=lambda: {"env/x": 1, "env/y": 2.5}))
    assert env.metrics() == {"env/x": 1.0, "env/y": 2.5}
    env = PythonEnvironment(Plain(metrics=lambda: {"env/x": math.nan}))
    with caplog.at_level(logging.WARNING):
        assert env.metrics() == {}
    assert "no env/* values this update" in caplog.text


# -- verify functions ---------------------------------------------------------------------------


class FakeSandbox(Sandbox):
    workdir = "/work"

    def __init__(self):
        self.ran = []

    def exec(self, argv, stdin=None, timeout=None):
        self.ran.append(argv)
        return ExecResult(0, b"42\n", b"")

    def close(self):
        raise AssertionError("a verify function cannot close the sandbox")


def test_a_verify_function_sees_the_scenario_the_calls_the_workspace_and_the_own_verdict():
    seen: list[VerifyRequest] = []
    sandbox = FakeSandbox()

    class Boxed(CounterEnvironment):
        def open(self, scenario, seed):
            episode = super().open(scenario, seed)
            episode.sandbox = sandbox
            return episode

    def verify(request):
        seen.append(request)
        return float(request.workspace.exec(["cat", "answer"]).stdout)

    env = VerifiedEnvironment(Boxed(), verify)
    episode = env.open(SCENARIO, 1)
    arguments = {"n": 2}
    episode.step("add", arguments)
    arguments["n"] = 99  # the record keeps what was called
    episode.step("add", {"n": 1})
    assert episode.verify() == Verification(42.0, True)
    [request] = seen
    assert request.scenario == {
        "id": "count",
        "user": "reach the target",
        "metadata": {"target": 3},
    }
    assert [(c.name, c.arguments, c.observation) for c in request.calls] == [
        ("add", {"n": 2}, "total 2"),
        ("add", {"n": 1}, "total 3"),
    ]
    assert request.verification == Verification(1.0, True, "total 3")  # the counter's own
    assert isinstance(request.workspace, Workspace) and request.workspace.workdir == "/work"
    assert not hasattr(request.workspace, "close") and sandbox.ran == [["cat", "answer"]]
    assert env.grades(parse_scenario({"id": "x", "user": "u"}, "s.jsonl:2"))


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (0.5, Verification(0.5, True)),
        (0, Verification(0.0, False)),
        (True, Verification(1.0, True)),
        (False, Verification(0.0, False)),
        (Verification(0.25, False, "why"), Verification(0.25, False, "why")),
        (None, Verification(1.0, True, "total 3")),  # the environment's own verdict
    ],
)
def test_a_verify_answer_becomes_the_verdict(answer, expected):
    episode = VerifiedEnvironment(CounterEnvironment(), lambda request: answer).open(SCENARIO, 1)
    episode.step("add", {"n": 3})
    assert episode.verify() == expected


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (math.nan, r"verify function <lambda> gave the reward nan"),
        ("1.0", r"verify function <lambda> gave the reward '1.0'"),
        ([1.0], r"gave the reward \[1.0\]"),
        (Verification(-math.inf, False), r"gave the reward -inf"),
    ],
)
def test_a_wrong_verify_answer_fails_the_trajectory(answer, match):
    episode = VerifiedEnvironment(CounterEnvironment(), lambda request: answer).open(SCENARIO, 1)
    with pytest.raises(EnvironmentFailure, match=match):
        episode.verify()


def test_a_verify_function_that_raises_fails_the_trajectory():
    def verify(request):
        raise RuntimeError("checker crashed")

    episode = VerifiedEnvironment(CounterEnvironment(), verify).open(SCENARIO, 1)
    error = failure(episode.verify)
    assert (
        str(error) == "scenario count: verify function verify raised RuntimeError: checker crashed"
    )
    assert isinstance(error.__cause__, RuntimeError)
    with pytest.raises(ConfigError, match="not a function"):
        VerifiedEnvironment(CounterEnvironment(), "verify.py")


# -- in a run -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("python-env"))[1]


def roll(model, scripts, env):
    from retrograd.algorithms.context import chat_format

    limits = Limits(max_turns=3, max_new_tokens_per_turn=64)
    sampler = Scripted(model.decoder, model.tokenizer, scripts)
    roller = AgentRoller(sampler, chat_format(model), limits, environment=env)
    try:
        [group] = roller.roll([(SCENARIO, sorted(scripts))])
    finally:
        roller.close()
    return {s.traj.seed: s.traj for s in group}


def test_a_buggy_python_environment_fails_trajectories_and_the_rollout_goes_on(model):
    class Buggy(CounterEnvironment):
        def open(self, scenario, seed):
            episode = super().open(scenario, seed)
            if seed == 2:
                episode.step = lambda name, arguments: 1 / 0
            if seed == 3:
                episode.step = lambda name, arguments: {"content": "not an observation"}
            return episode

    def verify(request):
        if len(request.calls) > 1:
            raise ValueError("too many calls")
        return len(request.calls) == 1

    env = VerifiedEnvironment(PythonEnvironment(Buggy()), verify)
    scripts = {
        1: [call("add", n=3), "done"],
        2: [call("add", n=1), "done"],
        3: [call("add", n=1), "done"],
        4: [call("add", n=1), call("add", n=2), "done"],
    }
    trajs = roll(model, scripts, env)
    assert trajs[1].finish == "no_tool_call" and trajs[1].final_reward == 1.0
    assert trajs[1].verification == Verification(1.0, True)
    assert trajs[2].finish == "failed"
    assert trajs[2].failure == (
        "scenario count: environment Buggy step 'add' raised ZeroDivisionError: division by zero"
    )
    assert trajs[3].finish == "failed" and "not an Observation or text" in trajs[3].failure
    assert trajs[4].finish == "failed"
    assert trajs[4].failure == (
        "scenario count: verify function verify raised ValueError: too many calls"
    )


# -- the arena --------------------------------------------------------------------------------


def agent_cfg(tmp_path, supplied=("environment", "verify"), **agent):
    doc = {
        "run": {"algorithm": "agent_grpo"},
        "model": {"path": "m.gguf"},
        "output": {"path": "out.gguf"},
        "lora": {},
        "agent": {"scenarios": "s.jsonl", **agent},
    }
    return validate_run(doc, base_dir=tmp_path, supplied=supplied)


def test_the_arena_takes_a_python_environment_and_verify_function(tmp_path):
    arena = Arena(agent_cfg(tmp_path), tmp_path, environment=CounterEnvironment(), verify=bool)
    try:
        assert isinstance(arena.environment, VerifiedEnvironment)
        assert isinstance(arena.environment.inner, PythonEnvironment)
        assert arena.signature() == {
            "environment": "CounterEnvironment",
            "verify": ("verify function bool"),
        }
        episode = arena.environment.open(SCENARIO, 1)
        assert episode.tools == [ADD, FINISH] and isinstance(episode.inner.inner, CounterEpisode)
        episode.close()
    finally:
        arena.close()
    with pytest.raises(ConfigError, match="a Python verify function checks the episodes"):
        cfg = agent_cfg(tmp_path, supplied=(), judge={"type": "command", "command": ["j"]})
        Arena(cfg, tmp_path, verify=bool)
    local = {"type": "local", "allow_unsandboxed": True, "tools": {"default": "base"}}
    with pytest.raises(ConfigError, match="a Python environment is given too"):
        cfg = agent_cfg(tmp_path, supplied=(), environment=local)
        Arena(cfg, tmp_path, environment=CounterEnvironment())


def test_a_verify_function_reads_a_local_workspace(tmp_path):
    local = {"type": "local", "allow_unsandboxed": True, "tools": {"default": "base"}}
    scenario = parse_scenario(
        {
            "id": "file",
            "user": "write 42 to answer",
            "metadata": {"env": {"verify": {"command": ["test", "-s", "answer"]}}},
        },
        "s.jsonl:1",
    )
    answers = []

    def verify(request):
        result = request.workspace.exec(["cat", "answer"])
        answers.append(result.stdout)
        return result.stdout.strip() == b"42" and request.verification.passed

    arena = Arena(agent_cfg(tmp_path, ("verify",), environment=local), tmp_path, verify=verify)
    try:
        episode = arena.environment.open(scenario, 1)
        try:
            obs = episode.step("write_file", {"path": "answer", "content": "42\n"})
            assert not obs.is_error, obs.content
            assert episode.verify() == Verification(1.0, True)
        finally:
            episode.close()
    finally:
        arena.close()
    assert answers == [b"42\n"]


def test_the_environment_of_the_python_page_runs_guarded():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "python.md").read_text("utf-8")
    section = page.split("\n## Environments and verify functions in Python\n", 1)[1]
    blocks = [part.split("```", 1)[0] for part in section.split("```python\n")[1:3]]
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "docs/python.md", "exec"), namespace)
    env = PythonEnvironment(namespace["CounterEnvironment"]())
    episode = env.open(SCENARIO, 1)
    assert episode.step("add", {"n": 3}) == Observation("total 3")
    assert episode.verify() == Verification(1.0, True) and env.grades(SCENARIO)
    sandbox = FakeSandbox()
    request = VerifyRequest({"id": "x"}, (), Workspace(sandbox), None)
    assert namespace["answer_is_42"](request) is True
