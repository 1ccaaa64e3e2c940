"""The run frame's door on tiny models: each hook sees what it promises and a truthy return ends
the run gracefully (algorithms/frame.py, Hooks); Python reward functions reach a GRPO run's
rewards; the summary every loop prints."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from retrograd.algorithms.door import Door, EvalEvent, Hooks, StepEvent, UpdateEvent
from retrograd.algorithms.frame import Result
from retrograd.config import load_run, validate_run
from retrograd.observe.sinks import Sinks
from tests.e2e.test_train_grpo import REWARD
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_files import write_run_file
from tests.factories.run_server import grpo_document
from tests.factories.tiny_gguf import write_tiny

TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. " * 3
PROMPTS = ["write some letters", "say something", "spell a word", "what comes next"]


class Summary(Sinks):
    """Quiet sinks that keep the summary."""

    def __init__(self):
        super().__init__(quiet=True)
        self.summary: dict | None = None

    def finish(self, summary):
        self.summary = dict(summary)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("frame") / "tiny.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def sft_run(tmp, model, **training) -> object:
    (tmp / "data.txt").write_text(TEXT)
    (tmp / "eval.txt").write_text(TEXT[:80])
    t = {"lr": 5e-3, "epochs": 3, "ctx": 32, "micro_batch": 16, "gradient_accumulation": 2}
    tables = {
        "training": {**t, **training},
        "sft": {"data": "data.txt"},
        "evaluation": {"data": "eval.txt", "every_iterations": 1, "patience": 10},
        "checkpoint": {"directory": "ck", "mode": "steps", "every_steps": 2},
    }
    return load_run(write_run_file(tmp, "sft", model, tables))


def adapter_tensors(path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


def run_sft_with(tmp, model, monkeypatch, sinks=None, **hooks) -> Result:
    """Three epochs of SFT on the tiny model (in `tmp`) with the hooks given."""
    from retrograd.algorithms.sft import run_sft

    monkeypatch.chdir(tmp)
    door = Door(sinks or Summary(), hooks=Hooks(**hooks))
    return run_sft(sft_run(tmp, model), door)


def stopping(seen: list, when) -> object:
    """A hook that keeps each event and asks to stop when `when(event)`."""

    def hook(event) -> bool:
        seen.append(event)
        return when(event)

    return hook


def test_on_step_that_asks_to_stop_ends_the_run_after_its_step_and_exports_it(
    model, tmp_path, monkeypatch
):
    seen: list[StepEvent] = []
    sinks = Summary()
    on_step = stopping(seen, lambda e: e.global_step == 2)
    result = run_sft_with(tmp_path, model, monkeypatch, sinks, on_step=on_step)
    assert [e.global_step for e in seen] == [1, 2]
    assert result.stopped == "callback" and result.global_step == 2
    assert sinks.summary["stopped early"] == "yes (callback)"
    assert seen[0].values["train/loss"] > 0 and seen[0].tokens > 0 and seen[0].iteration == 1
    with pytest.raises(TypeError):  # the values are the run's, read-only
        seen[0].values["train/loss"] = 0.0  # type: ignore[index]
    # the export is the adapter after two steps: the steps checkpoint at step 2 holds the same
    exported = adapter_tensors(tmp_path / "out" / "adapter.gguf")
    checkpointed = adapter_tensors(tmp_path / "ck" / "step-000000000002.gguf")
    assert exported.keys() == checkpointed.keys() and exported
    for name, values in exported.items():
        np.testing.assert_array_equal(values, checkpointed[name], err_msg=name)


def test_on_evaluate_sees_each_evaluation_and_whether_it_improved(model, tmp_path, monkeypatch):
    seen: list[EvalEvent] = []
    result = run_sft_with(tmp_path, model, monkeypatch, on_evaluate=seen.append)
    assert [e.iteration for e in seen] == [1, 2, 3]  # after each epoch
    assert [e.global_step for e in seen] == [step for step, _ in result.evals]
    losses = [e.values["eval/loss"] for e in seen]
    best = np.minimum.accumulate(losses)
    want = [True] + [losses[i] < best[i - 1] for i in range(1, len(losses))]
    assert [e.improved for e in seen] == want
    assert result.best_eval == pytest.approx(min(losses)) and result.stopped is None


def test_on_evaluate_that_asks_to_stop_ends_the_run_at_that_evaluation(
    model, tmp_path, monkeypatch
):
    seen: list[EvalEvent] = []
    on_evaluate = stopping(seen, lambda e: True)
    result = run_sft_with(tmp_path, model, monkeypatch, on_evaluate=on_evaluate)
    assert len(seen) == 1 and result.stopped == "callback"
    assert result.iterations == 1 and result.global_step == seen[0].global_step


# -- GRPO: on_update, and reward functions in Python ------------------------------------------


def grpo_config(tmp, model, program: bool):
    """A GRPO run of two updates on the tiny model, 2 prompts x 4 answers; without `program`
    the run file has no reward_command (reward functions supplied)."""
    lines = [{"messages": [{"role": "user", "content": p}], "letter": "e"} for p in PROMPTS]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    grpo = {
        "group_size": 4,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 3},
    }
    if program:  # it gives every answer 0: the functions' values are the whole reward
        (tmp / "zero.py").write_text(REWARD.replace('text.count("e")', "0"))
        grpo["reward_command"] = [sys.executable, str(tmp / "zero.py")]
    document = grpo_document(
        model,
        tmp / "prompts.jsonl",
        grpo,
        training={"lr": 2e-2, "ctx": 64, "micro_batch": 64},
        output={"path": str(tmp / "out" / "adapter.gguf")},
    )
    return validate_run(document, source=None, base_dir=tmp, supplied=("rewards",))


def share_of(prompts, completions, letter, **_):
    """The share of the line's letter in each answer (a column of the prompt file)."""
    return [c.count(x) / max(1, len(c)) for c, x in zip(completions, letter, strict=True)]


