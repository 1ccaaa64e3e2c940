"""One decoder layer: its parts (`Block`) and its step, written once.

`layer_step` is a layer's whole step: the attention norm, the projections, q/k norms and
rope, the cache, attention, the output gate, the residual sums with their norms and the
feed-forward network. What differs between the two ways it runs is an `io`, which owns how
the layer reads its weights, writes its keys and values and attends: `EagerIO` (the Block's
Linear modules, `KVCache.update`, `attention`), used by every forward pass, and decode.py's
`DecodeIO` (oneDNN-packed products, slice writes, one-token attention), under which the
decode graph compiles `layer_step` whole. The element-wise arithmetic (norms, rope, residual
sums, the activation) is the same functions either way: each a fused kernel of its own when
run eagerly in 16-bit compute, inlined into the enclosing graph when compiled whole
(`Mode.inline`), plain operations in float32 (the exactness path, as the oracle tests saw).

Knows the layer's parts and the forward context's fields; nothing about loading, sampling or
training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from retrograd.compiled import fused
from retrograd.model.attention import attention, capped_attention
from retrograd.model.config import ModelConfig
from retrograd.model.families import FFNS, MIXERS
from retrograd.model.forward import ForwardContext, Mode
from retrograd.model.frozen import frozen_linear_group
from retrograd.model.layers import ACTIVATIONS, Linear, RMSNorm, fused_lora, rms_norm
from retrograd.model.rope import apply_rope

# The parts the built-in attention and dense FFN read as attributes (None when absent).
STANDARD_PARTS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
)

Norm = tuple[torch.Tensor, float] | None  # an RMSNorm as (weight, eps); None: no norm


@dataclass(frozen=True)
class Shape:
    """The model's constants a layer's step reads: the same values for every layer."""

    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    scale: float  # of the queries
    rope: str  # rope style
    act: str  # the feed-forward activation
    qk_norm_full: bool  # olmo2: one norm over all heads of q, one over k
    output_gate: bool  # qwen35: each head's query carries its output gate
    softcap: float  # gemma2: tanh soft-capped attention scores
    residual_scale: float  # granite: x + y * scale where a layer has no post-norm

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        return cls(
            cfg.n_head,
            cfg.n_head_kv,
            cfg.head_dim,
            cfg.head_dim_v,
            cfg.attn_scale,
            cfg.arch.rope,
            cfg.arch.ffn_act,
            cfg.arch.qk_norm_full,
            cfg.arch.attn_output_gate,
            cfg.attn_softcap,
            cfg.residual_scale,
        )


class Layer(NamedTuple):
    """One layer's parts as a step reads them: norms, and the io's handles of its projection
    groups (eagerly the Linear modules; in the decode graph packed weights with adapters)."""

    mixer: str  # "attention" or a family's mixer (model/families.py)
    ffn: str  # "dense", "none" or a family's FFN
    attn_norm: Norm
    q_norm: Norm
    k_norm: Norm
    post_attention_norm: Norm
    ffn_norm: Norm
    post_ffw_norm: Norm
    qkv: object  # q, k, v
    out: object  # attn_output
    up: object  # gate and up
    down: object  # ffn_down
    sinks: torch.Tensor | None = None  # gpt-oss: a logit per head that joins every softmax


class At(NamedTuple):
    """Where a layer attends in this call: mask, rope tables (cos None: no rope), mistral3's
    query temperature, and the io's handle of the layer's cache."""

    mask: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    q_temp: torch.Tensor | None
    cache: object


def layer_step(x, h, nxt: Norm, io, p: Layer, at: At, s: Shape, m: Mode):
    """x (B, T, C) float32 residual stream -> (the layer's output, nxt(output) in the compute
    dtype, or None). h: attn_norm(x) in the compute dtype when the previous layer made it.
    NOTE: each residual sum and the norm that reads it run as one fused kernel: fewer calls
    per decoded token."""
    h = norm_cast(x, p.attn_norm, m) if h is None else h
    y = attend(h, io, p, at, s, m) if p.mixer == "attention" else io.mix(h)
    if p.ffn == "none":  # mamba2: one sub-layer
        return residual_norm(x, y, p.post_attention_norm, nxt, s, m)
    x, h = residual_norm(x, y, p.post_attention_norm, p.ffn_norm, s, m)
    h = norm_cast(x, p.ffn_norm, m) if h is None else h
    y = feed_forward(h, io, p, s, m) if p.ffn == "dense" else io.ffn(h)
    return residual_norm(x, y, p.post_ffw_norm, nxt, s, m)


def attend(h, io, p: Layer, at: At, s: Shape, m: Mode):
    """The attention sub-layer's output before its post-norm, in the compute dtype; h is
    attn_norm(x) in the compute dtype."""
    B, T, _ = h.shape
    q, k, v = io.qkv(h, p.qkv, s)
    if s.qk_norm_full:  # olmo2: one norm over all heads of q, one over k
        q, k = rms_norm(q, *p.q_norm), rms_norm(k, *p.k_norm)
    q = q.view(B, T, s.n_head, -1)  # (B, T, H, D); (B, T, H, 2D) with a query gate
    k = k.view(B, T, s.n_head_kv, s.head_dim)  # (B, T, H_kv, D)
    v = v.view(B, T, s.n_head_kv, s.head_dim_v)
    gate = None
    if s.output_gate:  # qwen35: each head's query, then its output gate
        q, gate = q.chunk(2, dim=-1)
    qn, kn = (None, None) if s.qk_norm_full else (p.q_norm, p.k_norm)
    q, k = prep_qk(q, k, qn, kn, at.cos, at.sin, s, m)
    if at.q_temp is not None:  # mistral3: the temperature of each query's position
        q = q * at.q_temp.to(m.dtype)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, H_kv, T, D)
    v = v.to(m.dtype).transpose(1, 2)
    k, v = io.write(k, v, at)  # (B, H_kv, S, D): the cache's keys and values
    o = io.attend(q, k, v, at.mask, p.sinks, s)  # (B, H, T, D)
    B, H, T, D = o.shape
    o = o.transpose(1, 2).reshape(B, T, H * D)
    if gate is not None:
        o = o * torch.sigmoid(gate.float()).reshape(B, T, H * D).to(o.dtype)
    return io.project(o, p.out)


def feed_forward(h, io, p: Layer, s: Shape, m: Mode):
    """The dense FFN's output before its post-norm, in the compute dtype."""
    gate, up = io.gate_up(h, p.up)
    if m.fuse:
        return io.project(act_mul(gate, up, s.act, m), p.down)
    return io.project(ACTIVATIONS[s.act](gate, m.f16_gelu) * up, p.down)


