"""One decode step of a layer as one compiled graph: the fast sampling context's hot loop.

A decode step with a few sequences is small work cut into many pieces: per layer, four
matrix products over oneDNN-packed weights, the norms, rope, the one-token attention over
the KV cache and the residual sums. Run one by one, those pieces cost more in dispatch than
in arithmetic (Gemma 3 270M: ~0.87 ms a layer at 8 sequences, ~0.4 ms of it in products that
read the weights from memory). `decode_layers` hands each layer to `torch.compile` as one
function, so the element-wise work fuses into a few loops and PyTorch is entered once per
layer (~0.6 ms a layer).

The arithmetic is the fused path's (`model/decoder.py`): float32 norms, rope and residual
stream, bf16 products, float32 attention straight from the cache (`fast_decode`). It applies
only where that path would run anyway: one new token per sequence, a 16-bit compute dtype on
the CPU, packed weights (`packed_weights`), the fast decode context, no attention
soft-capping; elsewhere the decoder runs layer by layer as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrograd.compiled import fused
from retrograd.model.attention import last_query_mask
from retrograd.model.frozen import lower_packed_linear, onednn_packs, packable, packed_linear_op
from retrograd.model.layers import rms_norm
from retrograd.model.rope import apply_rope


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
    cfg, dtype = decoder.cfg, ctx.dtype
    B = x.shape[0]
    S = ctx.start + 1
    if S > ctx.cache.capacity:  # as KVCache.update says it
        raise ValueError(f"KV cache holds {ctx.cache.capacity} positions, {S} requested")
    masks, ropes = [], []  # global, then sliding window
    for mask, (cos, sin) in ((ctx.mask, ctx.rope), (ctx.mask_swa, ctx.rope_swa)):
        masks.append(last_query_mask(mask, B))  # start > 0: the context always has a mask
        # (B, 1, n_rot/2) or (1, n_rot/2) -> (B, 1, n_rot/2)
        ropes.append((cos.expand(B, 1, cos.shape[-1]), sin.expand(B, 1, sin.shape[-1])))
    consts = (
        (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v),
        cfg.attn_scale,
        cfg.arch.rope,
        cfg.arch.ffn_act,
    )
    lower_packed_linear()
    h = x.view(B, -1)
    for block in decoder.blk:
        swa, fused, weights, norms, extras = _layer_args(block, dtype)
        mask, (cos, sin) = masks[swa], ropes[swa]
        k_cache, v_cache = ctx.cache.k[block.il], ctx.cache.v[block.il]
        h = _layer(h, k_cache, v_cache, mask, cos, sin, *weights, norms, extras, *fused, *consts)
    return h.view(x.shape)


def _layer_args(block, dtype: torch.dtype):
    """(sliding window, fused projections, packed weights, norms, extras) of one block."""
    parts = getattr(block, "_decode_parts", None)
    if parts is None:  # NOTE: what never changes after loading, looked up once (per step,
        # nn.Module attribute lookups cost ~0.3 ms for Gemma 3 270M's 18 layers)
        if block.attn_qkv is not None:
            attn = [block.attn_qkv]
        else:
            attn = [block.attn_q, block.attn_k, block.attn_v]
        ffn = [block.ffn_up] if block.ffn_gate is None else [block.ffn_gate, block.ffn_up]
        groups = (attn, [block.attn_output], ffn, [block.ffn_down])
        norms = (
            block.attn_norm,
            block.attn_q_norm,
            block.attn_k_norm,
            block.post_attention_norm,
            block.ffn_norm,
            block.post_ffw_norm,
        )
        parts = block._decode_parts = (
            (block.swa, (len(attn) == 1, len(ffn) == 1)),  # phi3: attn_qkv; gate+up in ffn_up
            tuple(lin for g in groups for lin in g),
            tuple([lin.frozen for lin in g] for g in groups),
            tuple((None, 0.0) if n is None else (n.weight, n.eps) for n in norms),
        )
    (swa, fused), linears, frozen, norms = parts
    cache = frozen[0][0].cache
    packed = tuple(cache.packed(g, dtype) for g in frozen)
    extras = tuple(_extras(lin) for lin in linears)
    return swa, fused, packed, norms, None if all(e is None for e in extras) else extras


def _extras(lin):
    """(bias, lora A, lora B, lora scale) of a linear, or None when it has neither."""
    lora = lin.lora if lin.lora is not None and lin.lora.enabled else None
    if lora is None:
        return None if lin.bias is None else (lin.bias, None, None, 1.0)
    return (lin.bias, lora.lora_a, lora.lora_b, float(lora.scale))


def _finish(x, y, extra):
    """Linear.finish inside the graph: + bias, + scale * B (A x) (the LoRA's own rounding)."""
    if extra is None:
        return y
    bias, a, b, scale = extra
    if bias is not None:
        y = y + bias.to(y.dtype)
    if a is not None:
        xa = x @ a.to(x.dtype).T
        y = torch.addmm(y, xa.to(y.dtype), (b * scale).to(y.dtype).T)
    return y


def _norm(x, norm):
    """rms_norm(x) in float32 with norm = (weight, eps); x in float32 where weight is None."""
    w, eps = norm
    return x.float() if w is None else rms_norm(x, w, eps)


# NOTE: one compiled call per layer measured fastest; graphs of 6 or 18 layers ran slower.
@fused(dynamic={0: (0,), 1: (0, 2), 2: (0, 2), 3: (0, 1), 4: (0,), 5: (0,)})
def _layer(
    x, k_cache, v_cache, mask, cos, sin, w_attn, w_o, w_ffn, w_down, norms, extras,
    fused_qkv: bool, fused_up: bool, shape, scale: float, style: str, act: str,
):  # fmt: skip
    """One layer for one token per sequence: x (B, C) f32; caches (B, H_kv, capacity, D);
    mask (B, S) with S = the new token's slot + 1; cos, sin (B, 1, n_rot/2)."""
    n_attn, n_q, n_k, n_post, n_ffn, n_ffw = norms
    H, H_kv, D, Dv = shape
    B, dtype = x.shape[0], k_cache.dtype
    S = mask.shape[1]
    ex = iter(extras or (None,) * 7)
    h = _norm(x, n_attn).to(dtype)
    qkv = packed_linear_op(h, w_attn)
    sizes = [H * D, H_kv * D, H_kv * Dv]
    if fused_qkv:
        q, k, v = _finish(h, qkv, next(ex)).split(sizes, -1)
    else:
        q, k, v = (_finish(h, y, next(ex)) for y in qkv.split(sizes, -1))
    q = q.reshape(B, 1, H, D)
    k = k.reshape(B, 1, H_kv, D)
    q = (apply_rope(_norm(q, n_q), cos, sin, style) * scale).to(dtype)
    k = apply_rope(_norm(k, n_k), cos, sin, style).to(dtype)
    # NOTE: the slot as a slice bound (S - 1 : S) keeps S a variable of the compiled graph;
    # an integer index would compile once per position.
    k_cache[:, :, S - 1 : S] = k.view(B, H_kv, 1, D)
    v_cache[:, :, S - 1 : S] = v.reshape(B, H_kv, 1, Dv).to(dtype)
    keys, values = k_cache[:, :, :S].float(), v_cache[:, :, :S].float()
    qg = q.view(B, H_kv, H // H_kv, D).float()
    s = (qg[:, :, :, None, :] * keys[:, :, None]).sum(-1)  # (B, H_kv, g, S)
    s = torch.where(mask[:, None, None, :], s, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    # NOTE: summing over the keys as an outer dimension (the values' rows) and normalizing
    # after measured ~20 us a layer faster than softmax, then a sum over the inner dimension
    o = (e.permute(0, 1, 3, 2)[..., None] * values[:, :, :, None, :]).sum(2)  # (B, H_kv, g, Dv)
    o = (o / e.sum(-1)[..., None]).to(dtype).reshape(B, H * Dv)
    x = x + _norm(_finish(o, packed_linear_op(o, w_o), next(ex)), n_post)
    h = _norm(x, n_ffn).to(dtype)
    gu = packed_linear_op(h, w_ffn)
    if fused_up:
        gate, up = _finish(h, gu, next(ex)).chunk(2, -1)
    else:
        gate, up = (_finish(h, y, next(ex)) for y in gu.chunk(2, -1))
    g = gate.float()
    g = F.gelu(g, approximate="tanh") if act == "gelu_tanh" else F.silu(g)
    a = (g * up.float()).to(dtype)
    return x + _norm(_finish(a, packed_linear_op(a, w_down), next(ex)), n_ffw)
