"""The GGUF facade: our header parser against gguf-py's reader, and clear errors for bad files."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from retrograd.errors import GGUFError, UnsupportedError
from retrograd.gguf import GGUFFile
from retrograd.model.config import ModelConfig


def test_parser_agrees_with_gguf_py(tiny_model):
    path = tiny_model("qwen2", "MOSTLY_Q4_K_M")
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for name, field in ref.fields.items():
        if name.startswith("GGUF."):
            continue
        value = ours.metadata[name]
        expected = field.contents()
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, np.asarray(expected))
        else:
            assert value == expected, name
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert mine.n_bytes == t.n_bytes
        np.testing.assert_array_equal(mine.data, t.data.reshape(-1).view(np.uint8))


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("hello, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("keep", [0.001, 0.5, 0.999])
def test_truncated_file_names_the_problem(tiny_model, tmp_path, keep):
    data = tiny_model("llama").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(GGUFError, match="truncated") as e:
        GGUFFile(p)
    assert "cut.gguf" in str(e.value)


def _write(path, arch: str, tensors: dict[str, np.ndarray], raw_types=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, arr in tensors.items():
        w.add_tensor(name, arr, raw_dtype=(raw_types or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    p = _write(tmp_path / "m.gguf", "mamba", {"x.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedError, match="architecture 'mamba' is not supported"):
        ModelConfig.from_gguf(GGUFFile(p))


def test_unsupported_tensor_type_is_named(tmp_path):
    import retrograd

    src = GGUFFile(_write(tmp_path / "f.gguf", "llama", {"t.weight": np.zeros(4, np.float64)}))
    assert src.tensor("t.weight").ggml_type == gguf.GGMLQuantizationType.F64
    from retrograd.model.dequant import check_supported

    with pytest.raises(UnsupportedError, match="t.weight.*F64"):
        check_supported(src.tensor("t.weight").ggml_type, where="t.weight")
    with pytest.raises(UnsupportedError, match="f.gguf: tensor t.weight: ggml type F64"):
        retrograd.load(src.path, device="cpu")


# -- hostile headers: each a GGUFError naming the file, never a crash or an allocation of the
# size the header claims ------------------------------------------------------------------

_STRING, _ARRAY, _UINT32, _INT32 = 8, 9, 4, 5


def _gguf(tmp_path, kvs: bytes, n_kv: int, n_tensors: int = 0, tail: bytes = b"") -> object:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tail)
    return path


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _nested_arrays(levels: int) -> bytes:
    # an array of one array of one array ... of no uint32
    return (
        _key("x")
        + struct.pack("<I", _ARRAY)
        + struct.pack("<IQ", _ARRAY, 1) * (levels - 1)
        + struct.pack("<IQ", _UINT32, 0)
    )


def test_arrays_nested_a_hundred_thousand_deep_are_malformed_not_a_recursion_error(tmp_path):
    path = _gguf(tmp_path, _nested_arrays(100_000), 1)
    with pytest.raises(GGUFError, match=r"hostile\.gguf: malformed GGUF header: .*nested"):
        GGUFFile(path)
    shallow = GGUFFile(_gguf(tmp_path, _nested_arrays(3), 1)).get("x")
    assert len(shallow) == 1 and len(shallow[0]) == 1 and len(shallow[0][0]) == 0


def test_a_string_array_cut_inside_a_length_is_truncated(tmp_path):
    # three strings announced; the file ends four bytes into the second one's length
    kv = _key("v") + struct.pack("<IIQ", _ARRAY, _STRING, 3) + _key("a") + b"\x01\x00\x00\x00"
    with pytest.raises(GGUFError, match=r"hostile\.gguf: truncated GGUF"):
        GGUFFile(_gguf(tmp_path, kv, 1))


@pytest.mark.parametrize(
    "alignment", [(_UINT32, 0), (_INT32, -32), (_STRING, "32"), (_UINT32, 3), (_UINT32, 48)]
)
def test_an_alignment_that_is_not_a_power_of_two_is_malformed(tmp_path, alignment):
    kind, value = alignment
    raw = _key(value) if kind == _STRING else struct.pack("<i" if kind == _INT32 else "<I", value)
    kv = _key("general.alignment") + struct.pack("<I", kind) + raw
    with pytest.raises(
        GGUFError, match=r"hostile\.gguf: malformed GGUF header: general\.alignment"
    ):
        GGUFFile(_gguf(tmp_path, kv, 1))


@pytest.mark.parametrize(
    ("n_kv", "n_tensors", "kvs"),
    [
        (1 << 62, 0, b""),  # counts no file holds: read until the file ends, never allocated
        (0, 1 << 62, b""),
        (1, 0, _key("a") + bytes([_ARRAY, 0, 0, 0, _UINT32, 0, 0, 0]) + b"\xff" * 8),
        (1, 0, _key("a") + bytes([_ARRAY, 0, 0, 0, _ARRAY, 0, 0, 0]) + b"\xff" * 8),
        (1, 0, _key("a") + bytes([_ARRAY, 0, 0, 0, _STRING, 0, 0, 0]) + b"\xff" * 8),
        (1, 0, b"\xff" * 8),  # a key of 2^64 - 1 bytes
    ],
)
def test_counts_past_the_file_are_truncated(tmp_path, n_kv, n_tensors, kvs):
    with pytest.raises(GGUFError, match=r"hostile\.gguf: truncated GGUF"):
        GGUFFile(_gguf(tmp_path, kvs, n_kv, n_tensors))


def _tensor(name: str, ne: tuple[int, ...], offset: int = 0) -> bytes:
    """A tensor-table entry: an F32 tensor of ggml dims `ne` at `offset`."""
    return (
        _key(name)
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", 0, offset)
    )


def _u32(name: str, value: int) -> bytes:
    return _key(name) + struct.pack("<II", _UINT32, value)


@pytest.mark.parametrize(
    ("n_kv", "n_tensors", "body", "why"),
    [
        # llama.cpp and gguf-py refuse these; the last one read would silently win
        (
            2,
            0,
            _u32("a.block_count", 2) + _u32("a.block_count", 3),
            r"metadata key 'a.block_count' appears twice",
        ),
        (0, 2, _tensor("w", (4,)) + _tensor("w", (4,), 16), r"tensor 'w' appears twice"),
        (0, 1, _tensor("w", (1,) * 1000), r"tensor 'w' has 1000 dimensions \(ggml has at most 4\)"),
    ],
)
def test_what_llama_cpp_refuses_in_a_header_is_malformed(tmp_path, n_kv, n_tensors, body, why):
    with pytest.raises(GGUFError, match=r"hostile\.gguf: malformed GGUF header: " + why):
        GGUFFile(_gguf(tmp_path, body, n_kv, n_tensors, tail=b"\0" * 64))


def _clone(src, dst, overrides: dict, drop_tensors=()):
    """`src` rewritten by gguf-py with some metadata values replaced: a file someone crafted."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in overrides:
            value, vtype = overrides[name]
            w.add_key_value(name, value, vtype)
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), field.types[0])
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        # sized a tuple a layer before any tensor was read: minutes and gigabytes, then a
        # MemoryError; now refused at once against the blocks the file holds
        (
            "llama.block_count",
            (10**8, U32),
            r"block_count = 100000000, but the file holds tensors for 2 blocks",
        ),
        ("llama.block_count", (0, U32), r"block_count = 0: must be a whole number >= 1"),
        ("llama.block_count", ("two", STR), r"block_count = 'two': must be a whole number >= 1"),
        ("llama.embedding_length", (0, U32), r"embedding_length = 0: must be a whole number >= 1"),
        # sized the rope's tables: a 2^31-wide table at the first forward
        (
            "llama.rope.dimension_count",
            (2**31, U32),
            r"rope.dimension_count = 2147483648: must be at most the head dimension \(\d+\)",
        ),
    ],
)
def test_metadata_that_would_size_memory_is_checked_before(tiny_model, tmp_path, key, value, why):
    path = _clone(tiny_model("llama"), tmp_path / "crafted.gguf", {key: value})
    with pytest.raises(GGUFError, match=r"^crafted.gguf: llama\." + why):
        ModelConfig.from_gguf(GGUFFile(path))


def test_the_untouched_clone_reads_as_its_source(tiny_model, tmp_path):
    path = _clone(tiny_model("llama"), tmp_path / "same.gguf", {})
    assert ModelConfig.from_gguf(GGUFFile(path)) == ModelConfig.from_gguf(
        GGUFFile(tiny_model("llama"))
    )