def _kernel(fn, m: Mode):
    """A fused kernel, or its body inside a graph compiled whole."""
    return fn.eager if m.inline else fn


def norm_cast(x, norm: Norm, m: Mode):
    """norm(x) in the compute dtype: fused into one pass outside float32 (x itself without a
    norm)."""
    if norm is None:
        return x.to(m.dtype)
    if m.dtype == torch.float32:
        return rms_norm(x, *norm)
    return _kernel(_norm_cast, m)(_rows(x), *norm, m.dtype).view(x.shape)


def residual_norm(x, y, post: Norm, nxt: Norm, s: Shape, m: Mode):
    """(x + post(y), nxt(that) in the compute dtype or None) in float32 (x + y without a
    post-norm; granite: x + y * scale)."""
    if m.fuse and post is not None and nxt is not None:
        x2, h = _kernel(_add_norm_norm, m)(_rows(x), _rows(y), *post, *nxt, m.dtype)
        return x2.view(x.shape), h.view(x.shape)
    if post is None:
        r = s.residual_scale
        return x + (y.float() * r if r != 1.0 else y.float()), None
    if m.fuse:
        return _kernel(_add_norm, m)(_rows(x), _rows(y), *post).view(x.shape), None
    return x + rms_norm(y, *post), None


def prep_qk(q, k, q_norm: Norm, k_norm: Norm, cos, sin, s: Shape, m: Mode):
    """Queries (B, T, H, D) and keys: per-head norm (qk-norm), rope, the queries' scale ->
    the compute dtype. Fused: in one call, on the B * T rows as one sequence."""
    (wq, eq), (wk, ek) = _weight_eps(q_norm), _weight_eps(k_norm)
    if not m.fuse:
        q = _prep(q, wq, eq, cos, sin, s.rope, s.scale, m.dtype)
        return q, _prep(k, wk, ek, cos, sin, s.rope, 1.0, m.dtype)
    B, T, H, D = q.shape
    if cos is not None and cos.dim() == 2:  # shared positions (T, n_rot/2)
        cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
    flat = lambda a: None if a is None else a.reshape(B * T, a.shape[-1])  # noqa: E731
    qf, kf = q.reshape(1, B * T, H, D), k.reshape(1, B * T, *k.shape[2:])
    prep = _kernel(_prep_both, m)
    q, k = prep(qf, kf, wq, wk, eq, ek, flat(cos), flat(sin), s.rope, s.scale, m.dtype)
    return q.view(B, T, H, D), k.view(B, T, *k.shape[2:])


