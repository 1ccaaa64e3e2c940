"""Dequantize GGUF tensor bytes into torch tensors, one kernel per ggml type.

Frozen weights stay in memory as the file's raw bytes and come through here on every use, in
the forward and again in the backward pass, so the kernels are vectorized torch ops (no loop
over blocks) that run on whatever device holds the bytes. Their float32 output equals gguf-py's
`gguf.quants.dequantize` bit for bit; other dtypes are a cast of that result.

This module knows ggml's byte layouts and nothing about models: it takes bytes, a type and a
row-major shape. The kernels live in dequant_legacy (32- and 64-element blocks),
dequant_kquants (256-element integer codes) and dequant_iquants (lattice codes).

NOTE: `torch.compile` of a kernel is not exact by default: compiled Q4_K fused its multiply and
subtract into an FMA (CPU, torch 2.13). Compile one only behind the equality tests.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from retrograd.errors import GGUFError, UnsupportedError
from retrograd.model import dequant_iquants, dequant_kquants, dequant_legacy

T = GGMLQuantizationType

_FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
_KERNELS = {**dequant_legacy.KERNELS, **dequant_kquants.KERNELS, **dequant_iquants.KERNELS}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_FLOATS) | frozenset(_KERNELS)

# Why each type we refuse is refused; a type not named here has no gguf-py dequantizer to be
# tested against (for example one newer than our gguf-py).
_REFUSED = {
    T.Q8_1: "an intermediate type of ggml's dot products, never stored in model files",
    T.Q8_K: "an intermediate type of ggml's dot products, never stored in model files",
    T.I8: "an integer tensor, not a weight",
    T.I16: "an integer tensor, not a weight",
    T.I32: "an integer tensor, not a weight",
    T.I64: "an integer tensor, not a weight",
    T.F64: "no gguf-py dequantizer to test against, and no model stores weights in it",
}


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def _qtype(qtype: GGMLQuantizationType | int, where: str) -> GGMLQuantizationType:
    try:
        return T(qtype)
    except ValueError:
        raise UnsupportedError(f"{_where(where)}unknown ggml type {qtype!r}") from None


def check_supported(qtype: GGMLQuantizationType | int, where: str = "") -> None:
    """Raise UnsupportedError naming the type (and `where`, e.g. a tensor) unless supported."""
    qtype = _qtype(qtype, where)
    if qtype not in SUPPORTED:
        reason = _REFUSED.get(qtype, "no gguf-py dequantizer to test a kernel against")
        raise UnsupportedError(
            f"{_where(where)}ggml type {qtype.name} is not supported ({reason}); "
            "see docs/quantization.md for the supported types"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes_per_row(qtype: GGMLQuantizationType, shape: tuple[int, ...], where: str) -> int:
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % per_block:
        raise GGUFError(
            f"{_where(where)}row of {row} is not a multiple of the {qtype.name} block ({per_block})"
        )
    return row // per_block * block_bytes


def _as_float(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return flat.view(dtype)
    except RuntimeError:  # the bytes start at an offset not aligned for `dtype`
        return flat.clone().view(dtype)


def dequantize(
    data: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    name: str = "",
) -> torch.Tensor:
    """Raw ggml bytes (uint8, any shape, on any device) -> a `shape` tensor of `dtype`.

    `shape` is row-major (torch order): its last dim is the ggml row. `name` (a tensor name)
    only goes into error messages.

    NOTE: for F32/F16/BF16 bytes asked for in their own dtype the result is a view of `data`,
    not a copy (the frozen-weight path never writes to it).
    """
    qtype = _qtype(qtype, name)
    check_supported(qtype, name)
    shape = tuple(int(d) for d in shape)
    n_rows = _numel(shape[:-1]) if shape else 1
    expected = n_rows * _bytes_per_row(qtype, shape, name)
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise GGUFError(
            f"{_where(name)}{data.numel()} {data.dtype} values do not hold a {qtype.name} "
            f"tensor of shape {shape} ({expected} bytes)"
        )
    flat = data.reshape(-1)
    if qtype in _FLOATS:
        values = _as_float(flat, _FLOATS[qtype]).view(shape)
        if dtype not in (values.dtype, torch.float32):
            values = values.float()  # NOTE: torch's direct f16 <-> bf16 casts are ~5x slower
        return values.to(dtype)
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    blocks = flat.view(-1, GGML_QUANT_SIZES[qtype][1])  # (n_blocks, type_size)
    out = _KERNELS[qtype](blocks)  # (n_blocks, block_size) float32
    return out.view(shape).to(dtype)


def dequantize_rows(
    data: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, ...],
    rows: slice | torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    name: str = "",
) -> torch.Tensor:
    """Dequantize only the selected rows of a tensor (an embedding lookup, a slice).

    Rows are the leading dims of `shape` flattened; each is whole ggml blocks, so this gathers
    byte rows and dequantizes those. `rows` as a slice gives (len, row); as an integer tensor
    of ids (non-negative, on data's device) gives rows.shape + (row,).
    """
    qtype = _qtype(qtype, name)
    check_supported(qtype, name)
    shape = tuple(int(d) for d in shape)
    row_bytes = _bytes_per_row(qtype, shape, name)
    n_rows = _numel(shape[:-1])
    if data.numel() != n_rows * row_bytes:
        # the full-tensor check names the problem
        return dequantize(data, qtype, shape, dtype, name=name)
    byte_rows = data.reshape(n_rows, row_bytes)
    if isinstance(rows, slice):
        start, stop, step = rows.indices(n_rows)
        if step > 0:
            picked = byte_rows[start:stop:step]
            return dequantize(picked, qtype, (picked.shape[0], shape[-1]), dtype, name=name)
        rows = torch.arange(start, stop, step, device=data.device)
    picked = byte_rows.index_select(0, rows.reshape(-1))
    out = dequantize(picked, qtype, (picked.shape[0], shape[-1]), dtype, name=name)
    return out.view(*rows.shape, shape[-1])
