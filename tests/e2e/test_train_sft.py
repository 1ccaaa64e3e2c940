"""`retrograd train` and `retrograd bench` for SFT, end to end, as a user runs them."""

from __future__ import annotations

import json
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
    return {e.step: e.value for e in scalar_events(tb, tag)}


def scalar_events(tb: Path, tag: str) -> list:
    """Every record of `tag`, in the order written (each has .step and .value)."""
    out = []
    for run in sorted(tb.iterdir()):
        acc = EventAccumulator(str(run))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.extend(acc.Scalars(tag))
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


def kill_after_checkpoint(run: Path, state: Path, timeout: float = 300) -> None:
    """`retrograd train run` in its own process, killed with SIGKILL as soon as the checkpoint
    `state` is complete."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrograd.cli.main", "train", str(run)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + timeout
    while not (state / "manifest.msgpack").exists() and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (state / "manifest.msgpack").exists(), proc.stderr.read().decode()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"


WINDOWED = {"ctx": 128, "micro_batch": 32, "gradient_accumulation": 1, "epochs": 12}


@pytest.mark.parametrize(
    "training, every, kill_after",
    [
        ({"epochs": 3}, 4, 8),  # a window is one step: checkpoints fall between windows
        (WINDOWED, 3, 6),  # four steps a window: step 6 is the second step of window 2
    ],
    ids=["one-step-windows", "inside-a-window"],
)
def test_killed_run_resumes_to_the_same_losses(tiny_model, tmp_path, training, every, kill_after):
    """A real SIGKILL mid-run, then --resume: the losses and the adapter's bytes equal an
    uninterrupted run's, also when the checkpoint cut a window between two of its steps."""
    from retrograd.checkpoint import load_checkpoint, step_id

    model = tiny_model("gemma3")
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full_dir.mkdir()
    cut_dir.mkdir()
    ck = f'directory = "ck"\nmode = "steps_and_best_eval"\nevery_steps = {every}'
    over = {"training": training, "checkpoint": ck}
    assert main(["train", str(write_run(full_dir, model, **dict(over)))]) == 0
    run = write_run(cut_dir, model, **dict(over))
    state = cut_dir / "ck" / f"{step_id(kill_after)}.state"
    kill_after_checkpoint(run, state)
    assert not (cut_dir / "out" / "adapter.gguf").exists()
    inside = load_checkpoint(state).dataset.extra["group"] > 0
    assert inside == (training is WINDOWED)
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


# -- chat data with the reference's default passes --------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
RECORDS = [  # prompts of 73 and 92 tokens in the tiny vocabulary: longer than a pass of 32
    ("tell me about the sun and the hill", "the sun rose"),
    ("hi", "the cat sat on the mat"),
    ("tell me about the sun and the hill and the tree", "a bird sang " * 3),
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("chat") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def chat_run(tmp: Path, model: Path, training: str = "", extra: str = "") -> Path:
    """A chat run that leaves ctx, micro_batch and gradient_accumulation at their defaults."""
    records = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in RECORDS
    ]
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp / "run.toml"
    run.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
