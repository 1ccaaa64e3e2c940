"""Agentic scoring with an LLM judge (formats.md §3.5, §1.6): a ruler judge against the scripted
OpenAI-compatible endpoint sees each group's trajectories with their final states, under the
scenario's own rubric, in the order its group id fixes; a failing group is dropped."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from retrograd.agent.rollout import AgentSample
from retrograd.agent.scenarios import Scenario
from retrograd.agent.scores import score_groups
from retrograd.agent.trajectory import Trajectory
from retrograd.config.judge import RulerJudge as RulerSection
from retrograd.rewards.judge import group_id, open_judge
from retrograd.rewards.ruler.prompt import permutation
from tests.factories.scripted_openai import reply, scripted_openai, status


def shown(body: dict) -> list[dict]:
    text = body["messages"][0]["content"]
    return json.loads(text.split("<trajectories>\n", 1)[1].split("\n</trajectories>", 1)[0])


def verdict(body: dict):
    """Scores each trajectory by the "q=<x>" of its final state."""
    scores = [
        {
            "trajectory_id": t["trajectory_id"],
            "explanation": "",
            "score": float(t["final_state"].split("q=")[1]),
        }
        for t in shown(body)
    ]
    return reply(json.dumps({"scores": scores}))


def group(scenario: Scenario, states: list[str]) -> list[AgentSample]:
    out = []
    for k, state in enumerate(states):
        messages = [*scenario.opening(), {"role": "assistant", "content": f"attempt {k}"}]
        traj = Trajectory(scenario, k, k, [], messages, summary=state)
        out.append(AgentSample(traj, [], 0, [], []))
    return out


def test_a_ruler_judge_scores_agentic_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_JUDGE_KEY", "test-key")
    graded = Scenario("s.jsonl:1", 0, "fix", "Fix the bug.", metadata={"rubric": "Tests pass?"})
    plain = Scenario("s.jsonl:2", 1, "other", "Do it.")
    rolled = [group(graded, ["q=0.2", "q=0.9", "q=0.5", "q=0.7"]), group(plain, ["q=1", "q=0"])]
    cfg = SimpleNamespace(agent=SimpleNamespace(judge_failure="drop_group"))
    cfg.agent.drop_degenerate_groups = False

    # the two groups are judged at once, so either request may arrive first: the reply follows
    # the request (the graded group's rubric gets a verdict, the other an HTTP 400)
    def answer(body: dict):
        graded_group = body["messages"][0]["content"].startswith("Tests pass?")
        return verdict(body) if graded_group else status(400)

    with scripted_openai([answer, answer]) as api:
        raw = {
            "type": "ruler",
            "base_url": api.base_url,
            "model": "judge",
            "api_key_env": "AGENT_JUDGE_KEY",
        }
        judge = open_judge(RulerSection.model_validate(raw), "[agent.judge]", tmp_path)
        arena = SimpleNamespace(environment=None, judge=judge)
        metrics = score_groups(cfg, arena, rolled, update=3)
    assert [s.traj.final_reward for s in rolled[0]] == [0.2, 0.9, 0.5, 0.7]
    first, second = sorted(  # the graded group's request first
        api.requests, key=lambda b: not b["messages"][0]["content"].startswith("Tests pass?")
    )
    prompt = first["messages"][0]["content"]
    assert prompt.startswith("Tests pass?")  # metadata.rubric over the built-in rubric
    order = [t["trajectory_id"] for t in shown(first)]
    assert order == permutation(group_id(3, 0), 0, 4)
    assert not second["messages"][0]["content"].startswith("Tests pass?")
    # HTTP 400 is not retried: the second group is dropped, unscored
    assert all(s.traj.final_reward is None and s.judge_dropped for s in rolled[1])
    assert metrics["judge/dropped_group_fraction"] == 0.5
    assert metrics["judge/score_mean"] == pytest.approx((0.2 + 0.9 + 0.5 + 0.7) / 4)
    assert metrics["judge/requests"] == 2
