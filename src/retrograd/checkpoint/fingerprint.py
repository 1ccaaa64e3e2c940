"""Fingerprints that tell resume whether the model, the data or the settings changed.

- `file_fingerprint`: sha256 of every byte (data files: JSONL, text).
- `model_identity`: for a GGUF, which can be gigabytes. The *signature* hashes the layout
  (architecture, tensor names, types, shapes); the *fingerprint* hashes the file size, all
  metadata (vocabulary included) and the tensor table, plus four 4 KiB samples of every tensor's
  bytes (start, 1/3, 2/3, end; all of a tensor under 16 KiB). About 16 KiB per tensor is read:
  a few milliseconds on a 2 GB file. It catches a re-quantized, converted or fine-tuned file;
  it is not a guard against an edit made to dodge it.
- `settings_signature`: sha256 of a settings mapping in canonical JSON (sorted keys).

Values look like `sha256:<64 hex>`. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from retrograd.gguf import GGUFFile

SAMPLE_BYTES = 4096
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelIdentity:
    signature: str
    bytes: int
    fingerprint: str


def file_fingerprint(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def model_identity(path: str | Path) -> ModelIdentity:
    g = GGUFFile(path)
    layout = hashlib.sha256()
    content = hashlib.sha256(b"retrograd model fingerprint v1")
    size = g.path.stat().st_size
    content.update(size.to_bytes(8, "little"))
    content.update(msgpack.packb(_plain(g.metadata), use_bin_type=True))
    layout.update(g.architecture.encode())
    for info in g.tensors.values():
        row = msgpack.packb([info.name, int(info.ggml_type), list(info.shape)])
        layout.update(row)
        content.update(row)
        for sample in _samples(info.data):
            content.update(sample)
    return ModelIdentity("sha256:" + layout.hexdigest(), size, "sha256:" + content.hexdigest())


def model_fingerprint(path: str | Path) -> str:
    return model_identity(path).fingerprint


def settings_signature(settings: Mapping[str, Any]) -> str:
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _samples(data: np.ndarray) -> list[bytes]:
    """Slices of a memory-mapped tensor; only their pages are read from disk."""
    n = data.shape[0]
    if n <= 4 * SAMPLE_BYTES:
        return [data.tobytes()]
    starts = [0, n // 3, 2 * n // 3, n - SAMPLE_BYTES]
    return [data[s : s + SAMPLE_BYTES].tobytes() for s in starts]


def _plain(value: Any) -> Any:
    """Metadata as msgpack can pack it: arrays as (dtype, bytes)."""
    if isinstance(value, np.ndarray):
        return [str(value.dtype), value.tobytes()]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