device = "cpu"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
dtype = "f32"
[training]
lr = 5e-3
{training}
[sft]
data = "chat.jsonl"
[metrics]
tensorboard_dir = "tb"
{extra}
""")
    return run


def test_chat_sft_with_default_passes_steps_only_where_tokens_train(chat_model, tmp_path):
    """ctx 128, micro_batch 32, accumulation 1: a prompt longer than a pass leaves passes
    without a trained token; they make no step, and the step count says so."""
    from retrograd.algorithms.context import chat_format
    from retrograd.algorithms.step import groups_of
    from retrograd.config import load_run
    from retrograd.data.sft import load_sft_data

    model = chat_model
    run = chat_run(tmp_path, model)
    cfg = load_run(run)
    assert (cfg.training.ctx, cfg.training.micro_batch) == (128, 32)
    loaded = retrograd.load(model, device="cpu")
    data = load_sft_data(tmp_path / "chat.jsonl", loaded.tokenizer, 128, None, chat_format(loaded))
    passes = [(e, (len(e.ids) + 31) // 32) for e in data.examples]
    assert any(n > 1 for _, n in passes), "a record must span several passes"
    groups = [g for e, _ in passes for g in groups_of(e, 32, 1)]
    assert all(g.n_targets > 0 for g in groups)
    steps = len(groups)
    assert steps < sum(n for _, n in passes)  # some passes only gave context
    assert main(["train", str(run)]) == 0
    losses = scalars(tmp_path / "tb", "train/loss")
    assert sorted(losses) == list(range(1, steps + 1))
    assert all(np.isfinite(v) for v in losses.values())
    assert (tmp_path / "out" / "adapter.gguf").exists()


# -- outputs never destroy inputs -------------------------------------------------------------


def _no_model_load(monkeypatch):
    import retrograd.algorithms.context as context

    def refuse(cfg):
        raise AssertionError("the model was loaded before the outputs were checked")

    monkeypatch.setattr(context, "load_model", refuse)


@pytest.mark.parametrize("target", ["model", "data", "run file", "checkpoint dir", "directory"])
def test_an_output_that_would_destroy_an_input_is_refused_before_loading(
    tiny_model, tmp_path, capsys, monkeypatch, target
):
    model = tmp_path / "base.gguf"
    model.write_bytes(tiny_model("llama").read_bytes())
    run = write_run(tmp_path, model)
    text = run.read_text()
    if target == "model":
        text = text.replace('path = "out/adapter.gguf"', 'path = "base.gguf"')
    elif target == "data":
        text = text.replace('path = "out/adapter.gguf"', 'path = "data.txt"')
    elif target == "run file":
        text = text.replace('path = "out/adapter.gguf"', 'path = "run.toml"')
    elif target == "checkpoint dir":
        text = text.replace('directory = "ck"', 'directory = "."')
    else:
        (tmp_path / "out" / "adapter.gguf").mkdir(parents=True)
    run.write_text(text)
    before = {p: p.read_bytes() for p in (model, tmp_path / "data.txt", run)}
    _no_model_load(monkeypatch)
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    expected = {
        "model": "[output].path",
        "data": "[output].path",
        "run file": "the run file",
        "checkpoint dir": "[checkpoint].directory",
        "directory": "existing directory",
    }[target]
    assert expected in err, err
    assert {p: p.read_bytes() for p in before} == before


def test_an_unwritable_output_folder_is_refused_before_loading(
    tiny_model, tmp_path, capsys, monkeypatch
):
    run = write_run(tmp_path, tiny_model("llama"))
    # a folder under a regular file cannot be made, whoever runs the test
    run.write_text(run.read_text().replace("out/adapter.gguf", "data.txt/adapter.gguf"))
    _no_model_load(monkeypatch)
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    assert "[output].path" in err and "cannot write" in err


@pytest.mark.parametrize("with_checkpoints", [True, False])
def test_a_failed_export_keeps_the_trained_adapter(
    tiny_model, tmp_path, capsys, monkeypatch, with_checkpoints
):
    import retrograd.checkpoint.export as export
    from retrograd.gguf import GGUFFile

    model = tiny_model("llama")
    run = write_run(tmp_path, model, training={"epochs": 1})
    if not with_checkpoints:
        text = run.read_text()
        run.write_text(text[: text.index("[checkpoint]")] + text[text.index("[metrics]") :])
    real = export.write_lora_adapter
    out = tmp_path / "out" / "adapter.gguf"

    def disk_full(path, **kw):
        if Path(path) == out:
            raise OSError(28, "No space left on device")
        return real(path, **kw)

    monkeypatch.setattr(export, "write_lora_adapter", disk_full)
    assert main(["train", str(run)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "No space left on device" in err and "kept in" in err, err
    kept = Path(err.split("kept in ")[1].split()[0])
    if with_checkpoints:
        assert kept.parent == tmp_path / "ck" and kept.name.startswith("step-")
    else:
        assert kept == tmp_path / "adapter.rescued.gguf"
    assert not out.exists()
    adapter = GGUFFile(kept)
    assert any(name.endswith(".lora_b") for name in adapter.tensors)


def test_a_non_finite_loss_stops_the_run_at_its_step(tiny_model, tmp_path, capsys):
    import gguf

    model = tmp_path / "broken.gguf"
    model.write_bytes(tiny_model("llama").read_bytes())
    reader = gguf.GGUFReader(model, "r+")
    [norm] = [t for t in reader.tensors if t.name == "output_norm.weight"]
    norm.data[3] = np.inf  # a corrupt file: every logit becomes non-finite
    reader.data.flush()
    del reader
    run = write_run(tmp_path, model)
    assert main(["train", str(run)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "step 1 (" in err and "the loss is nan" in err, err
    assert not (tmp_path / "out" / "adapter.gguf").exists()
    assert not (tmp_path / "tb").exists() or scalars(tmp_path / "tb", "train/loss") == {}


def test_muon_trains_adapters_with_adamw_at_its_fallback_rate(tiny_model, tmp_path):
    """The reference: LoRA factors go to AdamW at [optimizer.muon].fallback_learning_rate."""
    model = tiny_model("llama")
    adamw, muon = tmp_path / "adamw", tmp_path / "muon"
    adamw.mkdir()
    muon.mkdir()
    assert main(["train", str(write_run(adamw, model, training={"epochs": 1, "lr": 0.02}))]) == 0
    run = write_run(muon, model, training={"epochs": 1, "optimizer": "muon"})
    run.write_text(run.read_text().replace("lr = 0.005\n", ""))  # muon: lr is refused
    run.write_text(run.read_text() + "[optimizer.muon]\nfallback_learning_rate = 0.02\n")
    assert main(["train", str(run)]) == 0
    rates = scalars(muon / "tb", "optimizer/learning_rate").values()
    assert rates and all(r == pytest.approx(0.02) for r in rates)
    assert (adamw / "out" / "adapter.gguf").read_bytes() == (
        muon / "out" / "adapter.gguf"
    ).read_bytes()


def test_require_gpu_resident_refuses_a_run_on_the_cpu(tiny_model, tmp_path, capsys):
    run = write_run(tmp_path, tiny_model("llama"))
    run.write_text(
        run.read_text().replace("[training]\n", "[training]\nrequire_gpu_resident = true\n")
    )
    assert main(["train", str(run)]) == 1
    err = capsys.readouterr().err
    assert "[training].require_gpu_resident = true: the run is on the CPU" in err
    assert not (tmp_path / "out" / "adapter.gguf").exists()


def test_a_run_refused_for_its_data_leaves_no_folders(tiny_model, tmp_path, capsys):
    run = write_run(tmp_path, tiny_model("llama"))
    (tmp_path / "data.txt").write_text("  \n\t\n")
    assert main(["train", str(run)]) == 1
    assert "no text to train on" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()
    assert not (tmp_path / "tb").exists()
