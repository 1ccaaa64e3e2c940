"""Mixtures of experts: experts kept in their 3-D GGUF tensors, routed as llama.cpp routes.

The router (`ffn_gate_inp`, a plain Linear) scores every expert; `route` picks the top k and
weighs them exactly as llama.cpp's build_moe_ffn does (softmax, sigmoid or gpt-oss's softmax
over the selected, the selection bias `exp_probs_b`, normalization of the weights). `ffn` then
groups the (token, expert) pairs by expert and runs each selected expert only on its own
tokens: an expert's weights are dequantized when it has tokens, never all of them at once and
never as a dense sum over all experts. Backward recomputes the same products from the stored
bytes. This module knows the block's parts by their GGUF names and nothing of the decoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from retrograd.model.dequant import dequantize_rows
from retrograd.model.frozen import FrozenTensor

WEIGHTS_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the sum of the weights (smallest f16 normal)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's swiglu_oai constants, as llama.cpp fixes them


class Experts(nn.Module):
    """One 3-D expert tensor (n_expert, n_out, n_in) as stored, and its bias (n_expert, n_out).

    `lora`, when set, holds a low-rank update per expert in llama.cpp's adapter layout:
    lora_a (n_expert, r, n_in), lora_b (n_expert, n_out, r), with `scale` and `enabled`.
    """

    def __init__(self, frozen: FrozenTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.frozen = frozen
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.lora: nn.Module | None = None

    @property
    def n_expert(self) -> int:
        return self.frozen.shape[0]

    @property
    def in_features(self) -> int:
        return self.frozen.shape[2]

    @property
    def out_features(self) -> int:
        return self.frozen.shape[1]

    def weight(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix (n_out, n_in): from the dense cache when it is on, else only that
        expert's rows dequantized (the 3-D tensor is n_expert contiguous 2-D blocks)."""
        f = self.frozen
        if f.cache.enabled:
            return f.dense(dtype)[e]
        n_out = self.out_features
        rows = slice(e * n_out, (e + 1) * n_out)
        return dequantize_rows(f.raw, f.ggml_type, f.shape, rows, dtype=dtype, name=f.name)

    def forward(self, x: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """x (M, n_in): rows grouped by expert, counts[i] rows for experts[i] -> (M, n_out)."""
        y = _ExpertProduct.apply(x, self, experts, counts)
        if self.bias is not None:
            ids = _row_experts(experts, counts, x.device)
            y = y + self.bias[ids].to(y.dtype)
        lora = self.lora
        if lora is not None and lora.enabled:
            y = y + _lora_segments(x, lora, experts, counts).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        e, o, i = self.frozen.shape
        return f"{e} experts, {i} -> {o}, {self.frozen.ggml_type.name}"


def _row_experts(experts: list[int], counts: list[int], device) -> torch.Tensor:
    """The expert of each grouped row (M,)."""
    ids = torch.tensor(experts, device=device)
    return ids.repeat_interleave(torch.tensor(counts, device=device))


def _segments(x: torch.Tensor, experts_mod: Experts, experts, counts, backward: bool):
    """Each expert's rows times its matrix: x W^T forward, g W for the input gradient."""
    out_dim = experts_mod.in_features if backward else experts_mod.out_features
    out = x.new_empty(x.shape[0], out_dim)
    start = 0
    for e, n in zip(experts, counts, strict=True):
        w = experts_mod.weight(e, x.dtype)  # (n_out, n_in)
        seg = x[start : start + n]
        out[start : start + n] = seg @ w if backward else seg @ w.T
        start += n
    return out


class _ExpertProduct(torch.autograd.Function):
    """Grouped rows times their experts' frozen matrices; nothing dense is saved: backward
    dequantizes the selected experts again (or reads the dense cache)."""

    @staticmethod
    def forward(ctx, x, experts_mod, experts, counts):
        ctx.experts_mod, ctx.experts, ctx.counts = experts_mod, experts, counts
        return _segments(x, experts_mod, experts, counts, backward=False)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dx = _segments(grad.contiguous(), ctx.experts_mod, ctx.experts, ctx.counts, True)
        return dx, None, None, None


def _lora_segments(x: torch.Tensor, lora: nn.Module, experts, counts) -> torch.Tensor:
    """scale * B_e (A_e x) for each row's expert e (llama.cpp's build_lora_mm_id)."""
    pieces = []
    for e, seg in zip(experts, x.split(counts), strict=True):
        a, b = lora.lora_a[e].to(x.dtype), lora.lora_b[e].to(x.dtype)  # (r, n_in), (n_out, r)
        pieces.append((seg @ a.T) @ b.T)
    return torch.cat(pieces) * lora.scale


def route(
    logits: torch.Tensor,
    n_used: int,
    gating: str,
    norm: bool,
    scale: float = 0.0,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, n_expert) float32 -> (weights (N, k) float32, selected (N, k) long),
    as llama.cpp's build_moe_ffn: gating probabilities; the top k of probabilities plus the
    selection bias (the bias picks, the unbiased probabilities weigh); gpt-oss softmaxes the
    selected logits instead; `norm` divides by the weights' sum (clamped); `scale` multiplies
    (0 and 1: none). Gradients flow to the logits through the weights."""
    if gating == "softmax":
        probs = logits.softmax(-1)
    elif gating == "sigmoid":
        probs = logits.sigmoid()
    elif gating == "softmax_weight":
        probs = logits
    else:
        raise ValueError(f"unknown expert gating {gating!r}")
    pick = probs if selection_bias is None else probs + selection_bias.float()
    selected = pick.detach().topk(n_used, dim=-1).indices  # (N, k)
    weights = probs.gather(-1, selected)  # (N, k)
    if gating == "softmax_weight":
        weights = weights.softmax(-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHTS_SUM_MIN)
    if scale not in (0.0, 1.0):
        weights = weights * scale
    return weights, selected


def expert_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """The experts' gated activation: SwiGLU, or gpt-oss's clamped swiglu_oai
    (min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1))."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "swiglu_oai":
        g = gate.clamp(max=OAI_LIMIT)
        return g * torch.sigmoid(OAI_ALPHA * g) * (up.clamp(-OAI_LIMIT, OAI_LIMIT) + 1)
    raise ValueError(f"unknown expert activation {act!r}")


