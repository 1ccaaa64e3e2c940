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


def _with_header(tmp_path, change) -> object:
    """The sample sidecar with its JSON header changed (padded to its length, as written)."""
    import json
    import struct

    raw = write_topk(tmp_path / "c.topk", sample()).read_bytes()
    (head_len,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + head_len])
    body = json.dumps(change(header)).encode()
    assert len(body) <= head_len, "the changed header must fit the written one"
    path = tmp_path / "hostile.topk"
    path.write_bytes(raw[:16] + body + b" " * (head_len - len(body)) + raw[16 + head_len :])
    return path


def _array(name, **change):
    def apply(h):
        h["arrays"][name] |= change
        return h

    return apply


HOSTILE_HEADERS = [
    # a shape of -1 read the rest of the file: 11 positions where 3 were declared
    (
        "a negative shape",
        _array("ids", shape=[-1, 3]),
        r"malformed: ValueError: array ids: shape \[-1, 3\]",
    ),
    (
        "shapes that disagree",
        _array("logprobs", shape=[4, 3]),
        r"logprobs: shape \(4, 3\), expected \(5, 3\)",
    ),
    ("a shape of the wrong rank", _array("counts", shape=[3, 1]), r"array counts: shape \[3, 1\]"),
    ("a float offset", _array("ids", offset=64.5), r"array ids: shape \[5, 3\] and offset 64.5"),
    ("a negative offset", _array("ids", offset=-8), r"array ids: shape \[5, 3\] and offset -8"),
    ("an offset into the header", _array("ids", offset=0), r"array ids is cut short"),
    (
        "a shape that wraps 64 bits",
        _array("ids", shape=[(1 << 62) + 5, 4]),
        r"array ids is cut short",
    ),
    ("a list header", lambda h: [h], r"its header is not a JSON object"),
    (
        "no arrays",
        lambda h: {k: v for k, v in h.items() if k != "arrays"},
        r"malformed: KeyError: 'arrays'",
    ),
    ("arrays a list", lambda h: h | {"arrays": [1]}, r"malformed: TypeError"),
    ("k zero", lambda h: h | {"k": 0}, r"malformed: ValueError: k = 0"),
    (
        "a teacher that is a string",
        lambda h: h | {"teacher": "x"},
        r"teacher = 'x': must be a dict",
    ),
]


@pytest.mark.parametrize(
    ("what", "change", "why"), HOSTILE_HEADERS, ids=[h[0] for h in HOSTILE_HEADERS]
)
def test_a_hostile_header_is_a_data_error_naming_the_file(tmp_path, what, change, why):
    """A sidecar may be anyone's: every malformed layout is a DataError naming the file and
    what is wrong, never a silent misread or a raw KeyError."""
    path = _with_header(tmp_path, change)
    with pytest.raises(
        DataError, match=r"\[distill\].sidecar = .*hostile.topk: not a .topk sidecar"
    ) as refused:
        read_topk(path, "[distill].sidecar")
    assert refused.match(why)


def test_teacher_ids_outside_the_vocabulary_are_refused():
    from retrograd.algorithms.distill_offline import check_sidecar_ids

    topk = sample()
    check_sidecar_ids(topk, 500, "c.topk")  # ids drawn from [0, 500)
    with pytest.raises(
        DataError, match=r"c.topk: ids holds token 4\d\d, outside the model's vocabulary of 400"
    ):
        check_sidecar_ids(topk, 400, "c.topk")
    topk.targets[0] = -1
    with pytest.raises(DataError, match=r"targets holds token -1"):
        check_sidecar_ids(topk, 500, "c.topk")
