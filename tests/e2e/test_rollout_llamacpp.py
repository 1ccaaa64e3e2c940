"""GRPO with its answers sampled by llama.cpp ([training].rollout_backend = "llama_cpp"), end
to end on the tiny chat model: it learns the task as the in-process run does, reports the
sampler gap and the importance weights, and the run's adapter is the one llama.cpp sampled
with."""

from __future__ import annotations

import numpy as np
import pytest

from retrograd.config import load_run
from tests.e2e.test_train_grpo import chat_model, sinks, write_run  # noqa: F401 (a fixture)
from tests.e2e.test_train_sft import scalars

pytestmark = pytest.mark.oracle


def run(tmp_path, chat_model, backend: str, **training):  # noqa: F811
    from retrograd.algorithms.grpo import run_grpo

    tmp = tmp_path / backend
    tmp.mkdir()
    path = write_run(
        tmp,
        chat_model,
        {"updates": 12},
        metrics='tensorboard_dir = "tb"',
        training={"rollout_backend": backend, **training},
    )
    return run_grpo(load_run(path), run_file=path, sinks=sinks()), tmp


def climb(rewards: list[float]) -> float:
    return float(np.mean(rewards[-3:]) - np.mean(rewards[:3]))


def test_grpo_through_llama_cpp_learns_as_in_process_does(chat_model, tmp_path):  # noqa: F811
    """The reward of the obvious task climbs through llama.cpp by at least half the in-process
    climb (the two sample other answers: other arithmetic, an f16 cache), without collapse;
    the behaviour log-probabilities stay near the trainer's, the truncated importance weights
    are reported near 1, and the exported adapter is written."""
    inproc, _ = run(tmp_path, chat_model, "in_process")
    result, tmp = run(tmp_path, chat_model, "llama_cpp")
    rewards = result.curve
    assert len(rewards) == 12
    assert climb(inproc.curve) > 0.1, inproc.curve
    assert climb(rewards) > 0.5 * climb(inproc.curve), (rewards, inproc.curve)
    assert min(rewards[3:]) > np.mean(rewards[:3]) - 0.1, rewards
    tb = tmp / "tb"
    gaps = scalars(tb, "policy/sampler_logprob_gap")
    assert gaps and max(gaps.values()) < 0.05, gaps
    weights = scalars(tb, "policy/sampler_is_weight_mean")
    assert weights and all(0.9 < w < 1.1 for w in weights.values()), weights
    truncated = scalars(tb, "policy/sampler_is_truncated_fraction")
    assert truncated and all(0 <= t < 0.05 for t in truncated.values()), truncated
    assert (tmp / "out" / "adapter.gguf").exists()
    assert scalars(tmp_path / "in_process" / "tb", "policy/sampler_is_weight_mean") == {}


def test_ppo_through_llama_cpp_learns(chat_model, tmp_path):  # noqa: F811
    """PPO (two passes an update, so ratios other than 1 meet the weights) through llama.cpp:
    the reward climbs as in the in-process test of the same task, and the weights are
    reported."""
    from retrograd.algorithms.ppo import run_ppo
    from tests.e2e.test_train_ppo import write_run as write_ppo

    path = write_ppo(
        tmp_path,
        chat_model,
        {"updates": 8},
        metrics='tensorboard_dir = "tb"',
        training={"rollout_backend": "llama_cpp"},
    )
    rewards = run_ppo(load_run(path), run_file=path, sinks=sinks()).curve
    assert len(rewards) == 8 and climb(rewards) > 0.1, rewards
    weights = scalars(tmp_path / "tb", "policy/sampler_is_weight_mean")
    assert weights and all(0.9 < w < 1.1 for w in weights.values()), weights
