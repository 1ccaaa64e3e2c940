"""The .topk sidecar of offline distillation: a teacher's k most likely next tokens, with
their log-probabilities, at every trained position of a chat corpus (docs/distill.md says the
layout; `retrograd distill-teacher` writes it, a topk_offline run reads it).

Layout, little-endian:
  8 bytes   magic b"RGTOPK\\0\\1"
  8 bytes   u64: the header's length in bytes
  header    UTF-8 JSON: format version, k, ctx, the corpus's and the tokenizer's fingerprints,
            the teacher's, the example count, the position count, and each array's offset
            (from the file's start, 64-byte aligned), dtype and shape
  arrays    counts int32 (examples,)    trained positions of each example, in corpus order
            targets int32 (positions,)  the token each position predicts (a check)
            ids int32 (positions, k)    the teacher's top-k token ids, most likely first
            logprobs float32 (positions, k)  their log-probabilities (log-softmax, temperature 1)
Positions are those the corpus trains when tokenized as SFT does at that ctx: assistant tokens
of each kept example (examples without one are dropped, longer ones cut at ctx), in order.
The file is written under a temporary name and renamed: a kill never leaves a partial sidecar.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from retrograd import nesting
from retrograd.errors import DataError

MAGIC = b"RGTOPK\x00\x01"
VERSION = 1
ALIGN = 64
ARRAYS = (("counts", "<i4"), ("targets", "<i4"), ("ids", "<i4"), ("logprobs", "<f4"))


def tokenizer_fingerprint(metadata: dict) -> str:
    """sha256 of every `tokenizer.ggml.*` metadata value (vocabulary, merges, types, special
    ids and flags): two GGUFs with the same value read and write the same token ids."""
    keys = sorted(k for k in metadata if k.startswith("tokenizer.ggml."))
    h = hashlib.sha256(b"retrograd tokenizer fingerprint v1")
    for key in keys:
        h.update(msgpack.packb([key, _plain(metadata[key])], use_bin_type=True))
    return "sha256:" + h.hexdigest()


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclass
class TopK:
    """A sidecar in memory: header fields and the four arrays."""

    k: int
    ctx: int
    corpus: dict  # {"file": name, "sha256": hex of its bytes}
    tokenizer: str  # tokenizer_fingerprint
    teacher: dict  # {"file": name, "fingerprint": model fingerprint}
    counts: np.ndarray  # (examples,) int32
    targets: np.ndarray  # (positions,) int32
    ids: np.ndarray  # (positions, k) int32
    logprobs: np.ndarray  # (positions, k) float32

    @property
    def offsets(self) -> np.ndarray:
        """(examples + 1,) start of each example's rows."""
        return np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])

    def rows(self, example: int) -> slice:
        o = self.offsets
        return slice(int(o[example]), int(o[example + 1]))

    def header(self) -> dict:
        return {
            "format": "retrograd-topk",
            "version": VERSION,
            "k": self.k,
            "ctx": self.ctx,
            "corpus": self.corpus,
            "tokenizer": self.tokenizer,
            "teacher": self.teacher,
            "examples": int(len(self.counts)),
            "positions": int(len(self.targets)),
        }


def write_topk(path: str | Path, topk: TopK) -> Path:
    """Write atomically (a temporary name in the same folder, then a rename)."""
    from retrograd.gguf.writer import atomic_path

    path = Path(path)
    arrays = [np.ascontiguousarray(getattr(topk, name), dtype=dt) for name, dt in ARRAYS]
    header = topk.header()
    # offsets depend on the header's length, which depends on the offsets' digits: fix the
    # header's length first with placeholder offsets of the widest size, then fill them in
    layout, size = {}, 0
    for (name, dt), a in zip(ARRAYS, arrays, strict=True):
        layout[name] = {"offset": 10**15, "dtype": dt, "shape": list(a.shape)}
    header["arrays"] = layout
    head_len = len(_encode(header)) + 32  # room for the real offsets (never longer)
    start = _aligned(len(MAGIC) + 8 + head_len)
    for (name, _), a in zip(ARRAYS, arrays, strict=True):
        layout[name]["offset"] = start + size
        size = _aligned(size + a.nbytes)
    body = _encode(header)
    assert len(body) <= head_len, (len(body), head_len)
    body = body + b" " * (head_len - len(body))
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", head_len) + body)
        for (name, _), a in zip(ARRAYS, arrays, strict=True):
            f.write(b"\0" * (layout[name]["offset"] - f.tell()))
            f.write(a.tobytes())
    return path


