"""What a served run's process does at its loops' boundary (child.ServerSinks, child.ServerControl
and the frame's one boundary, algorithms/frame.py): a PATCH of [training].lr and [evaluation] followed from the next boundary,
and evaluate answered with the loop's own evaluation, on tiny SFT, GRPO and preference runs in this
process (the reference's ctx 128 and micro_batch 32)."""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import pytest
from rich.console import Console

from retrograd.algorithms import table
from retrograd.algorithms.door import Door
from retrograd.config import validate_run
from retrograd.server.child import Channel, ServerControl, ServerSinks
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import TEXT, grpo_document
from tests.factories.tiny_gguf import write_tiny


class Commands:
    """A server's stdin: the commands given, then open forever (a closed stdin ends the
    process)."""

    def __init__(self, commands: list[dict]):
        self.lines = [json.dumps(c) + "\n" for c in commands]

    def __iter__(self):
        yield from self.lines
        threading.Event().wait()


def run_served(document: dict, commands: list[dict], base_dir) -> list[dict]:
    """The loop of `document` with the server's sinks and `commands` waiting at its first
    boundary; -> what it reported, in order."""
    out = io.StringIO()
    channel = Channel(out, Commands(commands))
    while len(channel.pending) < len(commands):
        time.sleep(0.01)
    sinks = ServerSinks(channel, Console(file=io.StringIO()))
    cfg = validate_run(document, source="test", base_dir=base_dir)
    table.run(cfg, Door(sinks, ServerControl(channel, sinks)))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def answer(messages: list[dict], rid: str) -> dict:
    [found] = [m for m in messages if m["type"] == "answer" and m["request_id"] == rid]
    assert "error" not in found, found
    return found["body"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "tiny.gguf"
    return write_tiny(path, "llama", chat_template=CHAT_TEMPLATE)


def test_sft_follows_a_patched_rate_and_evaluation_and_answers_evaluate(model, tmp_path):
    (tmp_path / "data.txt").write_text(TEXT[: len(TEXT) // 2])
    document = {
        "run": {"algorithm": "sft"},
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]},
        "training": {"lr": 0.005, "epochs": 2, "lr_scheduler": "constant", "warmup_steps": 0},
        "sft": {"data": "data.txt"},
        # without the patch: one evaluation, after the last epoch
        "evaluation": {"data": "data.txt", "every_iterations": 1000, "patience": 1},
        "output": {"path": str(tmp_path / "out.gguf")},
    }
    assert validate_run(document, source="t", base_dir=tmp_path).training.ctx == 128
    patch = {"training": {"lr": 0.02}, "evaluation": {"every_iterations": 1, "patience": 5}}
    commands = [
        {"op": "patch", "request_id": "p", "request": patch},
        {"op": "evaluate", "request_id": "e", "request": {}},
    ]
    messages = run_served(document, commands, tmp_path)
    applied = answer(messages, "p")
    assert applied["applied"] == [
        "training.lr",
        "evaluation.every_iterations",
        "evaluation.patience",
    ]
    assert applied["global_step"] == 1
    rates = [m["learning_rate"] for m in messages if m["type"] == "progress"]
    assert rates[0] == pytest.approx(0.005) and len(rates) > 2
    assert rates[1:] == pytest.approx([0.02] * (len(rates) - 1))  # from the next step on
    # an evaluation after each epoch now; patience 5 instead of 1 lets the run go on
    evaluations = [m for m in messages if m["type"] == "evaluation"]
    assert len(evaluations) == 2
    measured = answer(messages, "e")
    assert measured["examples"] >= 1 and measured["loss"] > 0
    assert measured["perplexity"] == pytest.approx(2.718281828 ** measured["loss"], rel=1e-6)


REWARD = r"""
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req or "_retrograd_batch_end" in req:
        print(json.dumps(req), flush=True)
        continue
    print(json.dumps({"reward": float("e" in req["completion"]),
                      "_retrograd_batch": req["_retrograd_batch"],
                      "_retrograd_index": req["_retrograd_index"]}), flush=True)
"""


def test_grpo_answers_evaluate_with_held_out_rewards_and_follows_a_patched_rate(model, tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    prompts = ["say something", "spell a word", "name a thing"]
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in prompts]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    document = grpo_document(
        model,
        tmp_path / "prompts.jsonl",
        {"reward_command": [sys.executable, str(tmp_path / "reward.py")], "prompts_per_update": 2},
        training={"lr": 0.01, "lr_scheduler": "constant", "warmup_steps": 0},
        evaluation={"data": "prompts.jsonl", "every_iterations": 1000},
        output={"path": str(tmp_path / "out.gguf")},
    )
    commands = [
        {"op": "evaluate", "request_id": "e", "request": {}},
        {"op": "patch", "request_id": "p", "request": {"training": {"lr": 0.03}}},
    ]
    messages = run_served(document, commands, tmp_path)
    measured = answer(messages, "e")
    assert measured["examples"] == 3 and measured["iteration"] == 1
    assert 0 <= measured["reward_min"] <= measured["mean_reward"] <= measured["reward_max"] <= 1
    assert measured["accuracy"] == pytest.approx(measured["mean_reward"])  # rewards are 0 or 1
    # the run's own evaluation (after its last update) is the only evaluation event
    assert len([m for m in messages if m["type"] == "evaluation"]) == 1
    rates = [m.get("learning_rate") for m in messages if m["type"] == "progress"]
    trained = [r for r in rates[1:] if r is not None]
    assert all(r == pytest.approx(0.03) for r in trained)


def test_preference_answers_evaluate_with_its_loss_and_accuracy(model, tmp_path):
    from tests.e2e.test_train_preference import held_pairs, train_pairs, write_jsonl

    write_jsonl(tmp_path / "pairs.jsonl", train_pairs()[:2])
    write_jsonl(tmp_path / "held.jsonl", held_pairs())
    document = {
        "run": {"algorithm": "preference"},
        "model": {"path": str(model), "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]},
        "training": {"lr": 0.01, "epochs": 1},
        "preference": {"data": "pairs.jsonl", "loss": "dpo"},
        "evaluation": {"data": "held.jsonl"},
        "output": {"path": str(tmp_path / "out.gguf")},
    }
    messages = run_served(
        document, [{"op": "evaluate", "request_id": "e", "request": {}}], tmp_path
    )
    measured = answer(messages, "e")
    assert measured["examples"] == len(held_pairs()) and measured["loss"] > 0
    assert 0 <= measured["accuracy"] <= 1
    # the run's own evaluation after its one step: the same weights, the same numbers
    [own] = [m for m in messages if m["type"] == "evaluation"]
    assert own["global_step"] == measured["global_step"] == 1
    assert own["values"]["eval/preference_loss"] == pytest.approx(measured["loss"])
    assert own["values"]["eval/accuracy"] == pytest.approx(measured["accuracy"])
