"""Write GGUF files atomically, over gguf-py's GGUFWriter.

Every file lands in one piece or not at all: it is written under a hidden temporary name in the
destination's directory (`.<name>.tmp-<pid>-<n>`), flushed to disk, then renamed over the
destination, and the directory entry is flushed too. An exception removes the temporary file; a
kill leaves at most a hidden `.tmp-` file beside an untouched destination. This module knows
nothing about torch or about what the tensors mean: callers hand it numpy arrays.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

_COUNTER = itertools.count()


def temporary_name(path: Path) -> Path:
    """A hidden sibling name no other writer (process or call) uses at the same time."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{next(_COUNTER)}")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_copy(src: str | Path, dst: str | Path) -> Path:
    """Copy a file so that `dst` is either its old self or a complete copy."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (ints, arrays, or anything not inferred)."""

    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class RawTensor:
    """Tensor bytes stored as they are (a quantized or bf16 tensor copied from another file).

    `shape` is row-major in elements, as `retrograd.gguf.TensorInfo.shape`.
    """

    data: np.ndarray
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType


Tensor = np.ndarray | RawTensor


def _typed(key: str, value: Any) -> Typed:
    # NOTE: bool before int: bool is an int subclass.
    if isinstance(value, Typed):
        return value
    if isinstance(value, str):
        return Typed(value, GGUFValueType.STRING)
    if isinstance(value, bool):
        return Typed(value, GGUFValueType.BOOL)
    if isinstance(value, float):
        return Typed(value, GGUFValueType.FLOAT32)
    if isinstance(value, int):
        if not 0 <= value < 2**32:
            raise ValueError(f"{key} = {value}: give an explicit Typed(..., UINT64/INT64)")
        return Typed(value, GGUFValueType.UINT32)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return Typed(list(value), GGUFValueType.ARRAY, GGUFValueType.STRING)
    raise TypeError(f"{key}: cannot infer a GGUF type for {type(value).__name__}; use Typed")


def _add_tensor(w: GGUFWriter, name: str, t: Tensor) -> None:
    if isinstance(t, np.ndarray):
        w.add_tensor(name, np.ascontiguousarray(t))
        return
    per_block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
    row_bytes = t.shape[-1] // per_block * block_bytes
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(*t.shape[:-1], row_bytes)
    w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t.ggml_type)


def write_gguf(
    path: str | Path,
    *,
    architecture: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    alignment: int | None = None,
) -> Path:
    """Write a GGUF file atomically; returns its path.

    `metadata` values are str, bool, float (FLOAT32), int (UINT32), a list of str, or `Typed`.
    `general.architecture` is written from `architecture`. Tensors are written in the given
    order; numpy arrays keep their dtype (f32, f16, ...), in row-major shape. `alignment`:
    the tensor data alignment, when not gguf's default of 32 (general.alignment).
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        w = GGUFWriter(str(tmp), architecture)
        if alignment is not None:
            w.data_alignment = alignment
        try:
            for key, value in metadata.items():
                v = _typed(key, value)
                w.add_key_value(key, v.value, v.type, sub_type=v.sub_type)
            for name, t in tensors.items():
                _add_tensor(w, name, t)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path
