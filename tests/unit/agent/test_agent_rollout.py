"""Agentic rollouts on a tiny model with forced turns: turn rules, masks, contexts, episodes."""

from __future__ import annotations

import json

import pytest
import torch

from retrograd.agent.limits import Limits
from retrograd.agent.rollout import AgentRoller
from retrograd.agent.scenarios import parse_scenario
from tests.factories.agents import EOS, CounterEnvironment, Scripted, call, tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("agent"))[1]


def chat_of(model):
    from retrograd.algorithms.context import chat_format

    return chat_format(model)


def roll(
    model,
    scripts,
    env,
    limits=None,
    target=3,
    keep_kv=None,
    **kw,
):
    limits = limits or Limits(max_turns=4, max_new_tokens_per_turn=64)
    sampler = Scripted(model.decoder, model.tokenizer, scripts)
    roller = AgentRoller(sampler, chat_of(model), limits, environment=env, keep_kv=keep_kv, **kw)
    scenario = parse_scenario(
        {"id": "count", "user": "reach the target", "metadata": {"target": target}}, "s.jsonl:1"
    )
    try:
        [group] = roller.roll([(scenario, sorted(scripts))])
    finally:
        roller.close()
    return group, roller


def test_calls_run_turn_by_turn_and_only_sampled_tokens_are_trained(model):
    scripts = {
        11: [call("add", n=1), call("add", n=2), "done"],
        12: ["plain answer"],
    }
    env = CounterEnvironment()
    group, roller = roll(model, scripts, env)
    a, b = group
    assert a.traj.finish == "no_tool_call" and len(a.traj.turns) == 3
    assert [t.valid for t in a.traj.turns] == [True, True, True]
    assert a.traj.verification.passed and a.traj.final_reward == 1.0 and a.traj.reward == 1.0
    assert [m["role"] for m in a.traj.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert a.traj.messages[2] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "add",
        "content": "total 1",
    }
    assert a.traj.messages[3]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"n": 2}}
    assert b.traj.finish == "no_tool_call" and b.traj.final_reward == 0.0
    assert env.opened == env.closed == 2
    tok = model.tokenizer
    # the mask is 1 exactly on each turn's forced tokens and its end token
    trained = [t for t, m in zip(a.seq, a.mask, strict=True) if m]
    want = []
    for text in scripts[11]:
        want += tok.tokenize(text, add_bos=False, parse_special=True) + [EOS]
    assert trained == want
    assert sum(a.mask) == a.traj.n_tokens and a.seq[: a.prompt_len] == b.seq[: b.prompt_len]
    # what the model read between turns is the template's render of the conversation so far
    chat = chat_of(model)
    text = b"".join(tok.token_to_piece(t, special=True) for t in a.seq[1:]).decode()
    render = chat._strip_bos(chat.render(a.traj.raw_messages(), a.traj.tools))
    # (spaces aside: the vocabulary's space prefix goes after each special token, as llama.cpp)
    assert "".join(text.replace("▁", "").split()) == "".join(render.replace("▁", "").split())
    assert all(lp == 0.0 for lp, m in zip(a.logprobs, a.mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(a.logprobs, a.mask, strict=True) if m)


def test_kept_keys_and_values_change_nothing(model):
    scripts = {11: [call("add", n=1), "done"], 12: [call("add", n=3), "ok"]}
    kept, r1 = roll(model, scripts, CounterEnvironment(), keep_kv=True)
    fresh, r0 = roll(model, scripts, CounterEnvironment(), keep_kv=False)
    for x, y in zip(kept, fresh, strict=True):
        assert x.seq == y.seq and x.mask == y.mask
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-3)
    assert r1.decoder.reused > 0 and r1.decoder.prefilled < r0.decoder.prefilled


