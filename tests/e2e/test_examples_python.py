"""The Python examples (examples/python/) run as a user runs them, on a tiny chat model: SFT,
then GRPO with the plurals reward as a Python function (the program's own `score`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories.agents import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "python"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("examples") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def run_example(name: str, *args, cwd: Path) -> str:
    env = {**os.environ, "RETRO_THREADS": "1", "RETRO_DTYPE": "float32"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_sft_example_trains_an_adapter(chat_model, tmp_path):
    demo = REPO / "examples" / "demo"
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join((demo / "pirate-train.jsonl").read_text().splitlines(True)[:3]))
    held.write_text("".join((demo / "pirate-eval.jsonl").read_text().splitlines(True)[:2]))
    out = run_example(
        "sft.py", "--model", chat_model, "--device", "cpu", "--epochs", "1",
        "--data", train, "--eval-data", held, "--out", tmp_path / "sft.gguf", cwd=tmp_path,
    )  # fmt: skip
    assert "before:" in out and "after: " in out
    assert f"adapter: {tmp_path / 'sft.gguf'}; held-out loss " in out
    import retrograd

    retrograd.load(chat_model, device="cpu", adapter=tmp_path / "sft.gguf")  # llama.cpp's form


@pytest.mark.slow
def test_the_grpo_example_trains_with_the_plurals_reward_in_python(chat_model, tmp_path):
    out = run_example(
        "grpo_plurals.py", "--model", chat_model, "--device", "cpu", "--updates", "1",
        "--prompts-per-update", "1", "--group-size", "2", "--eval-examples", "2",
        "--ctx", "256", "--out", tmp_path / "plurals.gguf", cwd=tmp_path,
    )  # fmt: skip
    assert f"adapter: {tmp_path / 'plurals.gguf'}" in out
    assert "mean reward, first -> last update: " in out and "held-out reward (best): " in out
    assert (tmp_path / "plurals.gguf").is_file()


def test_the_grpo_examples_reward_is_the_reward_programs_score():
    spec = importlib.util.spec_from_file_location("grpo_plurals", EXAMPLES / "grpo_plurals.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    first = json.loads((REPO / "examples" / "grpo" / "plurals.jsonl").read_text().splitlines()[0])
    question = first["messages"][-1]["content"]  # "Plural of note:"
    answers = ["notes", "notes and more", "note", "cat", "Notes.\nthen"]
    program = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rewards" / "plurals.py")],
        input="".join(json.dumps({"prompt": question, "completion": a}) + "\n" for a in answers),
        capture_output=True,
        text=True,
        check=True,
    )
    want = [json.loads(line)["reward"] for line in program.stdout.splitlines()]
    assert want == [1.0, 0.75, 0.25, 0.0, 1.0]
    assert example.plural_reward([first] * len(answers), answers) == want
