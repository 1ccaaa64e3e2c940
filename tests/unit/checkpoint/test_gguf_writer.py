"""The atomic GGUF writer under checkpoints and adapter exports (retrograd.gguf.writer)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from retrograd.gguf import GGUFFile, RawTensor, Typed, atomic_copy, write_gguf
from retrograd.gguf.writer import GGUFWriter


def test_metadata_types_and_tensors_round_trip(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = write_gguf(
        tmp_path / "m.gguf",
        architecture="llama",
        metadata={
            "a.str": "s",
            "a.bool": True,
            "a.f32": 0.5,
            "a.u32": 7,
            "a.names": ["x", "y"],
            "a.i64": Typed(-(2**40), gguf.GGUFValueType.INT64),
            "a.ints": Typed([1, 2], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
        },
        tensors={"t.weight": x, "h.weight": x.astype(np.float16)},
    )
    r = gguf.GGUFReader(path)
    types = {f.name: f.types for f in r.fields.values()}
    T = gguf.GGUFValueType
    assert types["a.bool"] == [T.BOOL] and types["a.f32"] == [T.FLOAT32]
    assert types["a.u32"] == [T.UINT32] and types["a.i64"] == [T.INT64]
    assert types["a.ints"] == [T.ARRAY, T.INT32] and types["a.names"] == [T.ARRAY, T.STRING]
    g = GGUFFile(path)
    assert (
        g.architecture == "llama" and g.get("a.i64") == -(2**40) and g.get("a.names") == ["x", "y"]
    )
    assert g.tensor("t.weight").shape == (3, 4) and g.tensor("h.weight").type_name == "F16"
    np.testing.assert_array_equal(g.tensor("t.weight").data.view(np.float32).reshape(3, 4), x)


def test_raw_tensors_copy_quantized_and_bf16_bytes(tiny_model, tmp_path):
    src = GGUFFile(tiny_model("llama", "MOSTLY_Q8_0"))
    q = src.tensor("blk.0.ffn_up.weight")
    assert q.type_name == "Q8_0"
    bf16 = np.arange(64, dtype=np.uint16).reshape(4, 16)
    path = write_gguf(
        tmp_path / "raw.gguf",
        architecture="llama",
        metadata={},
        tensors={
            q.name: RawTensor(q.data, q.shape, q.ggml_type),
            "b.weight": RawTensor(bf16, (4, 16), gguf.GGMLQuantizationType.BF16),
        },
    )
    g = GGUFFile(path)
    assert g.tensor(q.name).shape == q.shape and g.tensor(q.name).data.tobytes() == q.data.tobytes()
    assert g.tensor("b.weight").type_name == "BF16" and g.tensor("b.weight").shape == (4, 16)
    assert g.tensor("b.weight").data.tobytes() == bf16.tobytes()


def test_failure_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    old = write_gguf(tmp_path / "m.gguf", architecture="llama", metadata={}, tensors={})
    before = old.read_bytes()

    def half(self, **kw):
        self.fout[0].write(b"\0" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", half)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(old, architecture="llama", metadata={}, tensors={"t": np.ones(4, np.float32)})
    assert old.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_uninferable_metadata_is_refused(tmp_path):
    with pytest.raises(ValueError, match="explicit Typed"):
        write_gguf(tmp_path / "m.gguf", architecture="llama", metadata={"k": -1}, tensors={})
    with pytest.raises(TypeError, match="cannot infer"):
        write_gguf(tmp_path / "m.gguf", architecture="llama", metadata={"k": {}}, tensors={})
    assert list(tmp_path.iterdir()) == []


def test_atomic_copy(tmp_path):
    (tmp_path / "a").write_bytes(b"new")
    (tmp_path / "b").write_bytes(b"old")
    atomic_copy(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == b"new"
    with pytest.raises(FileNotFoundError):
        atomic_copy(tmp_path / "missing", tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