def test_failed_turns_limits_and_ends(model):
    scripts = {
        1: [
            "<tool_call>{oops</tool_call>",
            "<tool_call>{bad",
            call("add", n=1),
        ],  # 2 failed in a row
        2: [call("nope"), call("add", n=1), call("finish")],  # unknown tool, then done
        3: [call("add", n=1)] * 5,  # max_turns
        4: ["!cut:" + "x" * 200],  # no end token within the turn's budget
    }
    env = CounterEnvironment(step_reward=0.1)
    limits = Limits(max_turns=3, max_new_tokens_per_turn=80, max_failed_turns=2)
    group, _ = roll(model, scripts, env, limits, target=2)
    finish = {s.traj.seed: s.traj for s in group}
    assert finish[1].finish == "max_failed_turns" and finish[1].invalid_turns == 2
    assert finish[1].messages[2]["role"] == "user" and finish[1].messages[2]["content"].startswith(
        "ERROR: malformed tool call"
    )
    assert finish[2].finish == "done" and finish[2].invalid_turns == 1
    assert (
        finish[2].messages[2]["is_error"]
        and "unknown tool 'nope'" in finish[2].messages[2]["content"]
    )
    assert finish[2].step_rewards == [pytest.approx(0.1)] and finish[2].final_reward == 0.0
    assert finish[3].finish == "max_turns" and finish[3].truncated and len(finish[3].turns) == 3
    assert finish[3].step_rewards == [pytest.approx(0.1)] * 3
    assert finish[4].finish == "max_tokens" and finish[4].turns[0].n_tokens == 80
    assert env.opened == env.closed == 4
    # step rewards sit at the last token of their turn
    s = next(x for x in group if x.traj.seed == 3)
    assert [s.mask[i] for i, _ in s.reward_at] == [1, 1, 1]


def test_environment_failures_fail_the_trajectory_and_close_it(model):
    scripts = {1: [call("add", n=1)], 2: [call("add", n=1)], 3: [call("finish")]}
    env = CounterEnvironment(fail_open_seeds={1}, broken_tool="add")
    group, _ = roll(model, scripts, env)
    by_seed = {s.traj.seed: s.traj for s in group}
    assert by_seed[1].failed and "set-up failed" in by_seed[1].failure
    assert by_seed[2].failed and "broke" in by_seed[2].failure
    assert by_seed[3].finish == "done" and not by_seed[3].failed
    assert env.opened == env.closed == 2


def test_no_call_continues_when_asked_and_deadline_cuts(model):
    scripts = {1: ["thinking", call("add", n=3), "done", "still no call"]}
    limits = Limits(max_turns=4, max_new_tokens_per_turn=64, end_on_no_tool_call=False)
    [s], _ = roll(model, scripts, CounterEnvironment(), limits)
    assert s.traj.finish == "max_turns" and s.traj.invalid_turns == 3
    assert s.traj.messages[2]["role"] == "user" and "no tool call" in s.traj.messages[2]["content"]
    assert not s.traj.turns[0].valid and s.traj.turns[1].valid
    limits = Limits(max_turns=4, max_new_tokens_per_turn=64, max_rollout_secs=1e-9)
    [s], _ = roll(model, {1: [call("add", n=1)] * 4}, CounterEnvironment(), limits)
    assert s.traj.finish == "deadline" and s.traj.truncated


def test_opening_observations_and_system_suffix(model):
    scripts = {1: ["hi"], 2: ["hello"]}
    env = CounterEnvironment(opening="the counter is at 0")
    limits = Limits(max_turns=4, max_new_tokens_per_turn=64, system_suffix=" Be brief.")
    group, _ = roll(model, scripts, env, limits)
    for s in group:
        assert s.traj.messages[:3] == [
            {"role": "system", "content": " Be brief."},
            {"role": "user", "content": "reach the target"},
            {"role": "user", "content": "the counter is at 0"},
        ]
        assert s.traj.tools[0]["function"]["name"] == "add"


TRIMMING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_template_that_trims_turns_still_continues_them_as_sampled(tmp_path):
    """Gemma's template trims what the model wrote: turns ending in whitespace are rendered
    unlike their tokens, at every later turn too; the trajectory goes on and keeps reading
    its own sampled tokens."""
    import retrograd
    from tests.factories.tiny_gguf import write_tiny

    path = write_tiny(tmp_path / "trim.gguf", "gemma3", chat_template=TRIMMING)
    model = retrograd.load(path, device="cpu", dtype=torch.float32)
    scripts = {1: [call("add", n=1) + "\n\n", call("add", n=2) + "\n", "done"]}
    [s], _ = roll(model, scripts, CounterEnvironment())
    assert s.traj.finish == "no_tool_call", s.traj.failure
    assert s.traj.final_reward == 1.0 and len(s.traj.turns) == 3
    trained = [t for t, m in zip(s.seq, s.mask, strict=True) if m]
    tok = model.tokenizer
    want = []
    for text in scripts[1]:
        want += tok.tokenize(text, add_bos=False, parse_special=True) + [EOS]
    assert trained == want  # the trailing newlines stay in what the model read and trains


