"""Trajectories written by an OpenAI-compatible endpoint (`retrograd collect --api`).

The endpoint gets the episode's catalog as the `tools` parameter and answers with
`tool_calls`; each call is stepped in the episode and answered with a tool message (a failed
call's content is shown with the "ERROR: " prefix, as Observation.text() writes it). Turns end
as in a local rollout (formats.md §4.4): a turn without a call ends the trajectory (or, with
end_on_no_tool_call = false, is answered with an error and counts as a failed turn),
max_failed_turns failed turns in a row, max_turns and max_rollout_secs (checked between
turns and before each call) truncate it, and a call whose observation says done (or submit)
ends it; the calls after it are answered as not run. A malformed call or an unknown tool is a
failed turn, answered with an error, as are arguments no tool can take (a lone surrogate,
NaN, nesting past 64 levels) and calls that are not objects; whatever the endpoint's strings
hold, the record is text (a lone surrogate reads U+FFFD). A complete trajectory is
verified; only the environment grades (final reward = the verification's reward). Turns are
structured: `Turn.text` is the message content, without call markup. Knows the wire format and
the Episode interface, not models, templates or tokens (`n_tokens` is the usage's completion
tokens when the endpoint reports them, else 0).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from retrograd import nesting
from retrograd.agent.endpoint import ChatEndpoint
from retrograd.agent.limits import Limits
from retrograd.agent.scenarios import Scenario
from retrograd.agent.trajectory import Trajectory, Turn
from retrograd.agent.types import (
    ERROR_PREFIX,
    Environment,
    Episode,
    Observation,
    quoted,
)
from retrograd.errors import EnvironmentFailure
from retrograd.text import as_text
from retrograd.tokenizer.toolcalls import argument_problem

NO_CALL = "the turn called no tool; call one of the tools to go on"
SKIPPED = "not run: the trajectory ended at an earlier call of this turn"


def api_groups(
    endpoint: ChatEndpoint,
    environment: Environment,
    scenarios: list[Scenario],
    k: int,
    seed: int,
    limits: Limits,
) -> Iterator[list[Trajectory]]:
    """k trajectories per scenario, one scenario at a time; scenario i's member j is rolled
    out from seed + i × k + j."""
    for i, scenario in enumerate(scenarios):
        base = seed + i * k
        yield [rollout(endpoint, environment, scenario, j, base + j, limits) for j in range(k)]


def rollout(
    endpoint: ChatEndpoint,
    environment: Environment,
    scenario: Scenario,
    member: int,
    seed: int,
    limits: Limits,
) -> Trajectory:
    """One trajectory; an environment failure ends it as "failed" (never written)."""
    start = time.monotonic()
    t = Trajectory(scenario, member, seed, [], scenario.opening(limits.system_suffix))
    t.generator = endpoint.model
    try:
        episode = environment.open(scenario, seed)
    except EnvironmentFailure as e:
        t.finish, t.failure = "failed", str(e)
        return t
    try:
        t.tools = [spec.openai() for spec in episode.tools]
        if episode.opening:
            t.messages.append({"role": "user", "content": episode.opening})
        t.finish = _turns(endpoint, episode, t, limits, start)
        if t.complete:
            t.verification = episode.verify()
            t.final_reward = None if t.verification is None else t.verification.reward
        t.summary = episode.summary()
    except EnvironmentFailure as e:
        t.finish, t.failure = "failed", str(e)
    finally:
        episode.close()
        t.seconds = time.monotonic() - start
    return t


def _turns(endpoint, episode: Episode, t: Trajectory, limits: Limits, start: float) -> str:
    """Run turns until one ends the trajectory; returns its finish."""
    names = {spec.name for spec in episode.tools}
    failed_in_a_row = 0
    for _ in range(limits.max_turns):
        if limits.max_rollout_secs and time.monotonic() - start > limits.max_rollout_secs:
            return "deadline"
        reply = endpoint.complete(
            wire_messages(t.messages),
            tools=t.tools or None,
            temperature=limits.temperature,
            seed=t.seed,
        )
        turn, message = _turn(reply, names, _call_count(t))
        t.turns.append(turn)
        t.messages.append(message)
        if not turn.calls and turn.valid:
            if limits.end_on_no_tool_call:
                return "no_tool_call"
            turn.valid = False
            t.messages.append({"role": "user", "content": ERROR_PREFIX + NO_CALL})
        else:
            deadline = start + limits.max_rollout_secs if limits.max_rollout_secs else None
            finish = _step_calls(episode, t, turn, names, deadline)
            if finish is not None:
                return finish
        failed_in_a_row = 0 if turn.valid else failed_in_a_row + 1
        if limits.max_failed_turns and failed_in_a_row >= limits.max_failed_turns:
            return "max_failed_turns"
    return "max_turns"


def _call_count(t: Trajectory) -> int:
    return sum(len(turn.calls) for turn in t.turns)


def _turn(reply: dict, names: set[str], counter: int) -> tuple[Turn, dict]:
    """The Turn and the record-shaped assistant message of one reply. A call whose arguments
    are not a JSON object, or that names no offered tool, makes the turn invalid; it is still
    answered (with an error) so that the conversation stays well formed."""
    content = _text(reply.get("content"))
    calls, wire_calls, valid = [], [], True
    tool_calls = reply.get("tool_calls") or []
    for k, c in enumerate(tool_calls if isinstance(tool_calls, list) else []):
        c = c if isinstance(c, dict) else {}
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        name = _text(fn.get("name"))
        raw_args = fn.get("arguments", "{}")
        try:
            args = raw_args if isinstance(raw_args, dict) else nesting.loads(raw_args or "{}")
            ok = isinstance(args, dict) and argument_problem(args) is None
        except (TypeError, ValueError):
            args, ok = None, False
        valid = valid and ok and name in names
        cid = _text(c.get("id")) or f"call_{counter + k}"
        calls.append({"id": cid, "name": name, "arguments": args if ok else {}, "ok": ok})
        # malformed arguments go back as they came when they are text (nothing else can)
        sent = args if ok else _text(raw_args)
        wire_calls.append(
            {"id": cid, "type": "function", "function": {"name": name, "arguments": sent}}
        )
    usage = reply.get("_usage") or {}
    turn = Turn(content, content, calls, valid, int(usage.get("completion_tokens") or 0))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if wire_calls:
        message["tool_calls"] = wire_calls
    return turn, message


def _step_calls(
    episode: Episode, t: Trajectory, turn: Turn, names: set[str], deadline: float | None
) -> str | None:
    """Step each call in order and append its tool message; the finish when one ends the
    trajectory. Calls after the one that ended the episode are answered as not run, so that
    every call of the record has its answer."""
    finish, reward = None, None
    for call in turn.calls:
        ok = call.pop("ok")
        if finish is None and deadline is not None and time.monotonic() > deadline:
            finish = "deadline"
        if finish is not None:
            obs = Observation(SKIPPED, is_error=True)
        elif not ok:
            obs = Observation(f"arguments of '{quoted(call['name'])}' are not a JSON object", True)
        elif call["name"] not in names:
            known = ", ".join(sorted(names)) or "none"
            obs = Observation(
                f"unknown tool '{quoted(call['name'])}'; the tools are: {known}", True
            )
        else:
            obs = episode.step(call["name"], call["arguments"])
            if obs.reward is not None:
                reward = (reward or 0.0) + obs.reward
            if obs.done:
                finish = "submitted" if call["name"] == "submit" else "done"
        tool = {"role": "tool", "tool_call_id": call["id"], "name": call["name"]}
        tool["content"] = obs.content
        if obs.is_error:
            tool["is_error"] = True
        turn.observations.append(tool)
        t.messages.append(tool)
    if reward is not None:  # one step reward per turn, as a local rollout records it
        t.step_rewards.append(reward)
    return finish


def _text(value: Any) -> str:
    """A string an endpoint sent, as text (a lone surrogate made U+FFFD); "" for anything
    else, which no field of a record can hold."""
    return as_text(value) if isinstance(value, str) else ""


def wire_messages(messages: list[dict]) -> list[dict]:
    """Record-shaped messages as the chat completions API takes them: arguments as JSON
    strings, a failed observation's content with its "ERROR: " prefix, no record-only keys."""
    out = []
    for m in messages:
        w: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            w["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments_text(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            w["tool_call_id"] = m["tool_call_id"]
            if m.get("is_error"):
                w["content"] = ERROR_PREFIX + w["content"]
        out.append(w)
    return out


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
