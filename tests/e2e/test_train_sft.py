"""`retrograd train` and `retrograd bench` for SFT, end to end, as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import retrograd
from retrograd.cli.main import main
from tests.oracles.llama_oracle import llama_logits

TEXT = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. "
    "the sun rose over the hill and the day began. "
) * 3


def write_run(tmp: Path, model: Path, **over) -> Path:
    (tmp / "data.txt").write_text(TEXT)
    (tmp / "eval.txt").write_text(TEXT[:400])
    t = {"lr": 5e-3, "epochs": 2, "ctx": 32, "micro_batch": 16, "gradient_accumulation": 2}
    t.update(over.pop("training", {}))
    ck = over.pop("checkpoint", 'directory = "ck"\nmode = "steps_and_best_eval"\nevery_steps = 4')
    text = f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
device = "cpu"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
dtype = "{over.pop("dtype", "f32")}"
targets = ["q", "v", "ffn_down"]
[training]
{chr(10).join(f"{k} = {v!r}" for k, v in t.items())}
[sft]
data = "data.txt"
[evaluation]
data = "eval.txt"
[checkpoint]
{ck}
[metrics]
tensorboard_dir = "tb"
"""
    path = tmp / "run.toml"
    path.write_text(text)
    return path


def scalars(tb: Path, tag: str) -> dict[int, float]:
    out = {}
    for run in sorted(tb.iterdir()):
        acc = EventAccumulator(str(run))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_train_writes_an_adapter_llama_cpp_applies_like_us(tiny_model, tmp_path):
    model = tiny_model("llama")
    run = write_run(tmp_path, model)
    assert main(["train", str(run)]) == 0
    adapter = tmp_path / "out" / "adapter.gguf"
    ids = [1] + retrograd.load_tokenizer(model).tokenize("the cat sat on the log.", add_bos=False)
    ours = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter).logits(ids)
    ref = llama_logits(model, ids, lora_path=str(adapter))
    base = llama_logits(model, ids)
    assert np.abs(ref - base).max() > 0.1, "training changed nothing"
    assert np.abs(ours.numpy() - ref).max() < 2e-3
    losses = scalars(tmp_path / "tb", "train/loss")
    assert sorted(losses) == list(range(1, len(losses) + 1))
    assert losses[max(losses)] < losses[1]  # it learned
    assert scalars(tmp_path / "tb", "eval/loss")
    assert (tmp_path / "ck" / "best.state" / "manifest.msgpack").exists()


def test_bench_compares_base_and_adapter(tiny_model, tmp_path, capsys):
    model = tiny_model("qwen3")
    run = write_run(tmp_path, model, checkpoint='directory = "ck"\nmode = "best_eval"')
    assert main(["train", str(run)]) == 0
    capsys.readouterr()
    assert (
        main(
            ["bench", str(run), "--adapter", str(tmp_path / "out" / "adapter.gguf"), "--limit", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    base, tuned = (float(r.split("│")[2]) for r in rows[:2])
    assert tuned < base


def test_killed_run_resumes_to_the_same_losses(tiny_model, tmp_path):
    """A real SIGKILL mid-run, then --resume: the losses equal an uninterrupted run's."""
    model = tiny_model("gemma3")
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full_dir.mkdir()
    cut_dir.mkdir()
    over = {"training": {"epochs": 3}}
    assert main(["train", str(write_run(full_dir, model, **over))]) == 0
    run = write_run(cut_dir, model, **over)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrograd.cli.main", "train", str(run)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marker = cut_dir / "ck" / "step-000000000008.state" / "manifest.msgpack"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), proc.stderr.read().decode()
    assert not (cut_dir / "out" / "adapter.gguf").exists() or proc.returncode == 0
    assert main(["train", str(run), "--resume"]) == 0
    full = scalars(full_dir / "tb", "train/loss")
    cut = scalars(cut_dir / "tb", "train/loss")
    assert sorted(cut) == sorted(full)
    for step, loss in full.items():
        assert cut[step] == pytest.approx(loss, rel=1e-6), step
    assert (full_dir / "out" / "adapter.gguf").read_bytes() == (
        cut_dir / "out" / "adapter.gguf"
    ).read_bytes()


def test_resume_refuses_changed_data(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    run = write_run(tmp_path, model, training={"epochs": 1})
    assert main(["train", str(run)]) == 0
    (tmp_path / "data.txt").write_text(TEXT.replace("cat", "cow"))
    capsys.readouterr()
    assert main(["train", str(run), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "training data changed" in err


def test_bad_data_line_is_named(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    run = write_run(tmp_path, model)
    text = run.read_text().replace('data = "data.txt"', 'data = "chat.jsonl"')
    run.write_text(text)
    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n'
    )
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    assert "chat.jsonl:1" in err or "chat.jsonl:2" in err or "chat template" in err


def test_init_adapter_starts_from_an_existing_adapter(tiny_model, tmp_path):
    from retrograd.gguf import GGUFFile

    model = tiny_model("llama")
    first = tmp_path / "first"
    first.mkdir()
    assert main(["train", str(write_run(first, model, training={"epochs": 1}))]) == 0
    start = first / "out" / "adapter.gguf"
    second = tmp_path / "second"
    second.mkdir()
    run = write_run(second, model, training={"epochs": 1, "lr": 1e-12})
    text = run.read_text()
    lora = text[text.index("[lora]") : text.index("[training]")]
    run.write_text(text.replace(lora, f'[lora]\ninit_adapter = "{start}"\n'))
    assert main(["train", str(run)]) == 0
    a, b = GGUFFile(start), GGUFFile(second / "out" / "adapter.gguf")
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        x = np.asarray(a.tensors[name].data.view(np.float32))
        y = np.asarray(b.tensors[name].data.view(np.float16), dtype=np.float32)  # f16 by default
        assert np.abs(x - y).max() <= 1e-3 * max(1.0, float(np.abs(x).max())), name
