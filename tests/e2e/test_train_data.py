"""`retrograd train` on bad data files: the run stops before training, exits 1, names the file,
line and reason, and writes nothing (formats.md §1.2, §1.7). Chat data runs on Gemma (the tiny
models have no chat template); tests/unit/data covers every reading rule on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrograd.cli.main import main

GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
)


def write_run(tmp: Path, model: Path, data: str) -> Path:
    path = tmp / "run.toml"
    path.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
device = "cpu"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
targets = ["q", "v"]
[training]
ctx = 32
micro_batch = 32
[sft]
data = "{data}"
""")
    return path


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # Gemma's tokenizer takes seconds to build
def test_malformed_line_after_a_valid_one_is_named(gemma_path, tmp_path, capsys):
    """Line 1 is a valid record, so the run reaches line 2 and must name it."""
    (tmp_path / "chat.jsonl").write_text(GOOD + "\n{oops\n")
    run = write_run(tmp_path, gemma_path, "chat.jsonl")
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    assert "chat.jsonl:2: invalid JSON (Expecting property name enclosed in double quotes" in err
    assert "chat.jsonl:1" not in err
    assert files(tmp_path) == {"chat.jsonl", "run.toml"}


def test_blank_text_file_is_no_text_to_train_on(tiny_model, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("  \n\t\n")
    run = write_run(tmp_path, tiny_model("llama"), "notes.txt")
    assert main(["train", str(run)]) == 1
    assert "notes.txt: no text to train on" in capsys.readouterr().err
    assert files(tmp_path) == {"notes.txt", "run.toml"}
