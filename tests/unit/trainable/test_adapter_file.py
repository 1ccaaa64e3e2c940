"""A LoRA GGUF handed over by anyone: its alpha, its rank and its tensors' shapes are checked
(before anything is dequantized) and refused with a GGUFError naming the file, never a
ZeroDivisionError, a ValueError out of float() or a NaN scale."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import retrograd
from retrograd.errors import GGUFError
from retrograd.trainable.lora import apply_adapter_file

TARGET = "blk.0.attn_q.weight"


@pytest.fixture(scope="module")
def decoder(tiny_model):
    return retrograd.load(tiny_model("llama"), device="cpu", dtype=torch.float32).decoder


def _adapter(path, decoder, *, alpha=("f", 8.0), rank=4, tensors=None):
    n_out, n_in = _shape(decoder)
    w = gguf.GGUFWriter(str(path), decoder.cfg.name)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    kind, value = alpha
    if kind == "f":
        w.add_float32("adapter.lora.alpha", value)
    elif kind == "s":
        w.add_string("adapter.lora.alpha", value)
    elif kind == "arr":
        w.add_array("adapter.lora.alpha", value)
    elif kind == "b":
        w.add_bool("adapter.lora.alpha", value)
    pairs = tensors or {
        ".lora_a": np.zeros((rank, n_in), np.float32),
        ".lora_b": np.zeros((n_out, rank), np.float32),
    }
    for suffix, array in pairs.items():
        w.add_tensor(TARGET + suffix, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _shape(decoder) -> tuple[int, int]:
    from retrograd.trainable.lora import target_modules

    lin = target_modules(decoder)[TARGET.removesuffix(".weight")]
    return lin.out_features, lin.in_features


def test_a_well_formed_adapter_applies(decoder, tmp_path):
    applied = apply_adapter_file(decoder, _adapter(tmp_path / "ok.gguf", decoder))
    (lora,) = applied.values()
    assert lora.rank == 4 and lora.scale == 2.0


@pytest.mark.parametrize(
    ("alpha", "why"),
    [
        (("s", "abc"), r"adapter.lora.alpha = 'abc': must be a finite number"),
        (("arr", [1, 2]), r"adapter.lora.alpha = .*\[1, 2\].*: must be a finite number"),
        (("f", float("nan")), r"adapter.lora.alpha = nan: must be a finite number"),
        (("f", float("inf")), r"adapter.lora.alpha = inf: must be a finite number"),
        (("b", True), r"adapter.lora.alpha = True: must be a finite number"),
    ],
)
def test_an_alpha_that_is_not_a_finite_number_is_refused(decoder, tmp_path, alpha, why):
    with pytest.raises(GGUFError, match=r"^bad.gguf: " + why):
        apply_adapter_file(decoder, _adapter(tmp_path / "bad.gguf", decoder, alpha=alpha))


def test_a_rank_of_zero_or_a_missing_half_is_refused(decoder, tmp_path):
    with pytest.raises(GGUFError, match=r"do not fit a \d+x\d+ weight at a rank of at least 1"):
        apply_adapter_file(decoder, _adapter(tmp_path / "r0.gguf", decoder, rank=0))
    n_out, n_in = _shape(decoder)
    half = {".lora_a": np.zeros((4, n_in), np.float32)}
    with pytest.raises(GGUFError, match=r"lora_a has no blk.0.attn_q.weight.lora_b"):
        apply_adapter_file(decoder, _adapter(tmp_path / "half.gguf", decoder, tensors=half))
    wrong = {
        ".lora_a": np.zeros((4, n_in + 1), np.float32),
        ".lora_b": np.zeros((n_out, 4), np.float32),
    }
    with pytest.raises(GGUFError, match=r"lora_a \(4, \d+\) and lora_b"):
        apply_adapter_file(decoder, _adapter(tmp_path / "wrong.gguf", decoder, tensors=wrong))
