"""One decoder for every supported architecture, with modules named after GGUF tensors.

`Decoder.blk[3].attn_q` is the module of `blk.3.attn_q.weight`, so tensor patterns in a run
file match module paths and adapters export with no renaming. Differences between
architectures come from `ModelConfig.arch` (a facts table), read once at construction.

Precision: the residual stream, norms, rope, logits and soft-capping are float32; matmuls and
attention run in `compute_dtype` (bfloat16 for speed, float32 for exactness). The decoder
knows nothing about tokenizers, sampling or losses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from retrograd import compute
from retrograd.compiled import fused
from retrograd.model import decode
from retrograd.model.attention import attention, repeat_kv
from retrograd.model.config import ModelConfig
from retrograd.model.families import FFNS, MIXERS
from retrograd.model.frozen import FrozenTensor, frozen_linear, frozen_linear_group
from retrograd.model.kv_cache import KVCache
from retrograd.model.layers import ACTIVATIONS, Linear, RMSNorm, rms_norm
from retrograd.model.rope import apply_rope, rope_angles

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


class Block(nn.Module):
    """One transformer layer. Optional parts are None when the architecture lacks them."""

    def __init__(self, cfg: ModelConfig, il: int, parts: dict[str, nn.Module | torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.il = il
        self.swa = cfg.swa_layers[il]
        self.mixer = cfg.layer_mixer[il] if cfg.layer_mixer else "attention"
        self.ffn_kind = cfg.layer_ffn[il] if cfg.layer_ffn else "dense"
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
        self.act = ACTIVATIONS[cfg.arch.ffn_act]

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

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        B, T, _ = h.shape
        if self.attn_qkv is not None:
            q_len, kv_len = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            q, k, v = self.attn_qkv(h).split([q_len, kv_len, cfg.n_head_kv * cfg.head_dim_v], -1)
        else:
            q, k, v = _group(h, self.attn_q, self.attn_k, self.attn_v)
        if cfg.arch.qk_norm_full:  # olmo2: one norm over all heads of q, one over k
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        q = q.view(B, T, cfg.n_head, -1)  # (B, T, H, D); (B, T, H, 2D) with a query gate
        k = k.view(B, T, cfg.n_head_kv, cfg.head_dim)  # (B, T, H_kv, D)
        v = v.view(B, T, cfg.n_head_kv, cfg.head_dim_v)
        return q, k, v

    def attention(self, x: torch.Tensor, ctx: ForwardContext, h: torch.Tensor | None = None):
        """The attention sub-layer's output before its post-norm, in the compute dtype.
        h: attn_norm(x) in the compute dtype when the caller has it already."""
        cfg, dtype = self.cfg, ctx.dtype
        q, k, v = self.qkv(_norm(self.attn_norm, x, dtype) if h is None else h)
        gate = None
        if cfg.arch.attn_output_gate:  # qwen35: each head's query, then its output gate
            q, gate = q.chunk(2, dim=-1)
        cos, sin = ctx.rope_swa if self.swa else ctx.rope
        if cfg.layer_rope and not cfg.layer_rope[self.il]:  # smollm3: every 4th layer
            cos = sin = None
        qn, kn, style = self.attn_q_norm, self.attn_k_norm, cfg.arch.rope
        if cfg.arch.qk_norm_full:  # applied in qkv
            qn = kn = None
        if ctx.fuse:
            q, k = _prep_qk(q, k, qn, kn, cos, sin, style, cfg.attn_scale, dtype)
        else:
            q = _prep(q, *_weight_eps(qn), cos, sin, style, cfg.attn_scale, dtype)
            k = _prep(k, *_weight_eps(kn), cos, sin, style, 1.0, dtype)
        if ctx.q_temp is not None:  # mistral3: the temperature of each query's position
            q = q * ctx.q_temp.to(dtype)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, H_kv, T, D)
        v = v.to(dtype).transpose(1, 2)
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.il, k, v, ctx.start)  # (B, H_kv, S, D)
            k, v = k.to(dtype), v.to(dtype)  # a 16-bit sampling cache under an f32 compute path
        mask = ctx.mask_swa if self.swa else ctx.mask
        sinks = self.part("attn_sinks.weight") if cfg.arch.attn_sinks else None
        if cfg.attn_softcap or sinks is not None:
            o = _eager_attention(q, k, v, mask, cfg.attn_softcap, sinks)
        else:
            o = attention(q, k, v, mask, 1.0, ctx.plan.fast_decode)  # (B, H, T, D)
        B, H, T, D = o.shape
        o = o.transpose(1, 2).reshape(B, T, H * D)
        if gate is not None:
            o = o * torch.sigmoid(gate.float()).reshape(B, T, H * D).to(o.dtype)
        return self.attn_output(o)

    def ffn(self, x: torch.Tensor, ctx: ForwardContext, h: torch.Tensor | None = None):
        """The feed-forward sub-layer's output before its post-norm, in the compute dtype.
        h: ffn_norm(x) in the compute dtype when the caller has it already."""
        h = _norm(self.ffn_norm, x, ctx.dtype) if h is None else h
        if self.ffn_gate is None:  # fused gate and up (phi3)
            gate, up = self.ffn_up(h).chunk(2, dim=-1)
        else:
            gate, up = _group(h, self.ffn_gate, self.ffn_up)
        if ctx.fuse:
            return self.ffn_down(_act_mul(gate, up, self.cfg.arch.ffn_act))
        return self.ffn_down(self.act(gate, ctx.f16_gelu) * up)

    def residual(self, x: torch.Tensor, y: torch.Tensor, norm: RMSNorm | None, fuse: bool):
        """x + post_norm(y) in float32 (x + y without a post-norm; granite: x + y * scale)."""
        if norm is None:
            s = self.cfg.residual_scale
            return x + (y.float() * s if s != 1.0 else y.float())
        if fuse:
            return _add_norm(_rows(x), _rows(y), norm.weight, norm.eps).view(x.shape)
        return x + norm(y)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # NOTE: the class's step, not the instance's: FSDP2 wraps `step` of a sharded block
        # in its gathers (model/fsdp2.py), which a call through forward already has.
        return Block.step(self, x, ctx)[0]

    def step(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        h: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the layer's output, next_norm of it in the compute dtype, or None). h: this
        layer's attn_norm(x) when the previous layer computed it. NOTE: each residual sum and
        the norm that reads it run as one fused kernel: fewer calls per decoded token."""
        y, post = self.mix(x, ctx, h), self.post_attention_norm
        if self.ffn_kind == "none":  # mamba2: one sub-layer
            return self._residual_norm(x, y, post, next_norm, ctx)
        x, h = self._residual_norm(x, y, post, self.ffn_norm, ctx)
        return self._residual_norm(
            x, self.feed_forward(x, ctx, h), self.post_ffw_norm, next_norm, ctx
        )

    def mix(self, x: torch.Tensor, ctx: ForwardContext, h: torch.Tensor | None = None):
        """The token mixer's output (attention, or the family's recurrent mixer)."""
        if self.mixer == "attention":
            return self.attention(x, ctx, h)
        h = _norm(self.attn_norm, x, ctx.dtype) if h is None else h
        return MIXERS[self.mixer](self, h, ctx)

    def feed_forward(self, x: torch.Tensor, ctx: ForwardContext, h: torch.Tensor | None = None):
        """The dense FFN, or the family's (a mixture of experts)."""
        if self.ffn_kind == "dense":
            return self.ffn(x, ctx, h)
        h = _norm(self.ffn_norm, x, ctx.dtype) if h is None else h
        return FFNS[self.ffn_kind](self, h, ctx)

    def _residual_norm(self, x, y, post: RMSNorm | None, nxt: RMSNorm | None, ctx):
        """(x + post(y), nxt(that) in the compute dtype or None)."""
        if ctx.fuse and post is not None and nxt is not None:
            w, eps = (post.weight, nxt.weight), (post.eps, nxt.eps)
            x2, h = _add_norm_norm(_rows(x), _rows(y), *w, *eps, ctx.dtype)
            return x2.view(x.shape), h.view(x.shape)
        return self.residual(x, y, post, ctx.fuse), None


