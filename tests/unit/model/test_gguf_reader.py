"""The GGUF facade: our header parser against gguf-py's reader, and clear errors for bad files."""

from __future__ import annotations

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