def act_mul(gate, up, act: str, m: Mode):
    """act(gate) * up in the compute dtype, computed in float32 in one fused pass."""
    return _kernel(_act_mul_rows, m)(_rows(gate), _rows(up), act).view(gate.shape)


def _weight_eps(norm: Norm) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else norm


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., C) -> (N, C). NOTE: the fused kernels see 2-D inputs whatever the batch and
    sequence sizes, so each compiles for few shapes (PyTorch specializes sizes 0 and 1)."""
    return x.reshape(-1, x.shape[-1])


def _prep(x, norm_weight, eps: float, cos, sin, style: str, scale: float, dtype):
    """Queries or keys (B, T, H, D): per-head norm (qk-norm), rope, scale -> `dtype`."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    x = x.float() if cos is None else apply_rope(x, cos, sin, style)  # cos None: no rope
    return (x * scale).to(dtype)


# NOTE: 4 and 5 name the norms' eps, not cos and sin (6, 7): their rows are compiled as
# constants, as they always were (a second row count compiles anew).
@fused(dynamic={0: (1,), 1: (1,), 4: (0,), 5: (0,)})  # the rows
def _prep_both(q, k, wq, wk, eps_q: float, eps_k: float, cos, sin, style: str, scale, dtype):
    return (
        _prep(q, wq, eps_q, cos, sin, style, scale, dtype),
        _prep(k, wk, eps_k, cos, sin, style, 1.0, dtype),
    )


@fused(dynamic={0: (0,)})
def _norm_cast(x, weight, eps: float, dtype):
    return rms_norm(x, weight, eps).to(dtype)


@fused(dynamic={0: (0,), 1: (0,)})
def _add_norm(x, y, weight, eps: float):
    return x + rms_norm(y, weight, eps)


@fused(dynamic={0: (0,), 1: (0,)})
def _add_norm_norm(x, y, w_post, eps_post: float, w_next, eps_next: float, dtype):
    """x + post_norm(y), and the next norm of that sum in `dtype`."""
    x = x + rms_norm(y, w_post, eps_post)
    return x, rms_norm(x, w_next, eps_next).to(dtype)


@fused(dynamic={0: (0,), 1: (0,)})
def _act_mul_rows(gate, up, act: str):
    g = gate.float()
    g = F.gelu(g, approximate="tanh") if act == "gelu_tanh" else F.silu(g)
    return (g * up.float()).to(gate.dtype)


class EagerIO:
    """A Block's io in a forward pass: its Linear modules (stacked products where
    `frozen_linear_group` applies), `KVCache.update`, and the attention the plan chooses."""

    def __init__(self, block: Block, ctx: ForwardContext):
        self.block, self.ctx = block, ctx

    def qkv(self, h, linears: tuple[Linear, ...], s: Shape):
        if len(linears) == 1:  # one fused projection (phi3's attn_qkv)
            q_len, kv_len = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            return linears[0](h).split([q_len, kv_len, s.n_head_kv * s.head_dim_v], -1)
        return _group(h, *linears)

    def gate_up(self, h, linears: tuple[Linear, ...]):
        if len(linears) == 1:  # fused gate and up (phi3)
            return linears[0](h).chunk(2, dim=-1)
        return _group(h, *linears)

    def project(self, x, linear: Linear):
        return linear(x)

    def write(self, k, v, at: At):
        ctx = self.ctx
        if ctx.cache is None:
            return k, v
        k, v = ctx.cache.update(self.block.il, k, v, ctx.start)  # (B, H_kv, S, D)
        return k.to(ctx.dtype), v.to(ctx.dtype)  # a 16-bit sampling cache under an f32 path

    def attend(self, q, k, v, mask, sinks, s: Shape):
        if s.softcap or sinks is not None:
            return capped_attention(q, k, v, mask, s.softcap, sinks)
        return attention(q, k, v, mask, 1.0, self.ctx.plan.fast_decode)  # (B, H, T, D)

    def mix(self, h):
        return MIXERS[self.block.mixer](self.block, h, self.ctx)

    def ffn(self, h):
        return FFNS[self.block.ffn_kind](self.block, h, self.ctx)


