"""API rollouts (`collect --api`) against a real scripted OpenAI-compatible server: tool calls
stepped in the episode, error observations, turn-end rules, verification, the key."""

from __future__ import annotations

import json

import openai
import pytest

from retrograd.agent.api_rollout import api_groups, rollout, wire_messages
from retrograd.agent.endpoint import ChatEndpoint, EndpointError, api_key
from retrograd.agent.limits import Limits
from retrograd.errors import ConfigError
from tests.factories.scripted_openai import raw, reply, scripted_openai, status
from tests.unit.agent.counter_env import CounterEnv, scenario


def endpoint(api, **kw) -> ChatEndpoint:
    return ChatEndpoint(api.base_url, "gpt-test", "test-key", timeout=10, backoff=0.0, **kw)


def test_a_trajectory_steps_calls_and_is_verified():
    script = [
        reply("I will add.", calls=[("add", {"n": 2})], completion_tokens=7),
        reply("", calls=[("add", {"n": 1}), ("done", {})], completion_tokens=5),
    ]
    env = CounterEnv()
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, env, scenario(), member=1, seed=11, limits=Limits(temperature=0.3))
        requests = api.requests
    assert t.finish == "done" and t.complete
    assert t.final_reward == 1.0 and t.verification.passed
    assert t.step_rewards == pytest.approx([0.1, 0.1])  # one step reward per turn
    assert t.reward == pytest.approx(1.2)
    assert t.n_tokens == 12 and [turn.n_tokens for turn in t.turns] == [7, 5]
    assert t.generator == "gpt-test" and t.seed == 11 and t.member == 1
    assert env.opened == [("count-3", 11)] and env.closed == 1
    assert t.summary == "counter 3"
    # the record: opening, turns with structured calls, tool messages answering them
    roles = [m["role"] for m in t.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "tool"]
    call = t.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": {"n": 2}}
    assert t.messages[2] == {
        "role": "tool",
        "tool_call_id": call["id"],
        "name": "add",
        "content": "counter = 2",
    }
    assert t.turns[0].text == t.turns[0].content == "I will add."
    # what the endpoint saw: the catalog, the temperature, and the growing conversation
    first, second = requests
    assert [t_["function"]["name"] for t_ in first["tools"]] == ["add", "done", "explode"]
    assert first["temperature"] == 0.3 and first["model"] == "gpt-test" and first["seed"] == 11
    assert first["messages"] == [{"role": "user", "content": "Bring the counter to 3."}]
    sent_call = second["messages"][1]["tool_calls"][0]
    assert json.loads(sent_call["function"]["arguments"]) == {"n": 2}
    assert second["messages"][2]["tool_call_id"] == sent_call["id"]


def test_error_observations_reach_the_model_with_the_prefix():
    script = [reply("", calls=[("add", {"n": "two"})]), reply("Sorry, I give up.")]
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, CounterEnv(), scenario(), 0, 0, Limits())
        requests = api.requests
    assert t.finish == "no_tool_call"
    tool = t.messages[2]
    assert tool["is_error"] is True and tool["content"] == "argument 'n' must be an integer"
    sent = requests[1]["messages"][2]
    assert sent["role"] == "tool" and sent["content"] == "ERROR: argument 'n' must be an integer"
    assert "is_error" not in sent
    assert t.final_reward == 0.0 and not t.verification.passed  # counter stayed at 0
    assert t.invalid_turns == 0  # a tool-level error is not a malformed call


