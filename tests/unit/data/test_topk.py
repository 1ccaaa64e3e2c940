"""The .topk sidecar: written atomically, read back bit for bit, and refused when it is not
one, is cut short, or belongs to another tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from retrograd.data.topk import MAGIC, TopK, read_topk, tokenizer_fingerprint, write_topk
from retrograd.errors import DataError


def sample(k: int = 3) -> TopK:
    rng = np.random.default_rng(0)
    counts = np.array([2, 0, 3], dtype=np.int32)
    n = int(counts.sum())
    return TopK(
        k,
        128,
        {"file": "chat.jsonl", "sha256": "ab" * 32},
        "sha256:" + "cd" * 32,
        {"file": "teacher.gguf", "fingerprint": "sha256:" + "ef" * 32},
        counts,
        rng.integers(0, 500, n).astype(np.int32),
        rng.integers(0, 500, (n, k)).astype(np.int32),
        -rng.random((n, k)).astype(np.float32),
    )


def test_round_trip_is_exact_and_aligned(tmp_path):
    topk = sample()
    path = write_topk(tmp_path / "c.topk", topk)
    assert path.read_bytes()[:8] == MAGIC
    back = read_topk(path)
    for name in ("counts", "targets", "ids", "logprobs"):
        assert np.array_equal(getattr(back, name), getattr(topk, name))
    assert back.header() == topk.header()
    assert back.rows(2) == slice(2, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["c.topk"]  # no temporary left


def test_a_file_that_is_not_a_sidecar_or_is_cut_short_is_refused(tmp_path):
    (tmp_path / "x.topk").write_text('{"messages": []}\n')
    with pytest.raises(DataError, match="not a .topk sidecar"):
        read_topk(tmp_path / "x.topk", "[distill].sidecar")
    raw = write_topk(tmp_path / "c.topk", sample()).read_bytes()
    (tmp_path / "cut.topk").write_bytes(raw[: len(raw) - 10])
    with pytest.raises(DataError, match="truncated"):
        read_topk(tmp_path / "cut.topk")
    deep = ("[" * 100_000 + "]" * 100_000).encode()  # a header no parser recurses through
    (tmp_path / "deep.topk").write_bytes(MAGIC + len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(DataError, match="its header is not JSON"):
        read_topk(tmp_path / "deep.topk")


def test_tokenizer_fingerprint_sees_the_vocabulary_not_the_template():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}
    same = dict(meta, **{"tokenizer.chat_template": "{{ x }}", "general.name": "other"})
    other = dict(meta, **{"tokenizer.ggml.tokens": ["a", "c"]})
    assert tokenizer_fingerprint(meta) == tokenizer_fingerprint(same)
    assert tokenizer_fingerprint(meta) != tokenizer_fingerprint(other)
