"""Frozen weights: the GGUF bytes as stored, dequantized on use.

A `FrozenTensor` holds a tensor's raw bytes (quantized, f16, bf16 or f32) on the model's
device and produces a dense copy when a matmul needs one. `frozen_linear` is the custom
autograd function that makes training affordable: backward dequantizes again instead of
keeping a dense copy of every frozen weight alive between forward and backward.

A `DenseCache`, when enabled, keeps the dense copies instead (memory for speed); in its 8-bit
mode (`int8`) it keeps each 2-D weight as int8 rows with a scale per row instead (model/int8.py:
1 byte a weight, products that never build a dense copy). The loader decides and reports.
Nothing here knows about architectures or LoRA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from retrograd import compute
from retrograd.gguf import TensorInfo
from retrograd.model.dequant import check_supported, dequantize, dequantize_rows
from retrograd.model.int8 import dequantized, int8_linear, quantize_rows

log = logging.getLogger(__name__)
CHUNK_ELEMENTS = 1 << 22  # dequantize larger tensors to a narrower dtype in blocks of rows


class DenseCache:
    """Dense copies of frozen weights by (id, dtype); `enabled = False` turns it into a no-op.
    int8: 2-D weights are kept as (q, scale) instead (`int8_of`), dense copies never."""

    def __init__(self, enabled: bool, int8: bool = False):
        assert not (enabled and int8), "one store: dense copies or 8-bit rows"
        self.enabled, self.int8 = enabled, int8
        self._store: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._int8: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._int8_stacks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def int8_of(self, owner: FrozenTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 8-bit rows of a 2-D weight, quantized at first use and kept."""
        held = self._int8.get(id(owner))
        if held is None:
            held = self._int8[id(owner)] = owner.quantize_int8()
        return held

    def int8_stacked(self, owners: list[FrozenTensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The 8-bit rows of weights with one input, stacked (one product for q, k, v or gate,
        up); each weight's own rows become views of the stack, so nothing is held twice."""
        key = tuple(id(o) for o in owners)
        held = self._int8_stacks.get(key)
        if held is None:
            parts = [self.int8_of(o) for o in owners]
            held = (torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))
            self._int8_stacks[key] = held
            start = 0
            for o in owners:
                rows = slice(start, start + o.shape[0])
                self._int8[id(o)] = (held[0][rows], held[1][rows])
                start = rows.stop
        return held

    def get(self, owner: FrozenTensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.enabled:
            return owner.dequantize(dtype)
        key = (id(owner), dtype)
        dense = self._store.get(key)
        if dense is None:
            dense = owner.dequantize(dtype)
            self._store[key] = dense
        return dense

    def peek(self, owner: FrozenTensor, dtype: torch.dtype) -> torch.Tensor | None:
        return self._store.get((id(owner), dtype))

    def packed(self, owners: list[FrozenTensor], dtype: torch.dtype) -> torch.Tensor:
        """Weights with one input (q, k, v; gate, up; or a single one) stacked by rows, in
        oneDNN's blocked layout for `x @ W^T` (see `packable`): one matrix-vector product
        instead of several. Packed from cached dense copies where they exist, else from
        dequantized ones that are dropped."""
        key = (tuple(id(o) for o in owners), "packed", dtype)
        packed = self._store.get(key)
        if packed is None:
            rows = PACK_ROWS[dtype]
            packed = torch.ops.mkldnn._reorder_linear_weight(self._rows_now(owners, dtype), rows)
            self._store[key] = packed
        return packed

    def peek_packed(self, owner: FrozenTensor, dtype: torch.dtype) -> torch.Tensor | None:
        return self._store.get(((id(owner),), "packed", dtype))

    def stacked(self, owners: list[FrozenTensor], dtype: torch.dtype) -> torch.Tensor:
        """The dense copies of weights with one input, stacked by rows (cache on only)."""
        key = (tuple(id(o) for o in owners), dtype)
        dense = self._store.get(key)
        if dense is None:
            dense = self._store[key] = self._rows_now(owners, dtype)
        return dense

    def _rows_now(self, owners: list[FrozenTensor], dtype: torch.dtype) -> torch.Tensor:
        """The weights stacked by rows, from cached copies (stacked or single) where they
        exist, else freshly dequantized; caches nothing."""
        stacked = self._store.get((tuple(id(o) for o in owners), dtype))
        if stacked is not None:
            return stacked
        parts = [self.peek(o, dtype) for o in owners]
        parts = [
            o.dequantize(dtype) if p is None else p for o, p in zip(owners, parts, strict=True)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def clear(self) -> None:
        self._store.clear()
        self._int8.clear()
        self._int8_stacks.clear()

    @property
    def n_bytes(self) -> int:
        pairs = [*self._int8.values(), *self._int8_stacks.values()]
        held = [*self._store.values(), *(t for pair in pairs for t in pair)]
        own = dict(_storage(t) for t in held)
        return sum(own.values())  # a stack's views counted once


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(a key of the storage, its bytes): views of one storage share the key; a copy packed
    for oneDNN (an opaque tensor, no storage to read) is its own, of its elements' bytes."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return id(t), t.numel() * t.element_size()
    return storage.data_ptr(), storage.nbytes()


class FrozenTensor:
    """The stored bytes of one GGUF tensor, and how to make them dense."""

    def __init__(
        self, info: TensorInfo, raw: torch.Tensor, cache: DenseCache, mapped: bool = False
    ):
        check_supported(info.ggml_type, where=info.name)
        self.name = info.name
        self.ggml_type = info.ggml_type
        self.shape = info.shape
        self._raw: torch.Tensor | None = raw  # (n_bytes,) uint8
        self._home: tuple[nn.Module, str] | None = None
        self.cache = cache
        self._mapped = mapped  # raw is the file's read-only shared memory map itself

    @property
    def raw(self) -> torch.Tensor:
        """The stored bytes (n_bytes,) uint8: held here, or the Parameter of the module they
        were registered on (see `register_on`), read afresh at each use."""
        if self._home is None:
            return self._raw
        module, name = self._home
        return getattr(module, name)

    def register_on(self, module: nn.Module, name: str) -> None:
        """Hand the bytes to `module` as a frozen uint8 Parameter `name`; read them there from
        now on. NOTE: FSDP2 shards Parameters alone and swaps the attribute between the local
        shard and the gathered bytes (before forward, again before backward); nothing here may
        keep a reference to either, so reading through the module is the only way in."""
        module.register_parameter(name, nn.Parameter(self.raw, requires_grad=False))
        self._home, self._raw, self._mapped = (module, name), None, False

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def to(self, device: torch.device) -> FrozenTensor:
        self._mapped = False
        if self._home is not None:
            module, name = self._home
            setattr(module, name, nn.Parameter(self.raw.to(device), requires_grad=False))
        else:
            self._raw = self._raw.to(device)
        return self

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows = self.shape[0] if len(self.shape) == 2 else 0
        if dtype == torch.float32 or rows * self.shape[-1] <= CHUNK_ELEMENTS:
            return dequantize(self.raw, self.ggml_type, self.shape, dtype=dtype)
        # NOTE: dequantizing goes through float32; in row blocks, a 262k-row embedding never
        # exists as a whole float32 copy beside its bf16 one.
        out = torch.empty(self.shape, dtype=dtype, device=self.raw.device)
        step = max(1, CHUNK_ELEMENTS // self.shape[1])
        row_bytes = self.raw.numel() // rows
        for r in range(0, rows, step):
            n = min(step, rows - r)
            chunk = self.raw[r * row_bytes : (r + n) * row_bytes]
            out[r : r + n] = dequantize(chunk, self.ggml_type, (n, self.shape[1]), dtype=dtype)
        return out

    def quantize_int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale) of this 2-D weight (model/int8.py), from float32 rows dequantized a block
        at a time: no float32 copy of a whole large tensor exists."""
        rows, width = self.shape
        q = torch.empty(self.shape, dtype=torch.int8, device=self.device)
        scale = torch.empty(rows, dtype=torch.float32, device=self.device)
        step = max(1, CHUNK_ELEMENTS // width)
        for r in range(0, rows, step):
            block = slice(r, min(r + step, rows))
            w = dequantize_rows(self.raw, self.ggml_type, self.shape, block)
            q[block], scale[block] = quantize_rows(w)
        if self._mapped:  # read again only for rare uses (an embedding row, an export)
            release_pages(self._raw)
        return q, scale

    @property
    def in_int8(self) -> bool:
        """Whether products read this weight's 8-bit rows (the cache's int8 mode, 2-D)."""
        return self.cache.int8 and len(self.shape) == 2

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.in_int8:  # the weight the 8-bit store computes with, dense for this use only
            return dequantized(*self.cache.int8_of(self), dtype)
        return self.cache.get(self, dtype)

    def row_block(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) dense: from the cache when it is on (its 8-bit rows in int8
        mode), else dequantized alone."""
        if self.in_int8:
            q, scale = self.cache.int8_of(self)
            return dequantized(q[start:stop], scale[start:stop], dtype)
        if self.cache.enabled:
            return self.dense(dtype)[start:stop]
        return dequantize_rows(
            self.raw, self.ggml_type, self.shape, slice(start, stop), dtype=dtype
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Selected rows (an embedding lookup) without densifying the whole table.

        Uses a cached dense copy when one exists in `dtype`; never creates one, so a bf16
        head and float32 embedding rows do not cache the table twice.
        """
        cached = self.cache.peek(self, dtype)
        if cached is not None:
            return cached[ids]
        flat = ids.reshape(-1)
        out = dequantize_rows(self.raw, self.ggml_type, self.shape, flat, dtype=dtype)
        return out.reshape(*ids.shape, self.shape[-1])


def release_pages(mapped: torch.Tensor) -> None:
    """Drop the whole pages of `mapped` (a view of a file's read-only shared memory map) from
    this process's resident set: the file stays in the page cache, a later read maps it again.
    The 8-bit store calls it once a weight's rows are quantized, so that a model kept in 8 bits
    is not also held as the file's pages (4.6 GiB at 8B).

    NOTE: only for a shared file mapping. MADV_DONTNEED on private or anonymous memory (a
    tensor copied off the map, moved to a device) would zero it instead."""
    if sys.platform != "linux" or mapped.device.type != "cpu" or not mapped.numel():
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-mapped.data_ptr() // page) * page
    stop = (mapped.data_ptr() + mapped.numel()) // page * page
    if stop > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_DONTNEED)


MADV_DONTNEED = 4


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


# The rows oneDNN lays a packed weight out for. float32 on an AVX2 CPU, Gemma's head at 1, 8 and
# 32 rows: laid out for 1 row 52, 118, 169 ms; for 32 rows 56, 79, 128 ms. bf16 (AMX) for 1.
PACK_ROWS = {torch.bfloat16: 1, torch.float32: 32}


def packable(dtype: torch.dtype, device: torch.device, weight: FrozenTensor) -> bool:
    """Whether gradient-free products in `dtype` on `device` read packed copies of weights
    that share `weight`'s cache: where the compute plan packs `dtype` (the sampler's overlay,
    `SamplingPlan.forward`), on the CPU, with the cache on.

    oneDNN's blocked layout: bf16 (where the CPU has bf16 instructions) gives the same numbers
    bit for bit (tests/unit/model), but a decode step's matrix-vector products run about twice
    as fast (the 262k x 640 head: 8 ms against 15 ms for one row). float32 (the fast sampling
    context only): oneDNN's f32 kernel rounds differently from the plain product (in the last
    bits of a sum), and on an AVX2 CPU reads the head 2-4x faster at 1-32 rows (95 -> 51 ms at
    one row, 231 -> 63 ms at eight). The packed copies live in the dense cache, so they exist
    only where the cache is on (and cost as much memory as the dense copies again)."""
    return (
        dtype in compute.current().packed
        and device.type == "cpu"
        and weight.cache.enabled
        and _onednn(dtype)
    )


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU (`_onednn`)."""
    return _onednn(dtype)


@functools.cache
def _onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` here: float32 wherever it runs; bf16 only on
    CPUs with bf16 instructions (AVX512-BF16, AMX, AVX-NE-CONVERT): elsewhere (an AVX2 machine
    running bf16 on request) its reorder raises."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [None], "")
    return out.view(*x.shape[:-1], n_out)


@torch.library.custom_op("retrograd::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (N, n_in) @ W^T for W packed by `DenseCache.packed`, as an operator `torch.compile`
    calls as it is. NOTE: Inductor lowers oneDNN's own operator only for weights it packed
    itself (frozen graph constants); a weight passed in needs this opaque wrapper."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [None], "")


@packed_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@functools.cache
def lower_packed_linear() -> None:
    """Once, before compiling graphs that use `packed_linear_op`: have Inductor call oneDNN's
    operator directly from the compiled code instead of through the Python wrapper (~6 us a
    product, 72 products a decode step of Gemma 3 270M). NOTE: Inductor's lowering registry
    is not a public interface; where it changes, the wrapper stays and only that time is lost."""
    try:
        from torch._inductor.lowering import fallback_handler, register_lowering

        call = fallback_handler(torch.ops.mkldnn._linear_pointwise.default, False)

        @register_lowering(torch.ops.retrograd.packed_linear.default, type_promotion_kind=None)
        def _lowered(x, packed):
            return call(x, packed, None, "none", [None], "")

    except Exception as exc:  # noqa: BLE001 - any change there only costs speed
        log.info("packed products stay behind their Python wrapper in compiled code: %s", exc)


def frozen_linear_group(x: torch.Tensor, weights: list[FrozenTensor]) -> list[torch.Tensor] | None:
    """[x @ W_i^T] for weights sharing the input x (q, k, v; gate, up) as one product over the
    weights stacked by rows, forward and backward; None where grouping does not apply.

    Packed while sampling (see `packable`); otherwise in 16-bit compute with the cache
    on, from a cached stacked copy that replaces the single ones (one matmul of 1,536 or 4,096
    rows instead of three or two, and one input gradient instead of a sum of three); in 8 bits,
    from the weights' 8-bit rows stacked the same way. Float32, the exactness path, keeps one
    product per weight.
    """
    grad = torch.is_grad_enabled() and x.requires_grad
    sizes = [w.shape[0] for w in weights]
    if weights[0].in_int8 and x.dtype != torch.float32:
        return list(int8_linear(x, *weights[0].cache.int8_stacked(weights)).split(sizes, -1))
    if not grad and packable(x.dtype, x.device, weights[0]):
        packed = weights[0].cache.packed(weights, x.dtype)
        return list(_packed_linear(x, packed, sum(sizes)).split(sizes, -1))
    if x.dtype == torch.float32 or not weights[0].cache.enabled:
        return None
    y = _FrozenGroup.apply(x, weights) if grad else _linear(x, _stacked(weights, x.dtype))
    return list(y.split(sizes, -1))


def _stacked(weights: list[FrozenTensor], dtype: torch.dtype) -> torch.Tensor:
    return weights[0].cache.stacked(weights, dtype)


class _FrozenGroup(torch.autograd.Function):
    """y = x @ [W_1; W_2; ...]^T for frozen weights that are never saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: list[FrozenTensor]) -> torch.Tensor:
        ctx.weights, ctx.dtype = weights, x.dtype
        return _linear(x, _stacked(weights, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = _stacked(ctx.weights, ctx.dtype)
        grad = grad.to(ctx.dtype)
        return (grad.reshape(-1, grad.shape[-1]) @ w).view(*grad.shape[:-1], w.shape[1]), None


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., n_in) @ w (n_out, n_in)^T as one 2-D matmul.

    NOTE: a 3-D input can send F.linear down a batched path that copies the transposed
    weight first (a 335 MB copy for Gemma's tied head); folding to 2-D avoids it.
    """
    out = F.linear(x.reshape(-1, x.shape[-1]), w)
    return out.view(*x.shape[:-1], w.shape[0])


class _FrozenLinear(torch.autograd.Function):
    """y = x @ W^T for a frozen W that is never saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: FrozenTensor) -> torch.Tensor:
        ctx.weight = weight
        ctx.dtype = x.dtype
        return _linear(x, weight.dense(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.weight.dense(ctx.dtype)  # dequantized again: nothing dense was kept
        grad = grad.to(ctx.dtype)
        return (grad.reshape(-1, grad.shape[-1]) @ w).view(*grad.shape[:-1], w.shape[1]), None


def frozen_linear(x: torch.Tensor, weight: FrozenTensor) -> torch.Tensor:
    """x (..., n_in) -> (..., n_out) in x's dtype."""
    if weight.in_int8:
        return int8_linear(x, *weight.cache.int8_of(weight))
    if not torch.is_grad_enabled() or not x.requires_grad:
        if packable(x.dtype, x.device, weight):
            return _packed_linear(x, weight.cache.packed([weight], x.dtype), weight.shape[0])
        return _linear(x, weight.dense(x.dtype))
    return _FrozenLinear.apply(x, weight)
