"""The example reward programs in examples/rewards/, spoken to in both modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrograd.rewards import RewardProgram, RewardRequest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "rewards"

ARITHMETIC = [  # prompt, completion, expected reward
    ("Calculate 14 + 7. Reply with exactly one number.", "21", 1.0),
    ("Calculate 14 + 7.", "The answer is 23, I think", 1 / 3),
    ("What is 3 + 4 × 5?", "23", 1.0),
    ("What is 3 + 4 * 5?", "35", 1 / 13),
    ("Compute 10 - 4 - 3.", "3", 1.0),
    ("Compute 8 - 2 * 3", "2", 1.0),
    ("Compute 2 * 3 - 1", "5", 1.0),
    ("Compute 12 ÷ 4 + 1", "4", 1.0),
    ("Compute 7 / 2", "3", 1 / 1.5),
    ("Compute 6 × 7 ÷ 3", "-14", 1 / 29),
    ("Calculate 5 - -3.", "8", 1.0),
    ("Calculate 6 * 8.", "no idea", 0.0),
    ("Say hello.", "42", 0.0),
    ("Compute 1 / 0", "0", 0.0),
]


@pytest.mark.parametrize("mode", ["persistent", "oneshot"])
def test_arithmetic(mode):
    argv = [sys.executable, str(EXAMPLES / "arithmetic.py")]
    requests = [RewardRequest(p, c) for p, c, _ in ARITHMETIC]
    with RewardProgram(argv, mode=mode, timeout=20) as program:
        rewards = [r.reward for r in program.score(requests)]
        assert rewards == pytest.approx([want for _, _, want in ARITHMETIC])
        assert program.score(requests[:1])[0].reward == 1.0


def test_length_rewards_short_answers_with_the_word():
    argv = [sys.executable, str(EXAMPLES / "length.py"), "--words", "4", "--require", "arr"]
    answers = ["Arr, matey!", "arr " * 8, "arr " * 12, "Hello there", "arr " * 20]
    with RewardProgram(argv, timeout=20) as program:
        rewards = [r.reward for r in program.score([RewardRequest("p", a) for a in answers])]
    assert rewards == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_the_reward_of_the_grpo_and_ppo_examples():
    argv = [sys.executable, str(EXAMPLES.parent / "data" / "reward.py")]
    requests = [
        RewardRequest("Calculate 14 + 7. Reply with exactly one number.", "21"),
        RewardRequest("Calculate 6 * 8. Reply with exactly one number.", "47"),
    ]
    with RewardProgram(argv, timeout=20) as program:
        assert [r.reward for r in program.score(requests)] == [1.0, 0.0]


PLURALS = [  # prompt, completion, expected reward
    ("Plural of cat:", "cats", 1.0),
    ("Plural of cat:", " Cats.\n", 1.0),
    ("Plural of box:", "boxes and more", 0.75),
    ("Plural of city:", "cities\nand towns", 1.0),  # the first line is read, as harnesses do
    ("Plural of city:", "cities and\ntowns", 0.75),
    ("Plural of cat:", "cats!!!", 0.75),  # one final "." or "!" at most
    ("Plural of cat:", "cats. \n", 1.0),
    ("Plural of city:", "cities", 1.0),
    ("Plural of city:", "citys", 0.0),
    ("Plural of key:", "keys", 1.0),
    ("Plural of church:", "churches", 1.0),
    ("Plural of bush:", "bush bush", 0.25),
    ("Plural of bush:", "the bushes", 0.0),
    ("Say hello.", "hellos", 0.0),
    ("Plural of cat:", "", 0.0),
]


def test_plurals_climbs_its_ladder():
    """The reward of the GRPO and PPO examples (examples/grpo/plurals.toml), on the answer's
    first line: the plural alone 1, the plural then more 0.75, the word copied 0.25, anything
    else 0."""
    argv = [sys.executable, str(EXAMPLES / "plurals.py")]
    with RewardProgram(argv, timeout=20) as program:
        rewards = [r.reward for r in program.score([RewardRequest(p, c) for p, c, _ in PLURALS])]
    assert rewards == [want for _, _, want in PLURALS]


def test_every_example_prompt_has_a_plural_the_program_knows():
    """The example's prompt files end with a question the program parses, and the solved turns
    before it agree with the program's rule."""
    import json

    sys.path.insert(0, str(EXAMPLES))
    try:
        from plurals import QUESTION, plural
    finally:
        sys.path.remove(str(EXAMPLES))
    for name in ("plurals.jsonl", "plurals-eval.jsonl"):
        for line in (EXAMPLES.parent / "grpo" / name).read_text().splitlines():
            messages = json.loads(line)["messages"]
            assert QUESTION.search(messages[-1]["content"]), line
            for question, answer in zip(messages[:-1:2], messages[1::2], strict=True):
                assert plural(QUESTION.search(question["content"])[1]) == answer["content"]
