"""One decode step of a layer as one compiled graph: the fast sampling context's hot loop.

A decode step with a few sequences is small work cut into many pieces: per layer, four
matrix products over oneDNN-packed weights, the norms, rope, the one-token attention over
the KV cache and the residual sums. Run one by one, those pieces cost more in dispatch than
in arithmetic (Gemma 3 270M: ~0.87 ms a layer at 8 sequences, ~0.4 ms of it in products that
read the weights from memory). `decode_layers` compiles the block's own step
(model/block.py `layer_step`) whole, once per layer call, under `DecodeIO`: packed products,
slice writes into the cache and `one_token_attention`, so the element-wise work fuses into a
few loops and PyTorch is entered once per layer (~0.6 ms a layer).

It applies only where that arithmetic would run anyway (`applies`): one new token per
sequence, a 16-bit compute dtype on the CPU, packed weights, the fast decode context of a
compiling plan, a model whose layers are attention and a dense FFN without extra steps;
elsewhere the decoder runs layer by layer. Knows the layer's parts and the packed weights;
nothing about sampling.
"""

from __future__ import annotations

import torch

from retrograd.compiled import fused
from retrograd.model.attention import last_query_mask, one_token_attention
from retrograd.model.block import At, Layer, Mode, Shape, layer_step
from retrograd.model.frozen import lower_packed_linear, onednn_packs, packable, packed_linear_op
from retrograd.model.layers import finish

graph_calls = 0  # layer steps run through the graph (tests count them)


def model_reason(decoder) -> str | None:
    """Why no decode step of this model, as loaded, can take the graph; None when one can
    (the loader reports it; `applies` adds what each call decides)."""
    cfg, dtype = decoder.cfg, decoder.compute_dtype
    if not cfg.plain or cfg.attn_softcap:
        return f"{cfg.name}'s layers have steps the graph lacks"
    if decoder.device.type != "cpu":
        return f"on {decoder.device.type}"
    if dtype == torch.float32:
        return "float32 compute"
    if decoder.token_embd.cache.int8:
        return "weights kept in 8 bits (no packed copies)"
    if not decoder.token_embd.cache.enabled:
        return "the dequantized-weight cache is off"
    if not onednn_packs(dtype):
        return f"oneDNN packs no {str(dtype).replace('torch.', '')} weights on this CPU"
    return None


def applies(decoder, ctx, T: int) -> bool:
    """Whether this forward may run its layers through `decode_layers`: a decode step (one
    new token after a prefill) in the fast sampling context of a compiling plan, over packed
    weights (`packable`: the cache on, this dtype packed) of a model `model_reason` admits."""
    return (
        T == 1
        and ctx.cache is not None
        and ctx.start > 0
        and ctx.fuse
        and ctx.plan.fast_decode
        and ctx.plan.compile
        and not decoder.base_trained  # packed copies are of the file's weights
        and ctx.cache.k[0].dtype == ctx.dtype
        and packable(ctx.dtype, decoder.device, decoder.token_embd)
        and model_reason(decoder) is None
    )


def decode_layers(decoder, x: torch.Tensor, ctx) -> torch.Tensor:
    """x (B, 1, n_embd) float32 residual stream -> the last layer's output, same shape; writes
    each layer's new keys and values into the cache at slot ctx.start."""
    global graph_calls
    B, S = x.shape[0], ctx.start + 1
    if S > ctx.cache.capacity:  # as KVCache.update says it
        raise ValueError(f"KV cache holds {ctx.cache.capacity} positions, {S} requested")
    masks, ropes = [], []  # global, then sliding window
    for mask, (cos, sin) in ((ctx.mask, ctx.rope), (ctx.mask_swa, ctx.rope_swa)):
        masks.append(last_query_mask(mask, B))  # start > 0: the context always has a mask
        # (B, 1, n_rot/2) or (1, n_rot/2) -> (B, 1, n_rot/2)
        ropes.append((cos.expand(B, 1, cos.shape[-1]), sin.expand(B, 1, sin.shape[-1])))
    lower_packed_linear()
    shape = decoder.blk[0].shape
    for block in decoder.blk:
        cos, sin = ropes[block.swa]
        k_cache, v_cache = ctx.cache.k[block.il], ctx.cache.v[block.il]
        layer = _layer(block, ctx.dtype)
        x = _step(x, k_cache, v_cache, masks[block.swa], cos, sin, layer, shape, ctx.dtype)
        graph_calls += 1
    return x


