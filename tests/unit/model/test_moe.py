"""Mixture-of-experts routing and expert products against a direct float64 reference.

The reference is the plain per-token formula (llama.cpp's build_moe_ffn written out): every
token's top-k experts, their weights, each expert's full matrix from the dense 3-D tensor.
Ours groups tokens by expert and dequantizes one expert at a time.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from retrograd.gguf import TensorInfo
from retrograd.model import moe
from retrograd.model.dequant import dequantize
from retrograd.model.frozen import DenseCache, FrozenTensor
from retrograd.model.moe import Experts, experts_ffn, route

E, K, C, FF, N = 8, 2, 256, 128, 13


def experts_tensor(rng, shape, qtype, cache, bias=False):
    """An Experts module over a (quantized) 3-D tensor, and its dense float64 copy."""
    x = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    raw = quants.quantize(x, qtype) if qtype != GGMLQuantizationType.F32 else x
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    info = TensorInfo("blk.0.t", qtype, shape, raw.size, raw)
    frozen = FrozenTensor(info, torch.from_numpy(raw.copy()), cache)
    b = torch.from_numpy(rng.standard_normal(shape[:2]).astype(np.float32) * 0.1) if bias else None
    dense = dequantize(frozen.raw, qtype, shape).double()
    return Experts(frozen, b), dense


def ref_route(logits, n_used, gating, norm, bias=None):
    """Per token, in float64."""
    weights, selected = [], []
    for row in logits.double():
        probs = {"softmax": row.softmax(-1), "sigmoid": row.sigmoid(), "softmax_weight": row}[
            gating
        ]
        pick = probs if bias is None else probs + bias.double()
        order = sorted(range(len(row)), key=lambda e: -float(pick[e]))[:n_used]
        w = probs[order]
        if gating == "softmax_weight":
            w = w.softmax(-1)
        if norm:
            w = w / w.sum().clamp_min(moe.WEIGHTS_SUM_MIN)
        weights.append(w)
        selected.append(order)
    return torch.stack(weights), torch.tensor(selected)


def ref_act(g, u, act):
    if act == "silu":
        return g / (1 + torch.exp(-g)) * u
    g = torch.minimum(g, torch.tensor(7.0, dtype=g.dtype))  # gpt-oss: alpha 1.702, limit 7
    return g / (1 + torch.exp(-1.702 * g)) * (u.clamp(-7, 7) + 1)


def ref_ffn(x, weights, selected, gate, up, down, act, biases=(None, None, None)):
    """sum_j w_j down_e(act(gate_e x, up_e x)) per token, e = selected[t, j], float64."""
    bg, bu, bd = (None if b is None else b.double() for b in biases)
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(down.shape[1], dtype=torch.float64)
        for j in range(selected.shape[1]):
            e = int(selected[t, j])
            g, u = gate[e] @ x[t], up[e] @ x[t]
            if bg is not None:
                g, u = g + bg[e], u + bu[e]
            y = down[e] @ ref_act(g, u, act)
            if bd is not None:
                y = y + bd[e]
            acc = acc + weights[t, j] * y
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize(
    "gating,norm,biased",
    [
        ("softmax", True, False),
        ("softmax", False, False),
        ("sigmoid", True, True),
        ("softmax_weight", False, False),
    ],
)
def test_routing_matches_the_per_token_formula(gating, norm, biased):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.3 if biased else None
    w, sel = route(logits, K, gating, norm, selection_bias=bias)
    w_ref, sel_ref = ref_route(logits, K, gating, norm, bias)
    assert torch.equal(sel, sel_ref)
    torch.testing.assert_close(w.double(), w_ref, atol=1e-6, rtol=1e-6)
    if biased:  # the bias changes which experts are picked, not their weights
        _, sel_plain = route(logits, K, gating, norm)
        assert not torch.equal(sel, sel_plain)


@pytest.mark.parametrize(
    "qtype,act,bias,gating",
    [
        (GGMLQuantizationType.F32, "silu", False, "softmax"),
        (GGMLQuantizationType.Q8_0, "silu", False, "sigmoid"),
        (GGMLQuantizationType.F32, "swiglu_oai", True, "softmax_weight"),  # gpt-oss
    ],
)
@pytest.mark.parametrize("cached", [False, True])
def test_experts_ffn_and_gradients_match_the_dense_reference(qtype, act, bias, gating, cached):
    rng = np.random.default_rng(1)
    cache = DenseCache(cached)
    gate, gd = experts_tensor(rng, (E, FF, C), qtype, cache, bias)
    up, ud = experts_tensor(rng, (E, FF, C), qtype, cache, bias)
    down, dd = experts_tensor(rng, (E, C, FF), qtype, cache, bias)
    x = torch.from_numpy(rng.standard_normal((N, C)).astype(np.float32) * 4).requires_grad_()
    logits = torch.from_numpy(rng.standard_normal((N, E)).astype(np.float32)).requires_grad_()
    norm = gating != "softmax_weight"
    w, sel = route(logits, K, gating, norm)
    y = experts_ffn(x, w, sel, gate, up, down, act)

    x64 = x.detach().double().requires_grad_()
    l64 = logits.detach().double().requires_grad_()
    if gating == "softmax_weight":  # softmax over the selected logits
        w64 = l64.gather(-1, sel).softmax(-1)
    else:
        p64 = (l64.softmax(-1) if gating == "softmax" else l64.sigmoid()).gather(-1, sel)
        w64 = p64 / p64.sum(-1, keepdim=True)
    biases = (gate.bias, up.bias, down.bias)
    ref = ref_ffn(x64, w64, sel, gd, ud, dd, act, biases)
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=1e-5)

    r = torch.from_numpy(rng.standard_normal(y.shape))
    (y.double() * r).sum().backward()
    (ref * r).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits.grad.double(), l64.grad, atol=2e-5, rtol=1e-4)


def test_only_selected_experts_are_dequantized(monkeypatch):
    rng = np.random.default_rng(2)
    cache = DenseCache(False)
    mods = [
        experts_tensor(rng, s, GGMLQuantizationType.Q8_0, cache)[0]
        for s in [(E, FF, C), (E, FF, C), (E, C, FF)]
    ]
    seen = []
    real = Experts.weight
    monkeypatch.setattr(Experts, "weight", lambda self, e, dt: seen.append(e) or real(self, e, dt))
    x = torch.randn(3, C, requires_grad=True)
    sel = torch.tensor([[1, 5], [5, 1], [1, 6]])
    w = torch.full((3, 2), 0.5)
    experts_ffn(x, w, sel, *mods, "silu").sum().backward()
    assert sorted(set(seen)) == [1, 5, 6]
    assert len(seen) == 3 * 3 * 2  # three experts, three tensors, forward and backward


def test_expert_lora_trains_and_matches_per_expert_update():
    rng = np.random.default_rng(3)
    cache = DenseCache(False)
    gate, gd = experts_tensor(rng, (E, FF, C), GGMLQuantizationType.F32, cache)
    up, ud = experts_tensor(rng, (E, FF, C), GGMLQuantizationType.F32, cache)
    down, dd = experts_tensor(rng, (E, C, FF), GGMLQuantizationType.F32, cache)
    r = 4
    lora = nn_lora(E, C, FF, r, scale=0.5, seed=4)
    up.lora = lora
    x = torch.randn(N, C, generator=torch.Generator().manual_seed(5))
    w, sel = route(
        torch.randn(N, E, generator=torch.Generator().manual_seed(6)), K, "softmax", True
    )
    y = experts_ffn(x, w, sel, gate, up, down, "silu")
    a64, b64 = lora.lora_a.detach().double(), lora.lora_b.detach().double()
    ud_adapted = ud + 0.5 * torch.einsum("eor,eri->eoi", b64, a64)
    ref = ref_ffn(x.double(), w.double(), sel, gd, ud_adapted, dd, "silu")
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=1e-5)
    y.sum().backward()
    used = sorted(set(sel.reshape(-1).tolist()))
    grads = lora.lora_b.grad.abs().sum((1, 2))
    assert (grads[used] > 0).all() and (grads[[e for e in range(E) if e not in used]] == 0).all()


def nn_lora(n_expert, n_in, n_out, r, scale, seed):
    g = torch.Generator().manual_seed(seed)
    lora = torch.nn.Module()
    lora.lora_a = torch.nn.Parameter(torch.randn(n_expert, r, n_in, generator=g) * 0.1)
    lora.lora_b = torch.nn.Parameter(torch.randn(n_expert, n_out, r, generator=g) * 0.1)
    lora.scale, lora.enabled = scale, True
    return lora


def test_ffn_reads_the_block_parts():
    rng = np.random.default_rng(7)
    cache = DenseCache(False)
    gate, gd = experts_tensor(rng, (E, FF, C), GGMLQuantizationType.F32, cache)
    up, ud = experts_tensor(rng, (E, FF, C), GGMLQuantizationType.F32, cache)
    down, dd = experts_tensor(rng, (E, C, FF), GGMLQuantizationType.F32, cache)
    router = torch.nn.Linear(C, E, bias=False)
    bias = torch.randn(E) * 0.2
    parts = {
        "ffn_gate_inp": router,
        "ffn_gate_exps": gate,
        "ffn_up_exps": up,
        "ffn_down_exps": down,
        "exp_probs_b.bias": bias,
    }
    routing = SimpleNamespace(n_used=K, gating="sigmoid", norm=True, scale=0.0, act="silu")
    block = SimpleNamespace(cfg=SimpleNamespace(moe=routing), part=parts.get)
    h = torch.randn(2, 5, C)
    y = moe.ffn(block, h, None)
    x = h.reshape(-1, C)
    with torch.no_grad():
        w, sel = ref_route(router(x), K, "sigmoid", True, bias)
    ref = ref_ffn(x.double(), w, sel, gd, ud, dd, "silu")
    torch.testing.assert_close(y.double().reshape(-1, C), ref, atol=2e-5, rtol=1e-5)