def test_malformed_and_unknown_calls_are_failed_turns():
    script = [
        reply("", calls=[("add", "{not json")]),
        reply("", calls=[("multiply", {"n": 2})]),
        reply("", calls=[("add", {"n": 3})]),
    ]
    env = CounterEnv()
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, env, scenario(), 0, 0, Limits(max_turns=3))
        requests = api.requests
    assert t.finish == "max_turns" and t.truncated
    assert [turn.valid for turn in t.turns] == [False, False, True]
    assert t.invalid_turns == 2
    assert t.verification is None and t.final_reward is None  # truncated: not verified
    answers = [m for m in t.messages if m["role"] == "tool"]
    assert answers[0]["content"] == "arguments of 'add' are not a JSON object"
    assert answers[1]["content"].startswith("unknown tool 'multiply'; the tools are: add, done")
    assert all(a["is_error"] for a in answers[:2])
    assert [s[2] for s in env.steps] == ["add"]  # neither failed call reached the episode
    # the malformed arguments go back to the endpoint as they came
    assert requests[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{not json"


def test_arguments_nested_too_deep_are_a_failed_turn_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    script = [reply("", calls=[("add", '{"n": ' + deep + "}")]), reply("", calls=[("done", {})])]
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, CounterEnv(), scenario(), 0, 0, Limits(max_turns=2))
    assert [turn.valid for turn in t.turns] == [False, True]
    assert t.messages[2]["content"] == "arguments of 'add' are not a JSON object"


def test_an_endpoint_nesting_its_answer_too_deep_is_an_endpoint_error():
    body = '{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": '
    with scripted_openai([raw(body + "[" * 100_000 + "]" * 100_000 + "}")]) as api:
        with endpoint(api) as ep, pytest.raises(EndpointError, match="not a chat completion"):
            ep.complete([{"role": "user", "content": "hi"}])


def test_max_failed_turns_cuts_and_no_call_can_continue():
    script = [reply("thinking"), reply("still thinking"), reply("never")]
    with scripted_openai(script) as api, endpoint(api) as ep:
        limits = Limits(end_on_no_tool_call=False, max_failed_turns=2)
        t = rollout(ep, CounterEnv(), scenario(), 0, 0, limits)
    assert t.finish == "max_failed_turns" and len(t.turns) == 2
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert t.messages[2]["content"].startswith("ERROR: the turn called no tool")


def test_calls_after_done_are_answered_as_not_run():
    script = [reply("", calls=[("done", {}), ("add", {"n": 3})])]
    env = CounterEnv()
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, env, scenario(target=0), 0, 0, Limits())
    assert t.finish == "done" and t.verification.passed
    assert [s[2] for s in env.steps] == ["done"]
    last = t.messages[-1]
    assert last["is_error"] and last["content"].startswith("not run")


def test_environment_failures_fail_the_trajectory_and_close_the_episode():
    env = CounterEnv()
    with scripted_openai([reply("", calls=[("explode", {})])]) as api, endpoint(api) as ep:
        t = rollout(ep, env, scenario(), 0, 0, Limits())
        failed_open = rollout(ep, CounterEnv(fail_open=True), scenario(), 0, 0, Limits())
        assert len(api.requests) == 1  # a failed set-up asks nothing
    assert t.failed and "exploded" in t.failure and env.closed == 1
    assert t.reward is None
    assert failed_open.failed and "set-up failed" in failed_open.failure


def test_groups_use_seed_plus_i_times_k_plus_member():
    env = CounterEnv()
    script = [reply("no")] * 6
    scenarios = [scenario("a", index=0), scenario("b", index=1), scenario("c", index=2)]
    with scripted_openai(script) as api, endpoint(api) as ep:
        groups = list(api_groups(ep, env, scenarios, k=2, seed=100, limits=Limits()))
    assert [[t.seed for t in g] for g in groups] == [[100, 101], [102, 103], [104, 105]]
    assert [[t.member for t in g] for g in groups] == [[0, 1]] * 3
    assert [g[0].scenario.id for g in groups] == ["a", "b", "c"]


def test_system_suffix_and_environment_opening():
    s = scenario(system="Be brief.")
    with scripted_openai([reply("ok")]) as api, endpoint(api) as ep:
        t = rollout(
            ep,
            CounterEnv(opening="The counter is at 0."),
            s,
            0,
            0,
            Limits(system_suffix=" Always."),
        )
        sent = api.requests[0]["messages"]
    assert sent == [
        {"role": "system", "content": "Be brief. Always."},
        {"role": "user", "content": "Bring the counter to 3."},
        {"role": "user", "content": "The counter is at 0."},
    ]
    assert t.messages == [*sent, {"role": "assistant", "content": "ok"}]


