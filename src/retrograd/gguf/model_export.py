"""The outputs of runs that train base tensors: a whole model, or the trained tensors alone.

`write_model` copies the base GGUF (every metadata key with its type, the tokenizer included,
in order) and its tensors in their order: untrained ones byte for byte, trained ones from
the arrays given, in their storage type. `write_trainable` writes just the trained tensors
(and a hybrid run's adapter factors) under their names. Both land atomically (writer.py) and
check first that the destination's file system has room. No torch: callers hand numpy arrays;
a BF16 tensor is a `RawTensor` of its 16-bit patterns.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from retrograd.errors import GGUFError
from retrograd.gguf.reader import GGUFFile
from retrograd.gguf.writer import RawTensor, Tensor, Typed, write_gguf

ROOM_MARGIN = 16 << 20  # bytes kept free beyond the file itself
TRAINABLE_TYPE = "retrograd.trainable"


def check_room(path: Path, n_bytes: int, key: str = "[output].path") -> None:
    """Refuse before writing when the file system of `path` cannot hold `n_bytes` more."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < n_bytes + ROOM_MARGIN:
        raise GGUFError(
            f"{key} = {path}: the file needs {n_bytes / 2**20:.1f} MiB and {folder} has "
            f"{free / 2**20:.1f} MiB free; free some space or choose another folder"
        )


def _metadata(src: Path) -> tuple[dict[str, Typed], int | None]:
    """Every metadata key of `src` with its GGUF type (not the architecture, written apart,
    nor the reader's own GGUF.* keys), and the file's alignment when it sets one."""
    reader = GGUFReader(src)
    out, alignment = {}, None
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.alignment":
            alignment = int(value)
        out[field.name] = Typed(value, main, sub)
    return out, alignment


def write_model(
    src: str | Path,
    dst: str | Path,
    trained: Mapping[str, Tensor],
    *,
    name: str | None = None,
) -> Path:
    """A complete GGUF: `src` with the tensors of `trained` replaced (same shapes and types)."""
    src, dst = Path(src), Path(dst)
    base = GGUFFile(src)
    for tname, t in trained.items():
        info = base.tensors.get(tname)
        if info is None:
            raise GGUFError(f"{src.name}: no tensor {tname} to replace")
        shape = t.shape if isinstance(t, RawTensor) else t.shape
        if tuple(shape) != tuple(info.shape):
            raise GGUFError(f"{tname}: trained shape {tuple(shape)}, file {tuple(info.shape)}")
    check_room(dst, src.stat().st_size)
    metadata, alignment = _metadata(src)
    if name is not None:
        metadata["general.name"] = Typed(name, GGUFValueType.STRING)
    tensors: dict[str, Tensor] = {}
    for tname, info in base.tensors.items():
        tensors[tname] = trained.get(tname, RawTensor(info.data, info.shape, info.ggml_type))
    return write_gguf(
        dst,
        architecture=base.architecture,
        metadata=metadata,
        tensors=tensors,
        alignment=alignment,
    )


def write_trainable(
    dst: str | Path,
    *,
    architecture: str,
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, object],
) -> Path:
    """The trained tensors alone, by name, in their storage types (general.type says what the
    file is: it needs its base model to be of use)."""
    dst = Path(dst)
    n_bytes = sum(_nbytes(t) for t in tensors.values())
    check_room(dst, n_bytes + (1 << 20))
    meta = {"general.type": TRAINABLE_TYPE, **metadata}
    return write_gguf(dst, architecture=architecture, metadata=meta, tensors=tensors)


def _nbytes(t: Tensor) -> int:
    return int(t.data.nbytes) if isinstance(t, RawTensor) else int(t.nbytes)


def bf16_tensor(bits: np.ndarray) -> RawTensor:
    """A BF16 tensor from its 16-bit patterns (uint16 or int16, any shape)."""
    return RawTensor(bits.view(np.uint16), tuple(bits.shape), GGMLQuantizationType.BF16)
