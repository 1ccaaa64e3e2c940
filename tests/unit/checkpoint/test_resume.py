"""Resume refuses a changed model, data, algorithm or trajectory setting, and names the change."""

from __future__ import annotations

import pytest

from retrograd.checkpoint import check_resume, load_checkpoint, save_checkpoint
from retrograd.errors import ConfigError
from tests.unit.checkpoint.sample_state import SETTINGS, make_state

SAME = dict(
    model_fingerprint="sha256:" + "ab12" * 16,
    data_fingerprint="sha256:" + "cd34" * 16,
    algorithm="sft",
    trajectory_settings=SETTINGS,
)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """Through a real save and load, so tuples-become-lists and the like are covered."""
    path = save_checkpoint(tmp_path_factory.mktemp("ck"), "best", make_state(3))
    return load_checkpoint(path)


def refusal(state, **changed) -> str:
    with pytest.raises(ConfigError) as e:
        check_resume(state, **(SAME | changed))
    return str(e.value)


def test_unchanged_run_resumes(state):
    check_resume(state, **SAME)
    settings = {"sft": {"lr": 1e-4}, "lora": {"targets": ("q", "v"), "alpha": 8.0, "rank": 4}}
    check_resume(state, **(SAME | {"trajectory_settings": settings}))  # key order, tuples


def test_model_change(state):
    msg = refusal(state, model_fingerprint="sha256:" + "cd34" * 16)
    assert msg == (
        "cannot resume from the checkpoint: the model changed (checkpoint was made with a model "
        "of fingerprint ab12ab12ab12…, this run's is cd34cd34cd34…)"
    )


def test_data_change(state):
    msg = refusal(state, data_fingerprint="sha256:" + "ef56" * 16)
    assert (
        "the training data changed (fingerprint cd34cd34cd34… in the checkpoint, ef56ef56ef56… now)"
        in msg
    )


def test_algorithm_change(state):
    assert "the algorithm changed (sft in the checkpoint, grpo now)" in refusal(
        state, algorithm="grpo"
    )


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"lora": {**SETTINGS["lora"], "rank": 8}, "sft": {"lr": 1e-4}}, "lora.rank: 4 -> 8"),
        ({"lora": SETTINGS["lora"], "sft": {"lr": 2e-4}}, "sft.lr: 0.0001 -> 0.0002"),
        ({"lora": SETTINGS["lora"]}, "sft.lr: 0.0001 -> (unset)"),
        ({**SETTINGS, "seed": 3}, "seed: (unset) -> 3"),
        (
            {"lora": {**SETTINGS["lora"], "targets": ["q"]}, "sft": {"lr": 1e-4}},
            "lora.targets: ['q', 'v'] -> ['q']",
        ),
        ({"lora": {**SETTINGS["lora"], "rank": 4.0}, "sft": {"lr": 1e-4}}, "lora.rank: 4 -> 4.0"),
    ],
)
def test_trajectory_setting_change_is_named(state, settings, expected):
    msg = refusal(state, trajectory_settings=settings)
    assert (
        msg
        == f"cannot resume from the checkpoint: settings that shape the trajectory changed: {expected}"
    )


def test_every_change_is_listed_with_the_source(state):
    with pytest.raises(ConfigError) as e:
        check_resume(
            state,
            **(SAME | {"algorithm": "ppo", "data_fingerprint": "sha256:00"}),
            source="runs/ck/best.state",
        )
    msg = str(e.value)
    assert msg.startswith("cannot resume from runs/ck/best.state: the training data changed")
    assert "; and the algorithm changed (sft in the checkpoint, ppo now)" in msg