def dispatch(selected: torch.Tensor, n_expert: int):
    """(N, k) expert ids -> (order (M,): the (token, slot) pairs grouped by expert, as flat
    indices into selected; the experts that have tokens; their row counts)."""
    flat = selected.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    experts = [e for e, n in enumerate(counts) if n]
    return order, experts, [counts[e] for e in experts]


def experts_ffn(
    x: torch.Tensor,
    weights: torch.Tensor,
    selected: torch.Tensor,
    gate: Experts,
    up: Experts,
    down: Experts,
    act: str,
) -> torch.Tensor:
    """x (N, n_embd) through its selected experts, weighted and summed -> (N, n_embd) float32."""
    N, k = selected.shape
    order, experts, counts = dispatch(selected, up.n_expert)
    tokens = order // k  # the token of each grouped row
    xs = x[tokens]  # (M, n_embd)
    a = expert_act(gate(xs, experts, counts), up(xs, experts, counts), act)  # (M, n_ff)
    y = down(a, experts, counts).float() * weights.reshape(-1)[order, None]  # (M, n_embd)
    return torch.zeros(N, y.shape[1], dtype=torch.float32, device=x.device).index_add(0, tokens, y)


def ffn(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """The layer's mixture of experts: h = ffn_norm(x) (B, T, n_embd) in the compute dtype ->
    (B, T, n_embd) in the compute dtype. NOTE: the router's product and gating run in
    float32 whatever the compute dtype; only its input carries the fast path's rounding, so a
    near tie between the k-th and next expert may still fall the other way in bf16."""
    cfg = block.cfg
    moe = cfg.moe
    B, T, C = h.shape
    x = h.reshape(-1, C)
    logits = block.part("ffn_gate_inp")(x.float()).float()  # (N, n_expert)
    bias = block.part("exp_probs_b.bias")
    weights, selected = route(logits, moe.n_used, moe.gating, moe.norm, selection_bias=bias)
    gate, up, down = (block.part(n) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    y = experts_ffn(x, weights, selected, gate, up, down, moe.act)
    if block.part("ffn_up_shexp") is not None:
        y = y + shared_expert(block, x)
    return y.to(h.dtype).view(B, T, C)


def shared_expert(block, x: torch.Tensor) -> torch.Tensor:
    """The expert every token takes (qwen3next, qwen2moe): a SwiGLU FFN, times
    sigmoid(x . ffn_gate_inp_shexp) when the file has that gate -> (N, n_embd) float32."""
    gate, up = block.part("ffn_gate_shexp")(x), block.part("ffn_up_shexp")(x)
    y = block.part("ffn_down_shexp")(F.silu(gate) * up).float()
    w = block.part("ffn_gate_inp_shexp.weight")  # (n_embd,): one logit per token
    if w is not None:
        y = y * torch.sigmoid(x.float() @ w.float())[:, None]
    return y