def test_transient_errors_are_retried_and_others_are_not():
    with scripted_openai([status(500), status(429), reply("fine")]) as api:
        with endpoint(api, max_retries=2) as ep:
            assert ep.complete([{"role": "user", "content": "hi"}])["content"] == "fine"
        assert len(api.requests) == 3
    with scripted_openai([status(500), status(500)]) as api, endpoint(api, max_retries=1) as ep:
        with pytest.raises(EndpointError, match="failed 2 times; last: HTTP 500"):
            ep.complete([{"role": "user", "content": "hi"}])
    with scripted_openai([status(400, "bad tools"), reply("never")]) as api:
        with endpoint(api, max_retries=3) as ep, pytest.raises(EndpointError, match="bad tools"):
            ep.complete([{"role": "user", "content": "hi"}])
        assert len(api.requests) == 1
    with scripted_openai([reply("x")], key="other") as api, endpoint(api) as ep:
        with pytest.raises(EndpointError, match="HTTP 401"):
            ep.complete([{"role": "user", "content": "hi"}])


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("RETRO_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"\[agent.collect_api\].api_key_env = RETRO_TEST_KEY"):
        api_key("RETRO_TEST_KEY", "[agent.collect_api]")
    monkeypatch.setenv("RETRO_TEST_KEY", "sk-1")
    assert api_key("RETRO_TEST_KEY", "[agent.collect_api]") == "sk-1"


def test_wire_messages_are_what_the_openai_sdk_sends():
    """The conversation we send equals what the openai SDK sends for the same turns."""
    script = [reply("", calls=[("add", {"n": "x"})]), reply("done")]
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, CounterEnv(), scenario(), 0, 0, Limits())
        ours = api.requests[1]["messages"]
    assert ours == wire_messages(t.messages[:3])
    with scripted_openai([reply("ok")]) as api:
        client = openai.OpenAI(base_url=api.base_url, api_key="test-key")
        answer = client.chat.completions.create(model="gpt-test", messages=ours)
        assert answer.choices[0].message.content == "ok"
        assert api.requests[0]["messages"] == ours


def completion(message: str) -> str:
    """A chat completion's body around `message`, raw JSON text (escapes kept as written)."""
    return '{"choices": [{"index": 0, "message": ' + message + "}], " + '"usage": {}}'


def test_hostile_replies_are_failed_turns_and_the_record_is_text():
    script = [
        raw(
            completion(
                r'{"role": "assistant", "content": "x\ud800y", "tool_calls": [{"id": "a", '
                r'"type": "function", "function": {"name": "add", '
                r'"arguments": "{\"n\": \"\\ud800\"}"}}]}'
            )
        ),
        raw(
            completion(
                '{"role": "assistant", "content": ["x"], "tool_calls": [5, {"function": 3}, '
                '{"id": ["x"], "function": {"name": ["add"], "arguments": {"n": NaN}}}, '
                '{"function": {"name": "\\udc80", "arguments": "{}"}}]}'
            )
        ),
        reply("", calls=[("add", {"n": 3})]),
        reply("Done."),
    ]
    env = CounterEnv()
    with scripted_openai(script) as api, endpoint(api) as ep:
        t = rollout(ep, env, scenario(), 0, 0, Limits(max_turns=4))
        requests = api.requests
    assert t.finish == "no_tool_call" and t.final_reward == 1.0
    assert [turn.valid for turn in t.turns] == [False, False, True, True]
    assert t.turns[0].content == "x\ufffdy" and t.turns[1].content == ""
    assert len(requests) == 4  # every request after a hostile reply was sent
    assert [s[2] for s in env.steps] == ["add"]  # no hostile call reached the episode
    json.dumps(t.messages, ensure_ascii=False).encode()  # the record is text
    sent = requests[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == '{"n": "\\ud800"}'  # malformed arguments go back as they came