def _group(x: torch.Tensor, *linears: Linear) -> list[torch.Tensor]:
    """The linears' outputs for one input, from one stacked product where `frozen_linear_group`
    applies (packed while sampling, stacked in 16-bit compute), else one product each."""
    if any(lin.weight is not None for lin in linears):  # a trained weight: its own product
        return [lin(x) for lin in linears]
    ys = fused_lora(x, linears)
    if ys is not None:
        return ys
    ys = frozen_linear_group(x, [lin.frozen for lin in linears])
    if ys is None:
        return [lin(x) for lin in linears]
    return [lin.finish(x, y) for lin, y in zip(linears, ys, strict=True)]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """root.<name> = module, dotted names through plain containers (shortconv.in_proj), so
    that module paths stay GGUF tensor names."""
    *path, last = name.split(".")
    for piece in path:
        child = getattr(root, piece, None)
        if child is None:
            child = nn.Module()
            setattr(root, piece, child)
        root = child
    setattr(root, last, module)


def _norm(norm: RMSNorm | None) -> Norm:
    return None if norm is None else (norm.weight, norm.eps)


class Block(nn.Module):
    """One transformer layer. Optional parts are None when the architecture lacks them."""

    def __init__(self, cfg: ModelConfig, il: int, parts: dict[str, nn.Module | torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.il = il
        self.swa = cfg.swa_layers[il]
        self.has_rope = not cfg.layer_rope or cfg.layer_rope[il]  # smollm3: every 4th has none
        self.mixer = cfg.layer_mixer[il] if cfg.layer_mixer else "attention"
        self.ffn_kind = cfg.layer_ffn[il] if cfg.layer_ffn else "dense"
        self.shape = Shape.of(cfg)
        for name in STANDARD_PARTS:
            setattr(self, name, None)
        self._tensors: dict[str, str] = {}  # suffix -> buffer name
        for name, part in parts.items():
            if name == cfg.arch.ffn_norm_tensor:  # gpt-oss's post_attention_norm precedes the FFN
                name = "ffn_norm"
            if isinstance(part, nn.Module):
                _set_module(self, name, part)
            else:
                buffer = name.replace(".", "__")
                self.register_buffer(buffer, part.float(), persistent=False)
                self._tensors[name] = buffer

    def part(self, name: str):
        """The layer's tensor or module of this GGUF suffix ("ssm_a", "shortconv.in_proj"),
        or None when the file has none."""
        if name in self._tensors:
            return getattr(self, self._tensors[name])
        module = self
        for piece in name.split("."):
            module = getattr(module, piece, None)
            if module is None:
                return None
        return module

    def layer(self) -> Layer:
        """This layer's parts for a step. NOTE: read at each call: FSDP2 swaps a sharded
        block's Parameters between shards and whole tensors around its passes."""
        qkv = (self.attn_qkv,) if self.attn_qkv is not None else (
            self.attn_q, self.attn_k, self.attn_v
        )  # fmt: skip
        up = (self.ffn_up,) if self.ffn_gate is None else (self.ffn_gate, self.ffn_up)
        sinks = self.part("attn_sinks.weight") if self.cfg.arch.attn_sinks else None
        return Layer(
            self.mixer,
            self.ffn_kind,
            _norm(self.attn_norm),
            _norm(self.attn_q_norm),
            _norm(self.attn_k_norm),
            _norm(self.post_attention_norm),
            _norm(self.ffn_norm),
            _norm(self.post_ffw_norm),
            qkv,
            self.attn_output,
            up,
            self.ffn_down,
            sinks,
        )

    def at(self, ctx: ForwardContext, cache: object = None) -> At:
        """Where this layer attends in the context's call (its window's mask and rope)."""
        cos, sin = ctx.rope_swa if self.swa else ctx.rope
        if not self.has_rope:
            cos = sin = None
        return At(ctx.mask_swa if self.swa else ctx.mask, cos, sin, ctx.q_temp, cache)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # NOTE: the class's step, not the instance's: FSDP2 wraps `step` of a sharded block
        # in its gathers (distributed/fsdp2.py), which a call through forward already has.
        return Block.step(self, x, ctx)[0]

    def step(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        h: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the layer's output, next_norm of it in the compute dtype, or None). h: this
        layer's attn_norm(x) when the previous layer computed it."""
        io, m = EagerIO(self, ctx), ctx.mode
        return layer_step(x, h, _norm(next_norm), io, self.layer(), self.at(ctx), self.shape, m)

    def attention(self, x: torch.Tensor, ctx: ForwardContext, h: torch.Tensor | None = None):
        """The attention sub-layer's output before its post-norm, in the compute dtype (a
        family's mixer beside attention reads it: falcon-h1). h: attn_norm(x), when known."""
        m = ctx.mode
        h = norm_cast(x, _norm(self.attn_norm), m) if h is None else h
        return attend(h, EagerIO(self, ctx), self.layer(), self.at(ctx), self.shape, m)