# NOTE: one compiled call per layer measured fastest; graphs of 6 or 18 layers ran slower.
# Arguments are tensors, tuples and constants shared by every layer (no module), so one graph
# serves them all.
@fused(dynamic={0: (0,), 1: (0, 2), 2: (0, 2), 3: (0, 1), 4: (0,), 5: (0,)})
def _step(x, k_cache, v_cache, mask, cos, sin, layer: Layer, shape: Shape, dtype):
    """x (B, 1, C) f32; caches (B, H_kv, capacity, D); mask (B, S) with S = the new token's
    slot + 1; cos, sin (B, 1, n_rot/2)."""
    at = At(mask, cos, sin, None, (k_cache, v_cache))
    return layer_step(x, None, None, DecodeIO, layer, at, shape, Mode(dtype, True, True))[0]


def _layer(block, dtype: torch.dtype) -> Layer:
    """The block's parts for the graph: norms, and each projection group's packed weights with
    its output sizes and the adapters and biases of its linears (read per step: adapters
    switch on and off)."""
    parts = getattr(block, "_decode_parts", None)
    if parts is None:  # NOTE: what never changes after loading, looked up once (per step,
        # nn.Module attribute lookups cost ~0.3 ms for Gemma 3 270M's 18 layers)
        base = block.layer()
        groups = (base.qkv, (base.out,), base.up, (base.down,))
        frozen = tuple([lin.frozen for lin in g] for g in groups)
        sizes = tuple(tuple(w.shape[0] for w in f) for f in frozen)
        parts = block._decode_parts = (base[:8], groups, frozen, sizes, frozen[0][0].cache)
    head, groups, frozen, sizes, cache = parts
    qkv, out, up, down = (
        (cache.packed(f, dtype), n, tuple([_extras(lin) for lin in g]))
        for g, f, n in zip(groups, frozen, sizes, strict=True)
    )
    return Layer(*head, qkv, out, up, down)


def _extras(lin):
    """(bias, adapter) of a linear, or None when it has neither."""
    adapter = lin.adapter()
    return None if lin.bias is None and adapter is None else (lin.bias, adapter)


def _products(h, handle) -> list[torch.Tensor]:
    """h (B, 1, n_in) -> the group's outputs (B, 1, n_out), each finished with its linear's
    bias and adapter: one product over the group's packed weights."""
    packed, sizes, extras = handle
    x = h.view(h.shape[0], -1)
    y = packed_linear_op(x, packed)  # (B, sum of sizes)
    ys = y.split(list(sizes), -1) if len(sizes) > 1 else [y]
    return [_finish(part, x, e).unsqueeze(1) for part, e in zip(ys, extras, strict=True)]


def _finish(y, x, extra):
    return y if extra is None else finish(y, x, *extra)


class DecodeIO:
    """How `layer_step` reads weights, writes the cache and attends inside the decode graph."""

    @staticmethod
    def qkv(h, handle, s: Shape):
        ys = _products(h, handle)
        if len(ys) == 1:  # one fused projection (phi3's attn_qkv)
            q_len, kv_len = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            return ys[0].split([q_len, kv_len, s.n_head_kv * s.head_dim_v], -1)
        return ys

    @staticmethod
    def gate_up(h, handle):
        ys = _products(h, handle)
        return ys[0].chunk(2, -1) if len(ys) == 1 else ys  # phi3: gate and up fused

    @staticmethod
    def project(x, handle):
        return _products(x, handle)[0]

    @staticmethod
    def write(k, v, at: At):
        """Keys and values (B, H_kv, 1, D) into the cache at slot S - 1; -> [0, S)."""
        k_cache, v_cache = at.cache
        S = at.mask.shape[1]
        # NOTE: the slot as a slice bound (S - 1 : S) keeps S a variable of the compiled graph;
        # an integer index would compile once per position.
        k_cache[:, :, S - 1 : S] = k
        v_cache[:, :, S - 1 : S] = v.to(v_cache.dtype)
        return k_cache[:, :, :S], v_cache[:, :, :S]

    @staticmethod
    def attend(q, k, v, mask, sinks, s: Shape):
        B, H, _, D = q.shape
        o = one_token_attention(q.reshape(B, s.n_head_kv, H // s.n_head_kv, D), k, v, mask)
        return o.reshape(B, H, 1, v.shape[-1])
