"""Pieces shared by the dequantization kernels: reading fields out of ggml blocks, unpacking
packed codes eight bytes at a time, and small constant tables kept once per device.

A kernel sees `blocks`, a (n_blocks, type_size) uint8 tensor (rows of raw ggml blocks), and
returns (n_blocks, block_size) float32. Everything here is plain torch, so it runs wherever the
bytes are. Nothing here knows about the ggml types themselves.

Speed: an elementwise op costs a few ns per innermost run, so an op whose innermost run is one
block's 16 or 32 bytes is several times slower than one over a contiguous tensor. Codes are
therefore unpacked on int64 words of contiguous bytes (all bytes of a word at once, SWAR), and
the unpacked pieces are interleaved into ggml's order by one copy. Words are little-endian
(byte 0 is the low byte), as on every device torch runs on.

NOTE: the kernels must reproduce gguf-py's float32 arithmetic exactly, operation by operation:
keep `d * q - m` as a multiply then a subtract (never `addcmul`, which may fuse into an FMA),
and do integer work in integer dtypes, where it is exact in any order. Convert codes to float
once (`q.float()`) and scale in place: a mixed int-by-float multiply makes a hidden float copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

_CONSTANTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def constant(key: str, device: torch.device, build: Callable[[], np.ndarray | torch.Tensor]):
    """The tensor `build()` on `device`, built and copied there once, then reused."""
    found = _CONSTANTS.get((key, device))
    if found is None:
        value = build()
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        found = value.to(device)
        _CONSTANTS[(key, device)] = found
    return found


def shifts(values: tuple[int, ...], shape: tuple[int, ...], device: torch.device, dtype=None):
    """Shift amounts (or other small constants) as a broadcastable tensor, cached per device."""
    dtype = dtype or torch.uint8
    key = f"shifts{values}{shape}{dtype}"
    return constant(key, device, lambda: torch.tensor(values, dtype=dtype).reshape(shape))


# -- fields ----------------------------------------------------------------------------------


def f16(blocks: torch.Tensor, offset: int, count: int = 1) -> torch.Tensor:
    """`count` (1 or 2) consecutive f16 fields from byte `offset` of each block, as
    (n, count) float32."""
    try:  # a strided 1-D view of the blocks: f16 (count 1) or a uint32 holding two f16
        if count == 1:
            return blocks.view(torch.float16)[:, offset // 2 : offset // 2 + 1].float()
        if count == 2 and offset % 4 == 0:
            pairs = blocks.view(torch.int32)[:, offset // 4].contiguous()
            return pairs.view(torch.float16).float().view(-1, 2)
    except RuntimeError:
        pass
    # a fresh copy starts at offset 0 of its storage, so the view is always legal
    return blocks[:, offset : offset + 2 * count].clone().view(torch.float16).float()


def words(blocks: torch.Tensor, start: int, stop: int, dtype=torch.int64) -> torch.Tensor:
    """Bytes [start, stop) of each block as contiguous (n_blocks, k) words of `dtype`."""
    raw = blocks[:, start:stop]
    if raw.is_contiguous():
        try:  # one block, or fields spanning whole blocks: no copy needed
            return raw.view(dtype)
        except RuntimeError:  # not aligned for `dtype` in its storage
            pass
    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def columns(blocks: torch.Tensor, start: int, stop: int, dtype=torch.int32) -> torch.Tensor:
    """Bytes [start, stop) of each block as (k, n_blocks) words of `dtype`: word i of every
    block in row i, so per-block header fields are processed as long contiguous rows."""
    size = dtype.itemsize
    try:
        if start % size == 0 and stop % size == 0:
            return blocks.view(dtype)[:, start // size : stop // size].t().contiguous()
    except RuntimeError:  # blocks not a whole number of words, or not aligned for `dtype`
        pass
    return words(blocks, start, stop, dtype).t().contiguous()


def u16(blocks: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """`count` little-endian uint16 fields from byte `offset`, as (n_blocks, count) int32."""
    raw = blocks[:, offset : offset + 2 * count].reshape(-1, count, 2)
    return raw[..., 0].int() | (raw[..., 1].int() << 8)


# -- SWAR unpacking on int32/int64 words -----------------------------------------------------


def _per_byte(value: int, dtype: torch.dtype) -> int:
    """`value` (< 0x80) repeated in every byte of a word."""
    size = dtype.itemsize
    return value * int.from_bytes(b"\x01" * size, "little")


def stack_words(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack same-shaped (..., k) words on a new axis: (..., len(parts), k).

    NOTE: when a row of words is a whole number of 16 bytes the copy moves complex128
    elements: twice the bytes per step of torch's copy loop (3x faster on a CPU). Copies never
    touch the bits. MPS has no complex128, so it takes the plain stack.
    """
    w = parts[0]
    if (w.shape[-1] * w.element_size()) % 16 == 0 and w.device.type != "mps":
        stacked = torch.stack([p.view(torch.complex128) for p in parts], dim=-2)
        return stacked.view(w.dtype)
    return torch.stack(parts, dim=-2)


