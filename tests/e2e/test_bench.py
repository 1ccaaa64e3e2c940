"""`retrograd bench` as a user runs it: the loss it prints is llama.cpp's on the same tokens
(float32 scoring), and a non-finite loss is an error, not a number in the table."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np

import retrograd
from retrograd.cli.main import main
from retrograd.data.sft import load_sft_data
from tests.oracles.test_bench_nll import llama_nll

TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. " * 2


def write_run(tmp: Path, model: Path) -> Path:
    (tmp / "data.txt").write_text(TEXT)
    run = tmp / "run.toml"
    run.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
device = "cpu"
[output]
path = "out.gguf"
[lora]
targets = ["q", "v"]
[training]
ctx = 32
micro_batch = 32
[sft]
data = "data.txt"
""")
    return run


def table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in r.split("│")[1:-1]] for r in out.splitlines() if r.startswith("│")]


def test_bench_prints_llama_cpp_loss(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    run = write_run(tmp_path, model)
    assert main(["bench", str(run), "--data", str(tmp_path / "data.txt")]) == 0
    out = capsys.readouterr().out
    assert "compute float32" in out
    (label, loss, ppl, tokens, _), *_ = table_rows(out)
    data = load_sft_data(tmp_path / "data.txt", retrograd.load_tokenizer(model), 32)
    theirs = llama_nll(model, list(data.examples))
    ref = sum(t for t, _ in theirs) / sum(n for _, n in theirs)
    assert label == "base" and int(tokens) == sum(n for _, n in theirs)
    assert abs(float(loss) - ref) < 2e-4  # the table's 4 decimals
    assert abs(float(ppl) - np.exp(ref)) < 0.01 * np.exp(ref)


def test_non_finite_loss_is_an_error(tiny_model, tmp_path, capsys):
    model = tmp_path / "broken.gguf"
    shutil.copy(tiny_model("llama"), model)
    reader = gguf.GGUFReader(model, "r+")
    (norm,) = [t for t in reader.tensors if t.name == "output_norm.weight"]
    norm.data[:] = np.nan  # written through to the file
    del reader
    run = write_run(tmp_path, model)
    assert main(["bench", str(run), "--data", str(tmp_path / "data.txt")]) == 1
    captured = capsys.readouterr()
    assert "data.txt:window 0: the loss of the base model is not finite (nan)" in captured.err
    assert "nan" not in captured.out
