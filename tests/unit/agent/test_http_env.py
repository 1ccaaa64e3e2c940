"""HttpEnvironment against a real environment server (tests/factories/env_server.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from retrograd.agent.http_env import TRUNCATED, HttpEnvironment, cap_text, reply_limit
from retrograd.agent.scenarios import parse_scenario
from retrograd.agent.types import Observation, ToolSpec
from retrograd.config.agent import HttpEnvironment as HttpConfig
from retrograd.errors import EnvironmentFailure
from tests.factories.env_server import TOOLS, env_server


@pytest.fixture
def server():
    with env_server() as env:
        yield env


def environment(server, **keys) -> HttpEnvironment:
    return HttpEnvironment(
        HttpConfig.model_validate({"type": "http", "base_url": server.url, **keys})
    )


def scenario(**metadata):
    return parse_scenario(
        {"id": "count", "user": "Count to the target.", "metadata": metadata}, "s.jsonl:1"
    )


def bodies(server, path):
    return [json.loads(c["body"]) for c in server.calls if c["path"] == path]


def test_tools_are_fetched_once_per_run(server):
    env = environment(server)
    expected = [ToolSpec(t["name"], t["description"], t["input_schema"]) for t in TOOLS]
    assert env.catalog() == expected
    env.open(scenario(), 0).close()
    env.open(scenario(), 1).close()
    assert env.catalog() == expected
    assert server.routes().count("/tools") == 1
    assert env.grades(scenario())
    env.close()


def test_reset_sends_the_scenario_and_seed(server):
    env = environment(server)
    s = scenario(target=2)
    episode = env.open(s, 7)
    assert episode.opening is None  # null keeps the group's turn 0 shared
    assert bodies(server, "/reset") == [{"scenario": s.as_json(), "seed": 7}]
    assert episode.tools == env.catalog()
    greeted = env.open(scenario(greet=True, target=5), 8)
    assert greeted.opening == "counter 0, target 5"
    env.close()


def test_steps_carry_rewards_until_done(server):
    env = environment(server)
    episode = env.open(scenario(target=3), 0)
    assert episode.step("add", {"by": 1}) == Observation("counter 1", reward=0.1)
    assert episode.step("echo", {"text": "ab", "times": 2}) == Observation("ab" * 2)
    assert episode.step("add", {"by": 2}) == Observation("counter 3", reward=1.0, done=True)
    calls = [b["call"] for b in bodies(server, "/step")]
    assert calls == [
        {"id": "call_0", "name": "add", "arguments": {"by": 1}},
        {"id": "call_1", "name": "echo", "arguments": {"text": "ab", "times": 2}},
        {"id": "call_2", "name": "add", "arguments": {"by": 2}},
    ]
    assert {b["env_id"] for b in bodies(server, "/step")} == {"env-0"}
    assert episode.verify() is None  # the step rewards carry the reward
    assert episode.summary() == "counter=3 seed=0"
    assert episode.state()["cumulative_reward"] == pytest.approx(1.1)
    env.close()


def test_error_results_and_unknown_tools(server):
    env = environment(server)
    episode = env.open(scenario(), 0)
    observation = episode.step("echo", {"text": "oops"})
    assert observation == Observation("echo refuses oops", is_error=True)
    assert observation.text() == "ERROR: echo refuses oops"
    assert episode.step("jump", {}) == Observation("unknown tool 'jump'", is_error=True)
    assert len(bodies(server, "/step")) == 1  # the unknown tool never reached the server
    env.close()


def test_state_404_is_no_state(server):
    env = environment(server)
    episode = env.open(scenario(no_state=True), 0)
    assert episode.state() is None
    assert episode.summary() is None
    episode.close()
    env.close()


def test_close_is_sent_once(server):
    env = environment(server)
    episode = env.open(scenario(), 0)
    episode.close()
    episode.close()
    assert bodies(server, "/close") == [{"env_id": "env-0"}]
    assert server.closed == ["env-0"]
    env.close()


@pytest.mark.parametrize("status", [404, 410])
def test_a_lost_instance_fails_the_trajectory(server, status):
    env = environment(server)
    episode = env.open(scenario(), 0)
    if status == 410:
        server.gone.add("env-0")
    else:
        server.games.clear()
    with pytest.raises(EnvironmentFailure) as e:
        episode.step("add", {"by": 1})
    message = str(e.value)
    assert f"scenario count: POST {server.url}/step: HTTP {status}" in message
    assert "gone" in message
    if status == 410:
        with pytest.raises(EnvironmentFailure, match=f"GET {server.url}/state/env-0: HTTP 410"):
            episode.summary()
    else:
        assert episode.summary() is None  # 404 on /state means "no state"
    with pytest.raises(EnvironmentFailure, match=f"POST {server.url}/close: HTTP {status}"):
        episode.close()
    env.close()


def test_a_malformed_step_reply_fails_the_trajectory(server):
    env = environment(server)
    episode = env.open(scenario(), 0)
    server.bad_step = True
    with pytest.raises(EnvironmentFailure, match=r'/step: expected \{"result"'):
        episode.step("add", {"by": 1})
    env.close()


@pytest.mark.parametrize("levels", [900, 100_000])
def test_a_reply_nested_too_deep_fails_the_trajectory_naming_the_limit(server, levels):
    # 900 levels parse, then overflow whatever reads them recursively (a judge's prompt)
    env = environment(server)
    episode = env.open(scenario(), 0)
    server.raw_step = '{"result": {"content": "ok"}, "x": ' + "[" * levels + "]" * levels + "}"
    try:
        with pytest.raises(
            EnvironmentFailure, match="/step: the answer is JSON nested more than 64"
        ):
            episode.step("add", {"by": 1})
    finally:
        server.raw_step = None
        env.close()


def test_timeout_names_the_route(server):
    env = environment(server, request_timeout_secs=0.2)
    episode = env.open(scenario(), 0)
    server.step_delay = 1.0
    with pytest.raises(EnvironmentFailure, match=r"POST .*/step: no answer within 0\.2 s"):
        episode.step("add", {"by": 1})
    env.close()


def _within(seconds: float, call):
    """What `call()` returns or raises, run in a thread: a call still running after `seconds`
    fails the test (it would hang the run) instead of hanging the suite."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_reply_that_drips_forever_times_out_as_a_whole(server):
    # httpx's timeout bounds each read, not the reply: a byte every 0.05 s kept the trajectory
    # (and the update it belongs to) waiting forever
    env = environment(server, request_timeout_secs=0.5)
    episode = env.open(scenario(), 0)
    server.drip_step = 0.05
    try:
        started = time.monotonic()
        with pytest.raises(EnvironmentFailure, match=r"POST .*/step: no answer within 0\.5 s"):
            _within(10, lambda: episode.step("add", {"by": 1}))
        assert time.monotonic() - started < 3
    finally:
        server.drip_step = None
        env.close()