def test_hostile_calls_are_answered_and_the_trajectories_go_on(model, tmp_path):
    """A local sandbox with real tools: NUL bytes, lone surrogates, nesting past the parser,
    NaN, wrong types, unknown and enormous names and paths out of the workspace are each a
    failed call answered with an error; every trajectory ends as its policy ends it."""
    from retrograd.agent.local import LocalPool
    from retrograd.agent.sandbox_env import SandboxEnvironment
    from retrograd.agent.tools.catalog import load_catalog
    from retrograd.config.agent import ToolsConfig

    deep = call("bash", command=json.loads("[" * 70 + "]" * 70))  # past the depth limit
    nan = '<tool_call>{"name":"bash","arguments":"{\\"command\\": NaN}"}</tool_call>'
    scripts = {
        1: [
            call("bash", command="a\x00b"),
            call("write_file", path="ok", content="\ud800"),
            "done",
        ],
        2: [deep, call("bash", command=["ls"]), "done"],
        3: [call("\ud800"), call("x" * 210), call("read_file", path="../../etc/passwd"), "done"],
        4: [nan, call("bash", command="echo${IFS}survived"), "done"],
    }
    (tmp_path / "work").mkdir()
    short = [  # the built-ins with one-word descriptions: a short prompt for the tiny model
        {"id": f"{f}-short", "version": 1, "name": f, "description": ".", "builtin": {"factory": f}}
        for f in ("write_file", "read_file")
    ]
    short.append({**short[0], "id": "bash-short", "name": "bash", "builtin": {"factory": "shell"}})
    tools = {
        "default": "mini",
        "tool": short,
        "toolset": {"mini": {"tools": [t["id"] for t in short]}},
    }
    catalog = load_catalog(ToolsConfig.model_validate(tools), tmp_path)
    env = SandboxEnvironment(LocalPool(parent=tmp_path / "work"), catalog)
    limits = Limits(max_turns=4, max_new_tokens_per_turn=320, max_trajectory_tokens=4000)
    try:
        group, _ = roll(model, scripts, env, limits)
    finally:
        env.close()
    by_seed = {s.traj.seed: s.traj for s in group}
    for seed, traj in by_seed.items():
        assert traj.finish == "no_tool_call", (seed, traj.finish, traj.failure, traj.messages)
        answers = [m for m in traj.messages[1:-1] if m["role"] in ("tool", "user")]
        assert len(answers) == len(scripts[seed]) - 1
        if seed != 4:
            assert all(m.get("is_error") or m["content"].startswith("ERROR") for m in answers)
        for m in traj.messages:
            json.dumps(m, ensure_ascii=False).encode()  # every message is text
    assert "NUL byte" in by_seed[1].messages[2]["content"]
    assert "lone surrogate" in by_seed[1].messages[4]["content"]
    assert "nested more than 64" in by_seed[2].messages[2]["content"]
    assert len(by_seed[3].messages[4]["content"]) < 600  # the long name is quoted, not echoed
    assert by_seed[4].messages[4]["content"] == "exit code: 0\nstdout:\nsurvived\n"


def test_a_tool_that_raises_fails_its_trajectory_not_the_run(model):
    class Buggy(CounterEnvironment):
        def open(self, scenario, seed):
            episode = super().open(scenario, seed)
            step = episode.step

            def buggy(name, arguments):
                if name == "add":
                    raise ValueError("embedded null byte")
                return step(name, arguments)

            episode.step = buggy
            return episode

    env = Buggy()
    group, _ = roll(model, {1: [call("add", n=1)], 2: [call("finish")]}, env)
    by_seed = {s.traj.seed: s.traj for s in group}
    assert (
        by_seed[1].failed and by_seed[1].failure == "tool add raised ValueError: embedded null byte"
    )
    assert by_seed[2].finish == "done" and not by_seed[2].failed
    assert env.opened == env.closed == 2