def split_nibbles(w: torch.Tensor) -> torch.Tensor:
    """(..., k) words -> (..., 2, k): low nibbles of every byte, then high nibbles."""
    m = _per_byte(0x0F, w.dtype)
    return stack_words((w & m, (w >> 4) & m))


def planes(w: torch.Tensor, step: int, mask: int, lshift: int = 0) -> torch.Tensor:
    """(..., k) words -> (..., 8 // step, k): plane i holds bits [i*step, i*step + step) of
    every byte, masked with `mask` and moved up by `lshift` bits (ready to OR as high bits)."""
    m = _per_byte(mask << lshift, w.dtype)
    parts = []
    for i in range(8 // step):
        s = i * step - lshift
        # arithmetic right shifts smear the sign into bits the mask drops (shift + width <= 8)
        parts.append(((w >> s) if s >= 0 else (w << -s)) & m)
    return stack_words(parts)


def bytes_of(w: torch.Tensor, n: int, *shape: int, dtype=torch.uint8) -> torch.Tensor:
    """Reinterpret words as (n, *shape) bytes of `dtype` (uint8 or int8)."""
    return w.reshape(n, -1).view(dtype).view(n, *shape)


def nibble_values(w: torch.Tensor, values: tuple[int, ...], key: str) -> torch.Tensor:
    """(..., k) int64 words of 4-bit indices into the 16 `values` -> (..., 2, 8k) float32:
    the values of the low nibbles of the 8k bytes, then of the high nibbles (ggml's order).

    Two neighbouring bytes give two 8-bit indices (their low nibbles together, their high
    nibbles together) into a 256-entry table of value pairs: one lookup per two values, and
    the pairs land in output order.
    """
    m = 0x000F000F000F000F  # the low nibble of each 16-bit lane
    lo = (w & m) | ((w >> 4) & (m << 4))  # lane: low nibbles of its two bytes
    hi = ((w >> 4) & m) | ((w >> 8) & (m << 4))  # lane: their high nibbles
    idx = stack_words((lo, hi)).view(torch.int16).int()  # (..., 2, 4k) in 0..255

    def pairs():
        v = np.asarray(values, dtype=np.float32)
        i = np.arange(256)
        return np.stack((v[i & 15], v[i >> 4]), axis=-1).view(np.int64).reshape(256)

    out = constant(f"pairs_{key}", w.device, pairs).index_select(0, idx.reshape(-1))
    return out.view(torch.float32).view(*w.shape[:-1], 2, 8 * w.shape[-1])


# -- small-field helpers (per-block scales, grid indices) --------------------------------------


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2, k): low nibbles first, then high nibbles (ggml's order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def bit_planes(qs: torch.Tensor, step: int, mask: int, dim: int = -2) -> torch.Tensor:
    """Fields of `step` bits from each byte: (..., k) -> (..., 8 // step, k) for dim=-2,
    or (..., k, 8 // step) for dim=-1; field i holds bits [i * step, i * step + step)."""
    count = 8 // step
    shape = (count, 1) if dim == -2 else (count,)
    s = shifts(tuple(range(0, 8, step)), shape, qs.device)
    return (qs.unsqueeze(dim) >> s) & mask


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for an integer `index` of any shape: index.shape + table.shape[1:]."""
    flat = table.index_select(0, index.reshape(-1).int())
    return flat.reshape(*index.shape, *table.shape[1:])
