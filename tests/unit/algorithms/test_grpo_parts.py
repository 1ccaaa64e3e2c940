"""Parts of the GRPO loop that need no model: the prompt stream, the passes, prompt files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrograd.data.prompts import Prompt, read_prompts
from retrograd.errors import DataError
from retrograd.rollout.passes import pieces as _pieces
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import PromptStream, held_out


def prompt(i: int, n: int = 5) -> Prompt:
    return Prompt(f"p.jsonl:{i + 1}", i, ({"role": "user", "content": "x"},), "x", (1,) * n)


def answer(p: Prompt, group: int, member: int, n: int) -> Rollout:
    return Rollout(p, 1, group, member, 0, (7,) * n, "", False, np.zeros(n, np.float32))


def test_prompt_stream_sequential_and_shuffled():
    prompts = [prompt(i) for i in range(5)]
    seq = PromptStream(prompts, "sequential", 3)
    assert [seq.at(c).index for c in range(12)] == [0, 1, 2, 3, 4] * 2 + [0, 1]
    shuf = PromptStream(prompts, "shuffled", 3)
    first, second = [shuf.at(c).index for c in range(5)], [shuf.at(c).index for c in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5))  # each pass covers the file once
    assert first != second or first != list(range(5))
    again = PromptStream(prompts, "shuffled", 3)
    assert [again.at(c).index for c in range(10)] == first + second  # a pure function


def test_pieces_fan_out_a_group_where_two_answers_fit():
    p0, p1 = prompt(0, 10), prompt(1, 10)
    trained = [answer(p0, 0, j, 6) for j in range(4)] + [answer(p1, 1, j, 30) for j in range(3)]
    pieces = _pieces(trained, budget=40, fanout=True)
    shared = [pc.members for pc in pieces if pc.shared]
    rows = [pc.members for pc in pieces if not pc.shared]
    # group 0: 10 + 6 x 4 = 34 tokens fit in one pass; group 1: 10 + 30 x 2 > 40, so rows
    assert shared == [(0, 1, 2, 3)]
    assert rows == [(4,), (5,), (6,)]  # 40 tokens a row: one a pass
    covered = sorted(i for pc in pieces for i in pc.members)
    assert covered == list(range(len(trained)))


def test_pieces_without_fanout_are_rows_within_the_budget():
    p0 = prompt(0, 4)
    trained = [answer(p0, 0, j, n) for j, n in enumerate([2, 4, 3, 1])]
    pieces = _pieces(trained, budget=16, fanout=False)
    assert all(not pc.shared for pc in pieces)
    for pc in pieces:
        width = max(len(trained[i].prompt.ids) + trained[i].n_tokens for i in pc.members)
        assert width * len(pc.members) <= 16 or len(pc.members) == 1
    assert sorted(i for pc in pieces for i in pc.members) == [0, 1, 2, 3]


def test_held_out_spreads_max_examples_over_the_file():
    prompts = [prompt(i) for i in range(10)]
    assert [p.index for p in held_out(prompts, 4)] == [0, 3, 6, 9]
    assert held_out(prompts, None) == prompts


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}], "answer": 3}', "unknown key 'answer'"),
        ('{"messages": [{"role": "user", "content": "  "}]}', "non-empty user message"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
            "non-empty user message",
        ),
        ('{"messages": [{"role": "user", "content": "a"}', "invalid JSON"),
    ],
)
def test_prompt_file_errors_name_the_line(tmp_path, line, message):
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(DataError, match=rf"prompts.jsonl:3: .*{message}"):
        read_prompts(path)


def test_prompt_file_keeps_a_rubric_and_the_last_user_text(tmp_path):
    path = tmp_path / "p.jsonl"
    rec = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2 + 2?"},
        ],
        "rubric": "a number",
    }
    path.write_text(json.dumps(rec) + "\n\n")
    [line] = read_prompts(path).lines
    assert line.rubric == "a number" and line.key == "p.jsonl:1"
    assert line.messages[-1]["content"] == "2 + 2?"


def test_the_policy_pass_weighs_advantages_only_when_the_sampler_is_not_the_trainer():
    """PolicyTerms.corrected: with a cap (rollout_backend = "llama_cpp") each token's advantage
    is times min(pi_old / pi_sampler, C), after the first pass kept pi_old, and the pass reports
    the weights' token mean and truncated share; without one the advantages pass unchanged."""
    import math

    import torch

    from retrograd.algorithms.policy_terms import PolicyTerms, sampler_cap
    from retrograd.observe import names
    from retrograd.rollout import spread

    p = prompt(0)
    a, b = answer(p, 0, 0, 2), answer(p, 0, 1, 1)
    a.sampler_logprobs = np.array([-1.0, -1.5], np.float32)
    b.sampler_logprobs = np.array([-3.0], np.float32)
    lps = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5])]  # the trainer's first pass
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    terms = PolicyTerms(3.0, 2, first=True, is_cap=2.0)
    terms.keep_old([a, b], lps)
    weighted = terms.corrected([a, b], adv, mask)
    w = [math.exp(-0.5), math.exp(0.5), 2.0]  # e^2.5 cut to 2
    want = torch.tensor([[w[0], w[1]], [-2.0 * w[2], 0.0]])
    torch.testing.assert_close(weighted, want)
    metrics = terms.metrics(spread.current_world())
    assert metrics[names.SAMPLER_IS_WEIGHT_MEAN] == pytest.approx(sum(w) / 3)
    assert metrics[names.SAMPLER_IS_TRUNCATED] == pytest.approx(1 / 3)
    plain = PolicyTerms(3.0, 2, first=True, is_cap=None)
    assert plain.corrected([a, b], adv, mask) is adv
    assert names.SAMPLER_IS_WEIGHT_MEAN not in plain.metrics(spread.current_world())

    class Training:
        rollout_backend, rollout_is_cap = "in_process", 2.0

    assert sampler_cap(Training) is None
    Training.rollout_backend = "llama_cpp"
    assert sampler_cap(Training) == 2.0
