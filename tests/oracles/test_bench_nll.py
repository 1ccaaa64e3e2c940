"""`retrograd bench`'s loss against llama.cpp's on the same tokens, on the real Gemma.

bench loads the model in float32 and scores each example with `bench.score`; llama.cpp scores
the same ids on an F32 copy of the same weights (its exact settings, every position's logits),
and the NLL of the trained positions is taken from its logits with a float64 log-softmax.
Measured: 7e-4 nats per example at most, 7e-5 on the mean (docs/exactness.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from retrograd.algorithms.context import chat_format
from retrograd.algorithms.evaluate import example_nlls
from retrograd.cli.bench import load_float32, score
from retrograd.config import load_run
from retrograd.data.sft import Example, load_sft_data
from tests.oracles.llama_oracle import open_llama

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def llama_nll(path: Path, examples: list[Example]) -> list[tuple[float, int]]:
    """(summed NLL, trained tokens) of each example, from llama.cpp's logits."""
    llm = open_llama(path, n_ctx=max(64, max(len(e.ids) for e in examples)))
    out = []
    for ex in examples:
        llm.reset()
        llm.eval(list(ex.ids))
        z = np.array(llm.scores[: len(ex.ids) - 1], dtype=np.float64)  # row i predicts i + 1
        logp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
        nll = -logp[np.arange(len(ex.ids) - 1), list(ex.ids[1:])]
        keep = np.array(ex.mask[1:], dtype=bool)
        out.append((float(nll[keep].sum()), int(keep.sum())))
    llm.close()
    return out


def write_run(tmp: Path, model: Path) -> Path:
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
ctx = 64
micro_batch = 64
[sft]
data = "chat.jsonl"
""")
    return run


def test_bench_nll_equals_llama_cpp(gemma_path, gemma_f32, tmp_path):
    lines = (ROOT / "examples" / "demo" / "pirate-eval.jsonl").read_text().splitlines()
    (tmp_path / "chat.jsonl").write_text("\n".join(lines[:2]) + "\n")
    text = (ROOT / "tests" / "data" / "varied.txt").read_text()
    (tmp_path / "text.txt").write_text(text[:160])  # prose in two languages, one window
    cfg = load_run(write_run(tmp_path, gemma_path))
    model = load_float32(cfg)  # what bench scores with
    chat = load_sft_data(tmp_path / "chat.jsonl", model.tokenizer, 64, None, chat_format(model))
    plain = load_sft_data(tmp_path / "text.txt", model.tokenizer, 64)
    assert len(chat.examples) == 2 and len(plain.examples) == 1
    everything = llama_nll(gemma_f32, [*chat.examples, *plain.examples])
    for data, theirs in ((chat, everything[:2]), (plain, everything[2:])):
        ours = list(example_nlls(model.decoder, data))
        assert [e.tokens for e in ours] == [n for _, n in theirs]
        for e, (nll, n) in zip(ours, theirs, strict=True):
            assert abs(e.nll / n - nll / n) < 0.01, (e.where, e.nll / n, nll / n)
        loss, count = score(model.decoder, data, len(data.examples), "base model")
        ref = sum(t for t, _ in theirs) / count
        assert abs(loss - ref) < 1e-3, (data.path.name, loss, ref)
        assert 0.5 < loss < 20  # a real loss, not a degenerate one that matches by accident
