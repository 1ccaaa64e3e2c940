"""The gated delta net's pieces against direct float64 references (retrograd.model.delta_net)."""

from __future__ import annotations

import pytest
import torch

from retrograd.model.delta_net import delta_rule, delta_rule_chunked, l2_norm
from retrograd.model.ssm import conv


def causal_conv(x, w, state, n_pad):
    """The delta net's convolution: ggml's ssm_conv without a bias."""
    return conv(x, w, None, state, n_pad)


B, HK, HV, D = 2, 1, 2, 3


def inputs(T: int, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = l2_norm(r(B, T, HK, D), 1e-6)
    k = l2_norm(r(B, T, HK, D), 1e-6)
    v = r(B, T, HV, D)
    g = -torch.nn.functional.softplus(r(B, T, HV))
    beta = torch.sigmoid(r(B, T, HV))
    s0 = r(B, HV, D, D) * 0.5
    return q, k, v, g, beta, s0


def reference(q, k, v, g, beta, s0):
    """The recurrence written per sequence and head with explicit matrices, as ggml's loop:
    S <- exp(g) S; d = beta (v - S^T k); S <- S + k d^T; o = S^T q / sqrt(D)."""
    Bn, T, H, Dv = v.shape
    o = torch.zeros(Bn, T, H, Dv, dtype=v.dtype)
    s_out = torch.zeros_like(s0)
    for b in range(Bn):
        for h in range(H):
            hk = h % q.shape[2]  # value head h reads key head h % n_k
            S = s0[b, h].clone()
            for t in range(T):
                S = torch.exp(g[b, t, h]) * S
                d = beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, hk])
                S = S + torch.outer(k[b, t, hk], d)
                o[b, t, h] = S.T @ q[b, t, hk] / D**0.5
            s_out[b, h] = S
    return o, s_out


def test_delta_rule_equals_the_direct_reference():
    args = inputs(7)
    o, s = delta_rule(*args)
    o_ref, s_ref = reference(*args)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)


def test_delta_rule_gradients_pass_gradcheck():
    args = tuple(t.requires_grad_() for t in inputs(4))
    assert torch.autograd.gradcheck(lambda *a: delta_rule(*a), args)


def test_delta_rule_gradients_equal_the_reference_gradients():
    args = tuple(t.requires_grad_() for t in inputs(5, seed=1))
    w_o, w_s = (
        torch.randn(B, 5, HV, D, dtype=torch.float64),
        torch.randn(B, HV, D, D, dtype=torch.float64),
    )

    def grads(fn):
        o, s = fn(*args)
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), args)

    for ours, ref in zip(grads(delta_rule), grads(reference), strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T", [1, 4, 10])
def test_chunked_form_equals_the_walk_values_and_gradients(T):
    args = tuple(t.requires_grad_() for t in inputs(T, seed=2))
    o, s = delta_rule(*args)
    oc, sc = delta_rule_chunked(*args, chunk=4)
    torch.testing.assert_close(oc, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sc, s, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(o)
    g_walk = torch.autograd.grad((o * w).sum() + s.sum(), args)
    g_chunk = torch.autograd.grad((oc * w).sum() + sc.sum(), args)
    for a, b in zip(g_chunk, g_walk, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_chunked_form_passes_gradcheck():
    args = tuple(t.requires_grad_() for t in inputs(6, seed=3))
    assert torch.autograd.gradcheck(lambda *a: delta_rule_chunked(*a, chunk=4), args)


def test_a_sequence_continues_from_its_state():
    q, k, v, g, beta, s0 = inputs(9, seed=4)
    o, s = delta_rule(q, k, v, g, beta, s0)
    o1, s1 = delta_rule(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], s0)
    o2, s2 = delta_rule_chunked(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:], s1, 2)
    torch.testing.assert_close(torch.cat((o1, o2), 1), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, s, rtol=1e-12, atol=1e-12)


def conv_reference(x, w, state):
    """y[t, c] = sum_i ext[t + i, c] w[c, i] over ext = [state, x]."""
    ext = torch.cat((state, x), 1)
    K = w.shape[1]
    y = torch.stack([(ext[:, t : t + K] * w.T).sum(1) for t in range(x.shape[1])], 1)
    return y, ext[:, -(K - 1) :]


def test_causal_conv_continues_and_skips_left_padding():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    state = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    y, s = causal_conv(x, w, state, None)
    y_ref, s_ref = conv_reference(x, w, state)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)
    # row 1 left-padded by 4: its 2 real inputs continue from its state as if alone
    padded = x.clone()
    padded[1, 4:] = x[1, :2]
    padded[1, :4] = 100.0
    n_pad = torch.tensor([0, 4])
    y_pad, s_pad = causal_conv(padded, w, state, n_pad)
    y_alone, s_alone = conv_reference(x[1:, :2], w, state[1:])
    torch.testing.assert_close(y_pad[1, 4:], y_alone[0])
    torch.testing.assert_close(s_pad[1], s_alone[0])
    torch.testing.assert_close(y_pad[0], y_ref[0])
    torch.testing.assert_close(s_pad[0], s_ref[0])


def test_causal_conv_gradients_pass_gradcheck_with_a_state_and_padding():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    n_pad = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(lambda *a: causal_conv(*a, n_pad), (x, w, state))
