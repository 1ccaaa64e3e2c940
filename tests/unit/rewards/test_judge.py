"""The command judge (formats.md §3.1): oneshot, one process per group, strict replies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from reward_programs import assert_gone, pgids

from retrograd.errors import JudgeError, RewardError
from retrograd.rewards import CommandJudge, RewardRequest, command_judge, judge_request
from retrograd.rewards.judge import open_judge

GROUP = [RewardRequest("task", "a"), RewardRequest("task", "abcd")]


def test_one_process_per_group(oneshot):
    argv = oneshot(
        "_reply = reply\ndef reply(req):\n    return {'reward': _reply(req)['reward'] / 4}\n"
    )
    judge = CommandJudge(argv, timeout=5)
    assert judge.score(GROUP) == [0.25, 1.0]
    assert judge.score(GROUP[:1]) == [0.25]
    assert judge.score([]) == [] and judge.groups == 2
    assert len(set(pgids(argv))) == 2
    assert_gone(argv)


@pytest.mark.parametrize(
    ("hooks", "match"),
    [
        (  # allowed from a reward program, refused from a judge
            "def reply(req):\n    return {'reward': 0.5, 'judge_weight': 1.0}\n",
            'group 0, line 1: unknown key "judge_weight"',
        ),
        ("def reply(req):\n    return {'reward': 0.5, 'why': 'good'}\n", 'unknown key "why"'),
        ("def reply(req):\n    return {'score': 0.5}\n", 'unknown key "score"'),
        ("def reply(req):\n    return '{}'\n", 'missing "reward"'),
        ("def reply(req):\n    return '{\"reward\": NaN}'\n", "not finite"),
        ("def reply(req):\n    return {'reward': 1.0}\nsys.exit(1)\n", "exit status 1"),
        ("def reply(req):\n    return []\n", "0 reply lines for 2 requests"),
    ],
)
def test_bad_verdicts(oneshot, hooks, match):
    argv = oneshot(hooks)
    with pytest.raises(JudgeError, match=match) as caught:
        CommandJudge(argv, where="[agent.judge]").score(GROUP)
    assert str(caught.value).startswith("[agent.judge].command = [")
    assert isinstance(caught.value, RewardError)
    assert_gone(argv)


def test_timeout(oneshot):
    with pytest.raises(JudgeError, match=r"group 0: not finished within timeout_secs = 0.5"):
        CommandJudge(oneshot("time.sleep(30)\n"), timeout=0.5).score(GROUP)


def test_judge_from_a_config_section(oneshot):
    section = SimpleNamespace(type="command", command=oneshot(), timeout_secs=7.0)
    judge = command_judge(section)
    assert judge.timeout == 7.0
    assert judge.score(GROUP) == [1.0, 4.0]
    with pytest.raises(ValueError, match="ruler judge is not a command judge"):
        command_judge(SimpleNamespace(type="ruler"))


def test_judge_request_joins_the_trajectory():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Rain."},
        {"role": "user", "content": "Thanks"},
    ]
    assert judge_request(messages) == RewardRequest(
        "Be brief.\nWeather in Oslo?\nThanks", "\nRain."
    )


def test_open_judge_scores_candidates_like_requests(oneshot, tmp_path):
    """A command judge behind the RulerJudge interface: each candidate flattened with
    judge_request (tool results left out), one process for the group."""
    section = SimpleNamespace(type="command", command=oneshot(), timeout_secs=5.0)
    judge = open_judge(section, "[agent.judge]", tmp_path)
    assert isinstance(judge, CommandJudge)
    opening = [{"role": "user", "content": "task"}]
    candidates = [
        SimpleNamespace(messages=[*opening, {"role": "assistant", "content": "ab"}]),
        SimpleNamespace(
            messages=[
                *opening,
                {"role": "assistant", "content": "abc"},
                {"role": "tool", "content": "a long tool result"},
                {"role": "assistant", "content": "d"},
            ],
            final_state="not shown to a command",
        ),
    ]
    # the default program replies len(completion): "ab" -> 2, "abc\nd" -> 5
    assert judge.score_group(candidates, 7, "rubric unused") == [2.0, 5.0]
    assert judge.groups == 1 and judge.stats() == {}