def test_on_update_receives_the_updates_groups_with_their_rewards(model, tmp_path):
    from retrograd.algorithms.grpo import run_grpo

    updates: list[UpdateEvent] = []
    steps: list[StepEvent] = []
    hooks = Hooks(on_step=steps.append, on_update=updates.append)
    cfg = grpo_config(tmp_path, model, program=True)
    result = run_grpo(cfg, Door(hooks=hooks, rewards=(share_of,), reward_weights=(2.0,)))
    assert [u.iteration for u in updates] == [1, 2] == [s.iteration for s in steps]
    for event in updates:
        assert len(event.groups) == 2 and all(len(g.members) == 4 for g in event.groups)
        members = [r for g in event.groups for r in g.members]
        assert all(r.update == event.iteration and r.trained is not None for r in members)
        # the program's 0 plus twice the function's value
        want = [2.0 * r.text.count("e") / max(1, len(r.text)) for r in members]
        np.testing.assert_allclose([r.reward_raw for r in members], want, rtol=1e-6)
        assert event.values["reward/mean"] == pytest.approx(np.mean(want))
    assert result.curve == [u.values["reward/mean"] for u in updates]


def test_a_run_rewarded_by_a_python_function_alone_gets_its_rewards(model, tmp_path):
    """No reward_command: the function's values are the rewards, and the prompt line's other
    keys arrive as columns."""
    from retrograd.algorithms.grpo import run_grpo

    calls: list[dict] = []

    def reward(prompts, completions, **columns):
        calls.append({"prompts": prompts, "columns": columns})
        return [float(len(c)) for c in completions]

    updates: list[UpdateEvent] = []
    sinks = Summary()
    door = Door(sinks, hooks=Hooks(on_update=updates.append), rewards=(reward,))
    result = run_grpo(grpo_config(tmp_path, model, program=False), door)
    assert len(calls) == 2 and calls[0]["columns"] == {"letter": ["e"] * 8}
    assert calls[0]["prompts"][0]["messages"][0]["content"] in PROMPTS
    for event in updates:
        members = [r for g in event.groups for r in g.members]
        assert [r.reward_raw for r in members] == [float(len(r.text)) for r in members]
    assert result.iterations == 2 and sinks.summary["stopped early"] == "no"
    assert sinks.summary["adapter"] == str(tmp_path / "out" / "adapter.gguf")