def read_topk(path: str | Path, where: str = "sidecar") -> TopK:
    """Read a sidecar; DataError naming `where` and the file when it is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{where} = {path}: cannot read it ({e.strerror})") from None
    bad = f"{where} = {path}: not a .topk sidecar"
    if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 8:
        raise DataError(f"{bad} (write one with `retrograd distill-teacher`)")
    (head_len,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    try:
        header = nesting.loads(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + head_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{bad} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise DataError(f"{bad} (its header is not a JSON object)")
    if header.get("format") != "retrograd-topk" or header.get("version") != VERSION:
        raise DataError(f"{bad} of version {VERSION} (rewrite it with `retrograd distill-teacher`)")
    try:
        arrays = _arrays(raw, header)
        topk = TopK(
            header["k"],
            header["ctx"],
            header["corpus"],
            header["tokenizer"],
            header["teacher"],
            **arrays,
        )
        kinds = {"ctx": int, "corpus": dict, "tokenizer": str, "teacher": dict}
        for key, kind in kinds.items():
            if not isinstance(header[key], kind) or isinstance(header[key], bool):
                raise TypeError(f"{key} = {header[key]!r:.40}: must be a {kind.__name__}")
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{bad} (its header is malformed: {type(e).__name__}: {e})") from None
    except _CutShort as e:
        raise DataError(f"{bad} (array {e} is cut short: the file is truncated)") from None
    if int(topk.counts.sum()) != len(topk.targets):
        raise DataError(f"{bad} (its counts do not add up to its positions)")
    return topk


class _CutShort(Exception):
    """An array that runs past the end of the file; args[0] names it."""


def _arrays(raw: bytes, header: dict) -> dict[str, np.ndarray]:
    """The four arrays as views of `raw`, after their layout is checked: a sidecar may be
    anyone's (a shape of -1 or one that wraps 64 bits, an offset into the header, arrays of
    shapes that do not agree). ValueError, TypeError or KeyError for a malformed layout."""
    k = header["k"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k = {k!r}: must be a whole number >= 1")
    ndims = {"counts": 1, "targets": 1, "ids": 2, "logprobs": 2}
    arrays = {}
    for name, dt in ARRAYS:
        spec = header["arrays"][name]
        shape, offset = spec["shape"], spec["offset"]
        if spec["dtype"] != dt:
            raise ValueError(f"array {name}: dtype {spec['dtype']!r}, expected {dt}")
        ints = [offset, *shape] if isinstance(shape, list) else [None]
        if len(shape) != ndims[name] or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in ints
        ):
            raise ValueError(f"array {name}: shape {shape!r:.60} and offset {offset!r:.30}")
        n = math.prod(shape) * np.dtype(dt).itemsize  # Python ints: no 64-bit wrap
        if offset < len(MAGIC) + 8 or offset + n > len(raw):
            raise _CutShort(name)
        arrays[name] = np.frombuffer(raw, dtype=dt, count=math.prod(shape), offset=offset)
        arrays[name] = arrays[name].reshape(shape)
    positions = len(arrays["targets"])
    for name in ("ids", "logprobs"):
        if arrays[name].shape != (positions, k):
            raise ValueError(
                f"array {name}: shape {arrays[name].shape}, expected ({positions}, {k})"
            )
    if (arrays["counts"] < 0).any():
        raise ValueError("array counts: a negative count")
    return arrays


def _encode(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