def _group(x: torch.Tensor, *linears: Linear) -> list[torch.Tensor]:
    """The linears' outputs for one input, from one stacked product where `frozen_linear_group`
    applies (packed while sampling, stacked in 16-bit compute), else one product each."""
    if any(lin.weight is not None for lin in linears):  # a trained weight: its own product
        return [lin(x) for lin in linears]
    ys = frozen_linear_group(x, [lin.frozen for lin in linears])
    if ys is None:
        return [lin(x) for lin in linears]
    return [lin.finish(x, y) for lin, y in zip(linears, ys, strict=True)]


def _weight_eps(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


def _norm(norm: RMSNorm | None, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """norm(x) in `dtype`: fused into one pass outside float32 (x itself without a norm)."""
    if norm is None:
        return x.to(dtype)
    if dtype == torch.float32:
        return norm(x)
    return _norm_cast(_rows(x), norm.weight, norm.eps, dtype).view(x.shape)


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


@fused(dynamic={0: (1,), 1: (1,), 4: (0,), 5: (0,)})  # the rows
def _prep_both(q, k, wq, wk, eps_q: float, eps_k: float, cos, sin, style: str, scale, dtype):
    return (
        _prep(q, wq, eps_q, cos, sin, style, scale, dtype),
        _prep(k, wk, eps_k, cos, sin, style, 1.0, dtype),
    )


def _prep_qk(q, k, q_norm, k_norm, cos, sin, style: str, scale: float, dtype):
    """_prep of queries and keys in one fused call, on the B * T rows as one sequence."""
    B, T, H, D = q.shape
    if cos is not None and cos.dim() == 2:  # shared positions (T, n_rot/2)
        cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
    flat = lambda a: None if a is None else a.reshape(B * T, a.shape[-1])  # noqa: E731
    (wq, eq), (wk, ek) = _weight_eps(q_norm), _weight_eps(k_norm)
    qf, kf = q.reshape(1, B * T, H, D), k.reshape(1, B * T, *k.shape[2:])
    q, k = _prep_both(qf, kf, wq, wk, eq, ek, flat(cos), flat(sin), style, scale, dtype)
    return q.view(B, T, H, D), k.view(B, T, *k.shape[2:])


@fused(dynamic={0: (0,)})
def _norm_cast(x, weight, eps: float, dtype):
    return rms_norm(x, weight, eps).to(dtype)


@fused(dynamic={0: (0,), 1: (0,)})
def _add_norm(x, y, weight, eps: float):
    return x + rms_norm(y, weight, eps)


@fused(dynamic={0: (0,), 1: (0,)})
def _add_norm_norm(x, y, w_post, w_next, eps_post: float, eps_next: float, dtype):
    """x + post_norm(y), and the next norm of that sum in `dtype`."""
    x = x + rms_norm(y, w_post, eps_post)
    return x, rms_norm(x, w_next, eps_next).to(dtype)


def _act_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in the compute dtype, computed in float32 in one fused pass."""
    return _act_mul_rows(_rows(gate), _rows(up), act).view(gate.shape)


@fused(dynamic={0: (0,), 1: (0,)})
def _act_mul_rows(gate, up, act: str):
    g = gate.float()
    g = F.gelu(g, approximate="tanh") if act == "gelu_tanh" else F.silu(g)
    return (g * up.float()).to(gate.dtype)


def _eager_attention(q, k, v, mask, cap: float = 0.0, sinks=None) -> torch.Tensor:
    """Attention in float32 with what SDPA has no hook for: tanh soft-capped scores (gemma2),
    and sinks (gpt-oss, (H,)): one logit per head that joins every softmax and is dropped
    after it, so that a query's weights on the keys sum to less than one."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = q.float() @ k.float().transpose(-1, -2)  # (B, H, T, S)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    B, H, T, S = scores.shape
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :S]
        return (probs @ v.float()).to(q.dtype)
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class ForwardContext:
    """Per-call values shared by all layers: rope tables, masks, cache, dtypes, and the compute
    plan's switches (`plan`, read once per forward: retrograd/compute.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        T: int,
        start: int,
        cache: KVCache | None,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None,
        f16_gelu: bool,
        key_mask: torch.Tensor | None,
        positions: torch.Tensor | None = None,
    ):
        self.dtype, self.cache, self.start, self.f16_gelu = dtype, cache, start, f16_gelu
        self.plan = compute.current()
        self.T, self.B = T, 1  # the decoder sets B, the batch size
        # (B, T): False at left padding, where a recurrent layer must keep its state as it is
        self.valid = None if key_mask is None else key_mask[:, start : start + T]
        # NOTE: float32 is the exactness path: plain eager operations, as the oracle tests saw
        self.fuse = dtype != torch.float32 if self.plan.fuse is None else self.plan.fuse
        if positions is None:  # shared by the batch: cache slot = position
            positions = torch.arange(start, start + T, device=device)  # (T,)
        self.rope = _angles(
            positions, cfg, cfg.rope_base, cfg.rope_freq_scale, cfg.yarn, freq_factors
        )
        self.rope_swa = self.rope
        if any(cfg.swa_layers):  # llama.cpp: no YaRN and no linear scale in window layers
            scale = cfg.rope_freq_scale_swa  # (but gpt-oss's window layers keep them)
            yarn = cfg.yarn if cfg.arch.swa_rope_scaled else None
            self.rope_swa = _angles(positions, cfg, cfg.rope_base_swa, scale, yarn, freq_factors)
        self.q_temp = _temperature(positions, cfg) if cfg.attn_temp_scale else None
        S = start + T
        needs_mask = cache is not None and start > 0 or key_mask is not None
        self.mask = _causal_mask(T, S, 0, device, key_mask) if needs_mask else None
        self.mask_swa = self.mask
        if cfg.swa_window and S > cfg.swa_window:
            self.mask_swa = _causal_mask(T, S, cfg.swa_window, device, key_mask)

    def state(self, il: int) -> tuple[torch.Tensor, ...] | None:
        """Layer il's recurrent state before position `start` (batch first), or None at the
        start of the sequences (a zero state)."""
        if self.cache is None or self.start == 0:
            return None
        return self.cache.read_state(il, self.start, self.B)

    def keep(self, il: int, state: tuple[torch.Tensor, ...]) -> None:
        """Layer il's recurrent state after the last position, for the next call."""
        if self.cache is not None:
            self.cache.write_state(il, self.start, self.start + self.T, state)


def _temperature(positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """mistral3 (llama 4's temperature tuning): each query times 1 + s ln(floor(p / n) + 1),
    in float64 as llama.cpp fills its input -> (T, 1, 1) or (B, T, 1, 1) float32."""
    p = positions.clamp(min=0).to(torch.float32) / float(cfg.attn_temp_floor)
    t = torch.log(torch.floor(p).double() + 1.0) * cfg.attn_temp_scale + 1.0
    return t.float()[..., None, None]


def _angles(positions: torch.Tensor, cfg: ModelConfig, base: float, scale: float, yarn, factors):
    """cos, sin of shared positions (T,) -> (T, n_rot/2), or per sequence (B, T) -> (B, T, n_rot/2)."""
    cos, sin = rope_angles(positions.reshape(-1), cfg.n_rot, base, scale, factors, yarn)
    return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def _causal_mask(T: int, S: int, window: int, device, key_mask) -> torch.Tensor:
    """(T, S) or (B, 1, T, S) bool, True where query t (at S - T + t) may see key s."""
    p1 = torch.arange(S - T, S, device=device)[:, None]
    p0 = torch.arange(S, device=device)[None, :]
    mask = p0 <= p1
    if window:
        mask &= (p1 - p0) < window
    if key_mask is not None:  # (B, S): False for padding keys
        # NOTE: a padding query sees at least itself, so its row stays finite (no NaN reaches
        # the cache); real queries already see their own key, so nothing else changes.
        mask = mask[None, None] & key_mask[:, None, None, :] | (p0 == p1)
    return mask


class Decoder(nn.Module):
    """ids (B, T) -> hidden states after output_norm (B, T, n_embd) float32; `head` -> logits."""

    def __init__(
        self,
        cfg: ModelConfig,
        token_embd: FrozenTensor,
        blocks: list[Block],
        output_norm: RMSNorm,
        output: Linear | None,
        freq_factors: torch.Tensor | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.token_embd = token_embd
        self.blk = nn.ModuleList(blocks)
        self.output_norm = output_norm
        self.output = output
        self.register_buffer("rope_freqs", freq_factors, persistent=False)
        self.compute_dtype = torch.float32
        self.f16_gelu = True
        self.embed_scale = math.sqrt(cfg.n_embd) if cfg.arch.embed_scale else cfg.embedding_scale
        self.logit_mul = 1.0 / cfg.logit_scale  # granite: logits / logit_scale
        self.checkpointing: tuple[int, torch.dtype] | None = None
        self.base_trained = False  # a Linear reads a trained weight (trainable/base.py)
        self.plan: compute.ComputePlan | None = None  # what it was loaded by (model/loader.py)
        # Blocks sharded by FSDP2 (model/fsdp2.py): a block's weights exist whole only
        # within its own pass, so no block may read the next one's norm ahead of time.
        self.sharded = False

    @property
    def device(self) -> torch.device:
        return self.token_embd.device

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype
        # llama.cpp's CPU GELU table only matters where we match it digit for digit.
        self.f16_gelu = dtype == torch.float32

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embd.rows(ids, torch.float32)  # (B, T, n_embd)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def forward(
        self,
        ids: torch.Tensor,
        start: int = 0,
        cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`start`: the cache slot of ids[:, 0]. `positions` (B, T): rope positions per sequence
        when they differ from the slots (left-padded batches); `key_mask` (B, S) hides padding."""
        B, T = ids.shape
        ctx = ForwardContext(
            self.cfg,
            T,
            start,
            cache,
            self.compute_dtype,
            ids.device,
            self.rope_freqs,
            self.f16_gelu,
            key_mask,
            positions,
        )
        ctx.B = B
        x = self.embed(ids)
        if self.checkpointing is not None and torch.is_grad_enabled():
            x = self._checkpointed_blocks(x, ctx)
        elif decode.applies(self, ctx, T):
            x = decode.decode_layers(self, x, ctx)
        else:
            h = None
            for i, block in enumerate(self.blk):
                last = i + 1 == len(self.blk) or self.sharded
                nxt = None if last else self.blk[i + 1].attn_norm
                x, h = block.step(x, ctx, h, nxt)
        if cache is not None:
            cache.length = start + T
        return self.output_norm(x)

    def enable_checkpointing(self, every_n_layers: int, dtype: torch.dtype = torch.float32) -> None:
        """Recompute activations in backward: keep only every n-th layer's input, in `dtype`."""
        self.checkpointing = (max(1, every_n_layers), dtype)

    def _checkpointed_blocks(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        stride, dtype = self.checkpointing
        for first in range(0, len(self.blk), stride):
            group = self.blk[first : first + stride]

            def run(x_stored: torch.Tensor, group=group) -> torch.Tensor:
                y = x_stored.float()
                for block in group:
                    y = block(y, ctx)
                return y

            # NOTE: the stored input is the segment's only saved activation; f16/bf16 storage
            # halves it and rounds the residual stream at segment boundaries. early_stop off:
            # stopping the recomputation early trips over the compiled kernels inside
            # (torch.utils.checkpoint: "target_frame.early_stop is set" in 16-bit compute).
            x = checkpoint(run, x.to(dtype), use_reentrant=False, early_stop=False)
        return x

    def head(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Hidden states (..., n_embd) -> logits (..., n_vocab) float32. float32=False leaves
        them in the compute dtype when nothing follows the product (no soft-capping): the same
        values, without a (rows x vocabulary) float32 copy."""
        h = h.to(self.compute_dtype)
        if self.output is not None:
            logits = self.output(h)
        else:
            logits = frozen_linear(h, self.token_embd)
        if self.logit_mul != 1.0:  # after the product, as llama.cpp scales
            logits = (logits.float() if float32 else logits) * self.logit_mul
        cap = self.cfg.final_softcap
        if not float32 and not cap:
            return logits
        logits = logits.float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
