"""Pieces shared by the dequantization kernels: reading fields out of ggml blocks, and small
constant tables kept once per device.

A kernel sees `blocks`, a (n_blocks, type_size) uint8 tensor (rows of raw ggml blocks), and
returns (n_blocks, block_size) float32. Everything here is plain torch, so it runs wherever the
bytes are. Nothing here knows about the ggml types themselves.

NOTE: the kernels must reproduce gguf-py's float32 arithmetic exactly, operation by operation:
keep `d * q - m` as a multiply then a subtract (never `addcmul`, which may fuse into an FMA),
and do integer work in integer dtypes, where it is exact in any order.
"""

from __future__ import annotations

from collections.abc import Callable

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
    """Shift amounts as a broadcastable uint8 (or `dtype`) tensor, cached per device."""
    dtype = dtype or torch.uint8
    key = f"shifts{values}{shape}{dtype}"
    return constant(key, device, lambda: torch.tensor(values, dtype=dtype).reshape(shape))


def f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of each block, as (n_blocks, 1) float32."""
    # clone: a (n, 2) byte copy whose storage starts at 0, so the dtype view is always legal
    # whatever the block size and the offset of `blocks` in its storage.
    raw = blocks[:, offset : offset + 2].clone()
    return raw.view(torch.float16).float()


def u16(blocks: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """`count` little-endian uint16 fields from byte `offset`, as (n_blocks, count) int32."""
    raw = blocks[:, offset : offset + 2 * count].reshape(-1, count, 2)
    return raw[..., 0].int() | (raw[..., 1].int() << 8)


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
