"""SFT on the real Gemma 3 270M Q4_K_M: the adapter changes the model the way the data says,
and llama.cpp applies it as we do (tolerances in docs/exactness.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import retrograd
from retrograd.algorithms.context import chat_format
from retrograd.cli.main import main
from tests.oracles.llama_oracle import llama_logits

pytestmark = [pytest.mark.slow, pytest.mark.oracle]
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"


def test_gemma_sft_adapter_matches_llama_cpp(gemma_path, gemma_f32, tmp_path, capsys):
    # the reference's default passes: ctx 128 in passes of 32 tokens, one pass a step
    lines = (DEMO / "pirate-train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:12]) + "\n")
    (tmp_path / "eval.jsonl").write_text((DEMO / "pirate-eval.jsonl").read_text())
    run = tmp_path / "run.toml"
    run.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{gemma_path}"
device = "cpu"
[output]
path = "pirate.gguf"
[lora]
targets = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
[training]
lr = 2e-3
epochs = 2
[sft]
data = "train.jsonl"
""")
    assert main(["train", str(run)]) == 0
    adapter = tmp_path / "pirate.gguf"
    capsys.readouterr()
    assert (
        main(["bench", str(run), "--data", str(tmp_path / "eval.jsonl"), "--adapter", str(adapter)])
        == 0
    )
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("│")]
    base_loss, tuned_loss = (float(r.split("│")[2]) for r in rows[:2])
    assert tuned_loss < base_loss / 3  # the held-out answers are now the likely ones

    model = retrograd.load(gemma_path, device="cpu", dtype=torch.float32, adapter=adapter)
    ids = chat_format(model).prompt_ids([{"role": "user", "content": "What color is a lime?"}])
    ids = ids + model.tokenize("Arr, matey! A lime be green.", add_bos=False)
    ours = model.logits(ids).numpy()
    ref = llama_logits(gemma_f32, ids, lora_path=str(adapter))
    base = llama_logits(gemma_f32, ids)
    assert np.abs(ref - base).max() > 1.0
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(ours - ref).max() < 0.1
