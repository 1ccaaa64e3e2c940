"""Advantages, zero-signal groups, the overlong penalty and the KL controller on hand-made
numbers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from retrograd.errors import RewardError
from retrograd.rollout.records import Group, Prompt, Rollout
from retrograd.rollout.shaping import (
    KlController,
    apply_overlong_penalty,
    assign_advantages,
    group_advantages,
    overlong_penalty,
    zero_signal,
)

PROMPT = Prompt(key="p.jsonl:1", index=0, messages=(), text="2+2?", ids=(1, 2))


def _group(rewards, index=0, truncated=(), n_tokens=3) -> Group:
    members = [
        Rollout(
            prompt=PROMPT,
            update=1,
            group=index,
            member=i,
            seed=i,
            ids=tuple(range(n_tokens[i] if isinstance(n_tokens, list) else n_tokens)),
            text="",
            truncated=i in truncated,
            sampler_logprobs=np.zeros(3, dtype=np.float32),
            reward_raw=r,
        )
        for i, r in enumerate(rewards)
    ]
    return Group(prompt=PROMPT, update=1, index=index, members=members)


def test_mean_baseline_is_not_divided_by_std():
    np.testing.assert_allclose(group_advantages(np.array([1.0, 0, 0, 1])), [0.5, -0.5, -0.5, 0.5])
    # TRL's default would give ±0.707 here (std with Bessel's correction): we keep reward units.
    np.testing.assert_allclose(group_advantages(np.array([2.0, 0.0])), [1.0, -1.0])


def test_leave_one_out_by_hand_and_the_rloo_identity():
    np.testing.assert_allclose(
        group_advantages(np.array([1.0, 0, 0, 0]), "leave_one_out"), [1.0, -1 / 3, -1 / 3, -1 / 3]
    )
    r = np.random.default_rng(0).normal(size=7)
    loo = group_advantages(r, "leave_one_out")
    np.testing.assert_allclose(loo, 7 / 6 * (r - r.mean()))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(r, "median")


def test_zero_signal():
    assert zero_signal(np.array([1.0, 1.0, 1.0]))
    assert zero_signal(np.zeros(4))
    assert zero_signal(np.array([0.3, 0.1 + 0.2]))  # 5.6e-17 apart: float noise, not signal
    assert zero_signal(np.array([5.0]))
    assert not zero_signal(np.array([1.0, 1.001]))
    assert not zero_signal(np.array([0.0, 1e-12]))  # relative: tiny rewards can still differ


def test_overlong_penalty_endpoints():
    args = dict(max_new_tokens=100, buffer_tokens=20, max_penalty=0.5)
    assert overlong_penalty(10, **args) == 0.0
    assert overlong_penalty(80, **args) == 0.0
    assert overlong_penalty(90, **args) == pytest.approx(0.25)
    assert overlong_penalty(100, **args) == pytest.approx(0.5)
    assert overlong_penalty(130, **args) == pytest.approx(0.5)


def test_assign_advantages_sets_records_and_returns_batch_stats():
    signal = _group([1.0, 0.0, 0.0, 1.0], index=0, truncated={3})
    flat = _group([0.5, 0.5, 0.5, 0.5], index=1, truncated={0})
    dropped = _group([1.0, 0.0, 1.0, 0.0], index=2)
    dropped.skip("judge_dropped")
    stats = assign_advantages([signal, flat, dropped], "mean", mask_truncated=True)

    assert [r.advantage for r in signal.members] == [0.5, -0.5, -0.5, 0.5]
    # The truncated answer stays in the baseline and keeps its advantage, but does not train.
    assert [r.skip_reason for r in signal.members] == [None, None, None, "truncated"]
    assert all(r.advantage == 0 and r.skip_reason == "zero_signal" for r in flat.members)
    assert all(r.advantage == 0 and r.skip_reason == "judge_dropped" for r in dropped.members)
    assert stats == {
        "zero_std_group_fraction": 0.5,  # of the two groups with scores
        "advantage_abs_mean": 0.5,
        "advantage_std": pytest.approx(2**0.5 / 3),  # 0.5, -0.5, -0.5 about their mean -1/6
        "trained_fraction": 3 / 12,
    }


def test_truncated_answers_train_unless_masked():
    g = _group([1.0, 0.0], truncated={1})
    stats = assign_advantages([g], "leave_one_out", mask_truncated=False)
    assert [r.advantage for r in g.members] == [1.0, -1.0]
    assert all(r.eligible for r in g.members) and stats["trained_fraction"] == 1.0


def test_unscored_answers_leave_the_baseline():
    g = _group([1.0, None, 0.0])
    assign_advantages([g], "mean", mask_truncated=False)
    assert [r.advantage for r in g.members] == [0.5, 0.0, -0.5]
    assert [r.skip_reason for r in g.members] == [None, "unscored", None]
    lone = _group([1.0, None])
    stats = assign_advantages([lone], "leave_one_out", mask_truncated=False)
    assert [r.skip_reason for r in lone.members] == ["zero_signal", "unscored"]
    assert stats["trained_fraction"] == 0.0 and stats["advantage_abs_mean"] == 0.0


def test_overlong_penalty_enters_the_reward_and_can_make_signal():
    g = _group([1.0, 1.0], n_tokens=[50, 100])
    apply_overlong_penalty([g], max_new_tokens=100, buffer_tokens=20, max_penalty=0.5)
    assert [r.penalty for r in g.members] == [0.0, 0.5]
    assign_advantages([g], "mean", mask_truncated=False)
    assert [r.advantage for r in g.members] == [0.25, -0.25]


def test_a_reward_or_a_group_mean_that_overflows_is_a_reward_error_naming_the_group():
    """Each part of a reward is finite (the program's replies are checked); their sum, or the
    group's mean, can still overflow float64: a RewardError here, not a NaN loss later."""
    judged = _group([1e308, 0.0], index=4)
    judged.members[0].judge_term = 1e308
    with pytest.raises(RewardError, match=r"update 1, group 4, answer 0: the reward is inf"):
        assign_advantages([judged], "mean", mask_truncated=False)
    for baseline in ("mean", "leave_one_out"):
        with pytest.raises(RewardError, match=r"update 1, group 2: the rewards .* overflow"):
            assign_advantages([_group([1e308, 1e308, 0.0], index=2)], baseline, False)
    big = _group([1e300, 0.0])
    assign_advantages([big], "mean", mask_truncated=False)
    assert [r.advantage for r in big.members] == [5e299, -5e299]


def test_assign_on_no_groups():
    stats = assign_advantages([], "mean", mask_truncated=True)
    assert stats == {
        "zero_std_group_fraction": 0.0,
        "advantage_abs_mean": 0.0,
        "advantage_std": 0.0,
        "trained_fraction": 0.0,
    }


def test_kl_warmup_is_linear_over_updates():
    kl = KlController(0.1, warmup_updates=4)
    assert [kl.value(u) for u in range(1, 7)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    kl.observe(5.0, 5)  # no target: a fixed coefficient
    assert kl.value(6) == 0.1
    assert KlController(0.1).value(1) == 0.1


def test_kl_adapts_toward_the_target_after_warmup():
    kl = KlController(0.1, warmup_updates=2, target=0.01)
    kl.observe(1.0, 1)  # still warming up: unchanged
    assert kl.value(2) == pytest.approx(0.1)
    kl.observe(0.02, 2)  # KL/target − 1 = 1, clipped to 0.2: × (1 + 0.2 / 10)
    assert kl.value(3) == pytest.approx(0.102)
    kl.observe(0.02, 2)  # the same update again (a replay after resume): ignored
    assert kl.value(3) == pytest.approx(0.102)
    kl.observe(0.011, 3)  # error 0.1: × 1.01
    assert kl.value(4) == pytest.approx(0.102 * 1.01)
    kl.observe(0.0, 4)  # error −1, clipped to −0.2: × 0.98
    assert kl.value(5) == pytest.approx(0.102 * 1.01 * 0.98)


def test_kl_state_round_trips_through_json():
    kls = [0.03, 0.001, 0.02, 0.015, 0.0]
    whole = KlController(0.05, warmup_updates=1, target=0.01)
    for u, k in enumerate(kls, start=1):
        whole.observe(k, u)
    first = KlController(0.05, warmup_updates=1, target=0.01)
    for u, k in enumerate(kls[:2], start=1):
        first.observe(k, u)
    resumed = KlController(0.05, warmup_updates=1, target=0.01)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for u, k in enumerate(kls, start=1):  # replays updates 1-2, then continues
        resumed.observe(k, u)
    assert resumed.state_dict() == whole.state_dict()
    assert resumed.value(6) == whole.value(6) != 0.05


def test_kl_controller_from_a_grpo_section():
    plain = KlController.from_section(SimpleNamespace(kl_coefficient=0.2, kl_schedule=None))
    assert (plain.value(1), plain.target) == (0.2, None)
    schedule = SimpleNamespace(warmup_updates=2, target=0.05)
    ramped = KlController.from_section(SimpleNamespace(kl_coefficient=0.2, kl_schedule=schedule))
    assert (ramped.value(1), ramped.target) == (0.1, 0.05)
