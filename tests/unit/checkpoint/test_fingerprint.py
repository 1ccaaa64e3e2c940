"""Fingerprints change with the content they stand for, and only with it."""

from __future__ import annotations

import hashlib
import shutil

import gguf

from retrograd.checkpoint import (
    file_fingerprint,
    model_fingerprint,
    model_identity,
    settings_signature,
)
from retrograd.gguf import GGUFFile


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def tensor_offset(path, name, within):
    """File offset of byte `within` of tensor `name`'s data (gguf-py's reader, not ours)."""
    [t] = [t for t in gguf.GGUFReader(path).tensors if t.name == name]
    return t.data_offset + within


def test_model_identity_tracks_content_not_location(tiny_model, tmp_path):
    src = tiny_model("llama")
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(src, copy)
    ident = model_identity(src)
    assert model_identity(copy) == ident and ident.bytes == src.stat().st_size
    assert ident.fingerprint.startswith("sha256:") and len(ident.fingerprint) == 7 + 64
    assert model_fingerprint(src) == ident.fingerprint


def test_sampled_tensor_bytes_and_metadata_change_the_fingerprint(tiny_model, tmp_path):
    src = tiny_model("llama")
    base = model_identity(src)
    n = GGUFFile(src).tensor("blk.0.ffn_up.weight").n_bytes
    for where in (0, n // 3, n - 1):  # start, a middle sample, the last byte
        copy = tmp_path / f"w{where}.gguf"
        shutil.copyfile(src, copy)
        flip(copy, tensor_offset(copy, "blk.0.ffn_up.weight", where))
        changed = model_identity(copy)
        assert changed.fingerprint != base.fingerprint
        assert changed.signature == base.signature  # same layout
    # The documented limit: a byte between the samples goes unnoticed (docs/checkpoints.md).
    copy = tmp_path / "between.gguf"
    shutil.copyfile(src, copy)
    flip(copy, tensor_offset(copy, "blk.0.ffn_up.weight", n // 6))
    assert model_identity(copy).fingerprint == base.fingerprint
    other = model_identity(tiny_model("qwen3"))
    assert other.signature != base.signature and other.fingerprint != base.fingerprint


def test_file_fingerprint_is_sha256_of_every_byte(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes(b'{"text": "a"}\n')
    assert file_fingerprint(p) == "sha256:" + hashlib.sha256(b'{"text": "a"}\n').hexdigest()
    before = file_fingerprint(p)
    p.write_bytes(b'{"text": "b"}\n')
    assert file_fingerprint(p) != before


def test_settings_signature_ignores_key_order_not_values():
    a = settings_signature({"x": 1, "y": {"b": [1, 2], "a": 0.5}})
    assert a == settings_signature({"y": {"a": 0.5, "b": (1, 2)}, "x": 1})
    assert a != settings_signature({"x": 1, "y": {"b": [1, 2], "a": 0.25}})
    assert a != settings_signature({"x": 1.0, "y": {"b": [1, 2], "a": 0.5}})
