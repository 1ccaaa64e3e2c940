"""Reward functions in Python (rewards/callables.py): TRL's call shape, the weighted sum beside
a reward program, and every way a function can fail, each a RewardError as a failing program's
batch is (formats.md §2)."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from retrograd.data.prompts import read_prompts, render_prompts
from retrograd.errors import ConfigError, DataError, RetrogradError, RewardError
from retrograd.rewards.callables import RewardFunctions, Rewards, arguments, open_rewards
from retrograd.rewards.program import RewardProgram, RewardReply, RewardRequest

RECORDS = [
    {"messages": [{"role": "user", "content": "plural of cat?"}], "answer": "cats"},
    {"messages": [{"role": "user", "content": "plural of mouse?"}], "answer": "mice", "n": 2},
]
REQUESTS = [
    RewardRequest("plural of cat?", "cats", RECORDS[0]),
    RewardRequest("plural of cat?", "cat", RECORDS[0]),
    RewardRequest("plural of mouse?", "mice", RECORDS[1]),
]


def exact(prompts, completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def length(completions, **kwargs):
    return [len(c) for c in completions]


def test_a_function_gets_the_records_the_completions_and_the_other_keys_as_columns():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, kwargs=kwargs)
        return [0.0] * len(completions)

    RewardFunctions([spy]).values(REQUESTS)
    assert seen["prompts"] == [RECORDS[0], RECORDS[0], RECORDS[1]]
    assert seen["completions"] == ["cats", "cat", "mice"]
    assert seen["kwargs"] == {"answer": ["cats", "cats", "mice"], "n": [None, None, 2]}


def test_a_function_may_change_what_it_is_given_without_changing_the_next_call():
    def vandal(prompts, completions, **kwargs):
        for p in prompts:
            p["answer"] = "wrong"
            p["messages"].clear()
        return [1.0] * len(prompts)

    functions = RewardFunctions([vandal, exact])
    assert functions.values(REQUESTS) == [2.0, 1.0, 2.0]
    assert REQUESTS[0].record == RECORDS[0] and RECORDS[0]["answer"] == "cats"
    assert RECORDS[0]["messages"] == [{"role": "user", "content": "plural of cat?"}]


def test_a_request_without_a_record_gets_its_user_message_as_one():
    kwargs = arguments([RewardRequest("2 + 2?", "4")])
    assert kwargs == {
        "prompts": [{"messages": [{"role": "user", "content": "2 + 2?"}]}],
        "completions": ["4"],
    }


def test_functions_sum_with_their_weights_and_none_abstains():
    def only_mice(completions, **kwargs):
        return [None if c != "mice" else 10 for c in completions]

    functions = RewardFunctions([exact, length, only_mice], weights=[2.0, 0.5, 1])
    assert functions.values(REQUESTS) == [2.0 + 2.0, 0.0 + 1.5, 2.0 + 2.0 + 10.0]
    assert functions.batches == 1
    rewards = Rewards(None, RewardFunctions([only_mice]))
    with pytest.raises(RewardError, match="batch 0: no reward function scored completion 0"):
        rewards.score(REQUESTS)


def test_numpy_vectors_and_integers_are_numbers_booleans_are_not():
    functions = RewardFunctions([lambda completions, **kw: np.arange(len(completions))])
    assert functions.values(REQUESTS) == [0.0, 1.0, 2.0]
    typed = RewardFunctions([lambda completions, **kw: [np.float32(0.5), np.int64(2), 3]])
    assert typed.values(REQUESTS) == [0.5, 2.0, 3.0]


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ([1.0, math.nan, 0.0], r"value 1 is not finite \(nan\)"),
        ([1.0, 0.0, math.inf], r"value 2 is not finite \(inf\)"),
        ([10**400, 0, 0], r"value 0 is not finite"),
        ([1.0, 2.0], r"returned 2 values for 3 completions"),
        ([1.0, 2.0, 3.0, 4.0], r"returned 4 values for 3 completions"),
        ([True, 0.0, 1.0], r"value 0 is bool True, not a number"),
        ([1.0, "0.5", 1.0], r"value 1 is str '0.5', not a number"),
        ([1.0, [1.0], 1.0], r"value 1 is list \[1.0\], not a number"),
        ("1.0", r"returned str, not a list of numbers"),
        ({"reward": 1.0}, r"returned dict, not a list of numbers"),
        (1.0, r"returned float, not a list of numbers"),
        (None, r"returned NoneType, not a list of numbers"),
    ],
)
def test_a_bad_answer_fails_the_batch_naming_the_function(returned, match):
    def bad(prompts, completions, **kwargs):
        return returned

    functions = RewardFunctions([exact, bad])
    with pytest.raises(RewardError) as caught:
        Rewards(None, functions).score(REQUESTS)
    message = str(caught.value)
    assert message.startswith("reward function ")
    assert "bad (rewards[1]): batch 0: " in message
    assert re.search(match, message), message
    assert isinstance(caught.value, RetrogradError)


@pytest.mark.parametrize(
    ("functions", "weights"),
    [
        ([lambda completions, **kw: [1e308] * len(completions)] * 2, None),  # sum overflows
        ([lambda completions, **kw: [1e308] * len(completions)], [10.0]),  # weight x value
        ([lambda completions, **kw: [1e308] * len(completions)] * 2, [2.0, -1.0]),  # inf - x
    ],
)
def test_finite_values_whose_weighted_sum_overflows_fail_the_batch(functions, weights):
    """Each value is finite, so each passes its own check; the reward they add up to is not."""
    with pytest.raises(RewardError, match=r"rewards: batch 0: completion \d: the reward .* is "):
        Rewards(None, RewardFunctions(functions, weights)).score(REQUESTS)
    huge = RewardFunctions([lambda completions, **kw: [1e308] * len(completions)])
    assert [r.reward for r in Rewards(None, huge).score(REQUESTS)] == [1e308] * 3


def test_a_function_that_raises_fails_the_batch_with_its_exception_as_the_cause():
    calls = []

    def broken(prompts, completions, answer, **kwargs):
        calls.append(1)
        return [1.0 / (2 - len(calls)) for _ in completions]  # the second call divides by 0

    functions = RewardFunctions([exact, broken])
    assert functions.values(REQUESTS) == [2.0, 1.0, 2.0]
    with pytest.raises(RewardError) as caught:
        functions.values(REQUESTS)
    assert str(caught.value) == (
        "reward function broken (rewards[1]): batch 1: raised ZeroDivisionError: "
        "float division by zero"
    )
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_a_function_missing_an_argument_fails_as_it_raises():
    def wants_truth(prompts, completions, truth):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"raised TypeError: .*truth"):
        RewardFunctions([wants_truth]).values(REQUESTS)


def test_an_async_function_is_refused_without_an_unawaited_warning(recwarn):
    async def later(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="async reward functions are not supported"):
        RewardFunctions([later]).values(REQUESTS)
    import gc

    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


@pytest.mark.parametrize(
    ("functions", "weights", "match"),
    [
        ([exact, "exact"], None, r"rewards\[1\] = 'exact': not a function"),
        ([exact], [1.0, 2.0], "2 weights for 1 reward functions"),
        ([exact], [math.nan], r"weight \[0\] = nan: must be a finite number"),
        ([exact], [True], r"weight \[0\] = True: must be a finite number"),
    ],
)
def test_functions_and_weights_are_checked_when_given(functions, weights, match):
    with pytest.raises(ConfigError, match=match):
        RewardFunctions(functions, weights)


def test_no_program_and_no_function_is_refused():
    with pytest.raises(ConfigError, match="no reward program and no reward function"):
        Rewards(None, RewardFunctions([]))
    section = SimpleNamespace(reward_command=None)
    with pytest.raises(ConfigError, match="no reward program and no reward function"):
        open_rewards(section, "[grpo]")


def test_functions_add_to_a_programs_reward_and_keep_its_judge_weight(persistent):
    hooks = "_reply = reply\ndef reply(req):\n    return {**_reply(req), 'judge_weight': 0.25}\n"
    section = SimpleNamespace(
        reward_command=persistent(hooks),
        reward_mode="persistent",
        reward_timeout_seconds=30.0,
        judge=object(),
    )
    with open_rewards(section, "[grpo]", [exact], weights=[10.0]) as rewards:
        assert isinstance(rewards.program, RewardProgram)
        # the test program's reward is the completion's length
        assert rewards.score(REQUESTS) == [
            RewardReply(4.0 + 10.0, 0.25),
            RewardReply(3.0, 0.25),
            RewardReply(4.0 + 10.0, 0.25),
        ]
        assert rewards.score([]) == []


def test_a_program_alone_scores_as_before(persistent):
    section = SimpleNamespace(
        reward_command=persistent(), reward_mode="persistent", reward_timeout_seconds=30.0
    )
    with open_rewards(section, "[ppo]") as rewards:
        assert rewards.functions is None
        assert rewards.score(REQUESTS) == [RewardReply(4.0), RewardReply(3.0), RewardReply(4.0)]


# -- the prompt's record ----------------------------------------------------------------------


class _Chat:
    def prompt_ids(self, messages):
        return [1] * len(json.dumps(messages))


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {**RECORDS[0], "rubric": "exact plural"},
        RECORDS[1],
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path, lines


def test_prompt_lines_keep_their_whole_record_for_reward_functions(tmp_path):
    path, lines = _prompt_file(tmp_path)
    with pytest.raises(DataError, match=r"prompts.jsonl:1: unknown key 'answer'"):
        read_prompts(path)
    file = read_prompts(path, extra_keys=True)
    assert [line.record for line in file.lines] == lines
    prompts = render_prompts(file, _Chat(), ctx=10_000)
    assert [p.record for p in prompts] == lines
    assert prompts[0].rubric == "exact plural" and prompts[1].text == "plural of mouse?"
    requests = [RewardRequest(p.text, "cats", p.record) for p in prompts]
    assert RewardFunctions([exact]).values(requests) == [1.0, 0.0]


def test_a_prompt_line_without_extra_keys_still_carries_its_record(tmp_path):
    path = tmp_path / "p.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    assert read_prompts(path).lines[0].record == line
    assert read_prompts(path, extra_keys=True).lines[0].record == line


def test_a_callable_object_is_named_by_its_class():
    class Judge:
        def __call__(self, prompts, completions, **kwargs):
            return [math.nan] * len(completions)

    with pytest.raises(RewardError, match=r"^reward function Judge \(rewards\[0\]\): batch 0"):
        RewardFunctions([Judge()]).values(REQUESTS)


def test_the_reward_function_of_the_python_page_scores_as_it_says():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "python.md").read_text("utf-8")
    section = page.split("\n## Rewards as Python functions\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/python.md", "exec"), namespace)
    requests = [*REQUESTS, RewardRequest("plural of cat?", "Cats. Many of them.", RECORDS[0])]
    assert RewardFunctions([namespace["plural_ok"]]).values(requests) == [1.0, 0.0, 1.0, 1.0]