def test_a_reply_larger_than_the_limit_fails_the_trajectory(server):
    # read whole before: a reply as large as the server cared to send (64 MiB here, endless
    # from a broken server) was held in the trainer's memory, then cut to max_result_bytes
    env = environment(server, max_result_bytes=10)
    episode = env.open(scenario(), 0)
    limit = reply_limit(env.config)
    assert limit == 16 << 20  # 16 MiB, or 8 x max_result_bytes when that is more
    server.raw_step = '{"result": {"content": "' + "x" * (limit + 1) + '"}}'
    try:
        with pytest.raises(EnvironmentFailure, match=rf"/step: the answer is over {limit} bytes"):
            episode.step("add", {"by": 1})
        server.raw_step = '{"result": {"content": "' + "x" * (limit - 100) + '"}}'
        assert episode.step("add", {"by": 1}).content == "x" * 10 + TRUNCATED
    finally:
        server.raw_step = None
        env.close()


def test_the_reset_observation_is_capped_like_a_result(server):
    env = environment(server, max_result_bytes=10)
    server.raw_reset = '{"env_id": "e", "observation": "' + "y" * 50 + '"}'
    try:
        episode = env.open(scenario(), 0)
        assert episode.opening == "y" * 10 + TRUNCATED
    finally:
        server.raw_reset = None
        env.close()


def test_an_unreachable_server_names_the_url():
    config = HttpConfig.model_validate(
        {"type": "http", "base_url": "http://127.0.0.1:9", "connect_timeout_secs": 1.0}
    )
    env = HttpEnvironment(config)
    with pytest.raises(EnvironmentFailure, match=r"GET http://127.0.0.1:9/tools: ConnectError"):
        env.catalog()
    env.close()


def test_results_are_capped(server):
    env = environment(server, max_result_bytes=10)
    episode = env.open(scenario(), 0)
    observation = episode.step("echo", {"text": "x", "times": 50})
    assert observation.content == "x" * 10 + TRUNCATED
    assert episode.step("echo", {"text": "short"}).content == "short"
    env.close()


def test_cap_never_splits_a_character():
    assert cap_text("ééé", 3) == "é" + TRUNCATED
    assert cap_text("ééé", 6) == "ééé"


def test_headers_go_with_every_request(server):
    env = environment(server, headers={"Authorization": "Bearer t0k", "X-Run": "r1"})
    episode = env.open(scenario(), 0)
    episode.step("add", {"by": 1})
    episode.summary()
    episode.close()
    assert server.routes() == ["/tools", "/reset", "/step", "/state/env-0", "/close"]
    for call in server.calls:
        assert call["headers"]["authorization"] == "Bearer t0k"
        assert call["headers"]["x-run"] == "r1"
    env.close()


def test_pool_size_bounds_the_connections(server):
    env = environment(server, pool_size=2)
    episodes = [env.open(scenario(target=10), i) for i in range(4)]
    server.step_delay = 0.3
    results: dict[int, Observation] = {}

    def step(i: int) -> None:
        results[i] = episodes[i].step("add", {"by": i})

    threads = [threading.Thread(target=step, args=(i,)) for i in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 2 * 0.3  # two at a time: at least two rounds
    assert [results[i].content for i in range(4)] == [f"counter {i}" for i in range(4)]
    env.close()
