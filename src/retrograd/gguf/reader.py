"""Read a GGUF file: metadata, tensor infos and memory-mapped tensor bytes.

The header is parsed here with gguf-py's type tables (gguf-py's `GGUFReader` is the tests'
oracle). It knows nothing about torch or about what the tensors mean; it gives plain Python
values, tensor shapes in row-major (numpy/torch) order, and turns every way a file can be
unreadable into a `GGUFError` that names the file: a header is read no further than the file
holds, whatever counts and sizes it claims (nothing is allocated for them), arrays nested past
nesting.MAX_DEPTH and a `general.alignment` that is not a positive integer are malformed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from retrograd.errors import GGUFError, UnsupportedError
from retrograd.nesting import MAX_DEPTH

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    `shape` is row-major, as torch and numpy see it: a ggml matrix with ne = (n_in, n_out)
    is (n_out, n_in) here. `data` is the raw bytes, memory-mapped, as a flat uint8 array.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_TYPES


FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)


_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


class _Cursor:
    """Little-endian reads from the mapped header; running past the end means truncation."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise EOFError("header runs past the end of the file")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError("string runs past the end of the file")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 1):
        """The value of type `vtype` here; `depth`: arrays it lies in, counted to refuse a
        header nested past MAX_DEPTH (each level costs 12 bytes: a recursion a small file
        could exhaust)."""
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth > MAX_DEPTH:
                raise ValueError(f"arrays nested more than {MAX_DEPTH} deep")
            etype = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if etype == GGUFValueType.STRING:
                return self._strings(count)
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
            dtype = np.dtype(_NUMPY[etype])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise EOFError("array runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return arr
        return self.scalar(_SCALARS[vtype])

    def _strings(self, count: int) -> list[str]:
        # NOTE: the hot loop of opening a 262k-token vocabulary; keep it free of method calls.
        buf, pos, out = self.buf, self.pos, []
        unpack, size = struct.unpack_from, len(buf)
        for _ in range(count):
            if pos + 8 > size:
                raise EOFError("string array runs past the end of the file")
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > size:
                raise EOFError("string array runs past the end of the file")
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, ggml ne, type, offset
    data_start: int


def _parse_header(buf: memoryview) -> _Header:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:  # llama.cpp and gguf-py refuse it too: which one would count?
            raise ValueError(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors, names = [], set()
    for _ in range(n_tensors):
        name = cur.string()
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.scalar("<I")
        if n_dims > MAX_DIMS:
            raise ValueError(
                f"tensor {name!r} has {n_dims} dimensions (ggml has at most {MAX_DIMS})"
            )
        ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
        tensors.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment = {align!r}: must be a power of two")
    data_start = (cur.pos + align - 1) // align * align
    return _Header(version, metadata, tensors, data_start)


class GGUFFile:
    """An opened GGUF file. Construction parses the header and maps the file; it reads no weights.

    NOTE: gguf-py's GGUFReader builds numpy views for every string of the vocabulary (16 s for
    Gemma's 262k tokens); we parse the header ourselves with gguf-py's type tables (0.2 s) and
    keep GGUFReader as the test oracle of this parser.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map, header = _open(self.path)
        self.version = header.version
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = self._tensor_infos(header)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path.name!r}, arch={self.get('general.architecture')!r})"

    # -- metadata -------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def file_kind(self) -> str:
        """`model`, `adapter` or `vocab` (a vocab-only file has no tensors)."""
        kind = self.get("general.type")
        if kind:
            return str(kind)
        return "model" if self.tensors else "vocab"

    def arch_get(self, key: str, default: Any = None) -> Any:
        """A `{arch}.key` value, for example `arch_get("block_count")`."""
        return self.get(f"{self.architecture}.{key}", default)

    # -- tensors --------------------------------------------------------------------------

    def _tensor_infos(self, header: _Header) -> dict[str, TensorInfo]:
        out = {}
        size = len(self._map)
        for name, ne, type_id, offset in header.tensors:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedError(
                    f"{self.path.name}: tensor {name!r} has unknown ggml type {type_id}"
                ) from None
            shape = tuple(int(d) for d in reversed(ne))
            n_elem = 1
            for d in ne:
                n_elem *= int(d)
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
            if ne and int(ne[0]) % per_block:
                raise GGUFError(
                    f"{self.path.name}: tensor {name!r}: row of {ne[0]} is not a multiple of "
                    f"the {qtype.name} block ({per_block})"
                )
            n_bytes = n_elem // per_block * block_bytes
            start = header.data_start + offset
            if start + n_bytes > size:
                raise GGUFError(
                    f"{self.path.name}: truncated: tensor {name!r} runs past the end of the file"
                )
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start)
            out[name] = TensorInfo(name, qtype, shape, n_bytes, data)
        return out

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name}: no tensor named {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())


def _open(path: Path) -> tuple[mmap.mmap, _Header]:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, expected a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = _parse_header(memoryview(mapped))
    except EOFError as e:
        raise GGUFError(f"{path}: truncated GGUF: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: malformed GGUF header: {e}") from None
    return mapped, header


def block_size(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[ggml_type]
