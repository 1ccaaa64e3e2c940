"""The Mamba-2 conv and scan against direct references: values, states, padding, gradients.

The references are written from the recurrence's closed form, not from ssm.py's code: the
scan as a sum over earlier positions of decayed (C . B) x dt terms, the conv as an explicit
window sum. gradcheck runs in float64 on tiny shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.model import ssm


def inputs(Bt=2, T=7, H=4, P=3, G=2, N=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    x = r(Bt, T, H, P)
    dt = ssm.softplus(r(Bt, T, H) - 1.0)
    A = -torch.rand(H, generator=g, dtype=dtype) * 4 - 0.5
    B, C = r(Bt, T, G, N), r(Bt, T, G, N)
    s0 = r(Bt, H, P, N)
    return x, dt, A, B, C, s0


def scan_reference(x, dt, A, B, C, s0):
    """y[t] = C[t] . (prod_{r<=t} dA[r] s0 + sum_{s<=t} prod_{s<r<=t} dA[r] B[s] x[s] dt[s])."""
    Bt, T, H, P = x.shape
    G = B.shape[2]
    y = torch.zeros_like(x)
    decay = lambda b, h, lo, t: math.exp(float((dt[b, lo + 1 : t + 1, h] * A[h]).sum()))  # noqa: E731
    for b in range(Bt):
        for h in range(H):
            g = h // (H // G)
            for t in range(T):
                acc = decay(b, h, -1, t) * (s0[b, h] @ C[b, t, g])
                for s in range(t + 1):
                    cb = torch.dot(C[b, t, g], B[b, s, g])
                    acc = acc + decay(b, h, s, t) * cb * dt[b, s, h] * x[b, s, h]
                y[b, t, h] = acc
    state = s0 * torch.exp((dt * A).sum(1))[..., None, None]
    for s in range(x.shape[1]):
        w = torch.exp((dt[:, s + 1 :] * A).sum(1))  # (Bt, H)
        bh = ssm._heads(B, H)[:, s]  # (Bt, H, N)
        state = state + (w * dt[:, s])[..., None, None] * x[:, s, :, :, None] * bh[:, :, None]
    return y, state


@pytest.mark.parametrize("scan", [ssm.scan_steps, ssm.scan_chunked])
def test_scan_matches_the_closed_form(scan):
    x, dt, A, B, C, s0 = inputs()
    kw = {"chunk": 3} if scan is ssm.scan_chunked else {}
    y, s = scan(x, dt, A, B, C, s0, **kw)
    y_ref, s_ref = scan_reference(x, dt, A, B, C, s0)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T,chunk", [(1, 64), (50, 16), (64, 64), (130, 64)])
def test_chunked_scan_equals_steps_in_float32(T, chunk):
    x, dt, A, B, C, s0 = inputs(Bt=2, T=T, H=8, P=4, G=2, N=16, dtype=torch.float32)
    y1, s1 = ssm.scan_steps(x, dt, A, B, C, s0)
    y2, s2 = ssm.scan_chunked(x, dt, A, B, C, s0, chunk=chunk)
    torch.testing.assert_close(y2, y1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s1, rtol=1e-4, atol=1e-4)


def test_scan_in_two_parts_equals_one():
    x, dt, A, B, C, s0 = inputs(T=9)
    y, s = ssm.scan_steps(x, dt, A, B, C, s0)
    ya, sa = ssm.scan_chunked(x[:, :4], dt[:, :4], A, B[:, :4], C[:, :4], s0, chunk=2)
    yb, sb = ssm.scan_steps(x[:, 4:], dt[:, 4:], A, B[:, 4:], C[:, 4:], sa)
    torch.testing.assert_close(torch.cat((ya, yb), 1), y)
    torch.testing.assert_close(sb, s)


def test_zero_dt_leaves_the_state_exactly_as_it_was():
    x, dt, A, B, C, s0 = inputs(dtype=torch.float32)
    dt = dt.clone()
    dt[:, 2:5] = 0.0
    _, s_all = ssm.scan_steps(x, dt, A, B, C, s0)
    keep = [0, 1, 5, 6]
    _, s_kept = ssm.scan_steps(x[:, keep], dt[:, keep], A, B[:, keep], C[:, keep], s0)
    assert torch.equal(s_all, s_kept)


def conv_reference(x, w, bias, state):
    K = w.shape[1]
    xx = torch.cat((state, x), 1)
    y = torch.stack([(xx[:, t : t + K] * w.T).sum(1) for t in range(x.shape[1])], 1)
    return y + bias, xx[:, -(K - 1) :]


def conv_inputs(Bt=2, T=6, Cn=5, K=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(Bt, T, Cn), r(Cn, K), r(Cn), r(Bt, K - 1, Cn)


@pytest.mark.parametrize("T", [1, 2, 6])
def test_conv_matches_the_window_sum_and_keeps_the_last_inputs(T):
    x, w, b, s0 = conv_inputs(T=T)
    y, s = ssm.conv(x, w, b, s0)
    y_ref, s_ref = conv_reference(x, w, b, s0)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)


def test_conv_with_left_padding_equals_the_unpadded_rows():
    x, w, b, s0 = conv_inputs(T=6)
    pad = torch.tensor([0, 3])
    xp = x.clone()
    xp[1, :3] = 0.0
    y, s = ssm.conv(xp, w, b, s0, pad)
    y0, s_0 = ssm.conv(x[:1], w, b, s0[:1])
    y1, s_1 = ssm.conv(x[1:, 3:], w, b, s0[1:])
    torch.testing.assert_close(y[:1], y0)
    torch.testing.assert_close(y[1:, 3:], y1)
    torch.testing.assert_close(s, torch.cat((s_0, s_1)))


def test_scan_gradients_by_gradcheck():
    x, dt, A, B, C, s0 = (t.requires_grad_() for t in inputs(Bt=1, T=5, H=2, P=2, G=1, N=3))
    for fn in (ssm.scan_steps, lambda *a: ssm.scan_chunked(*a, chunk=2)):
        assert torch.autograd.gradcheck(fn, (x, dt, A, B, C, s0))


def test_chunked_gradients_equal_the_steps_gradients():
    args = [t.requires_grad_() for t in inputs(Bt=2, T=11, H=4, P=3, G=2, N=4)]
    weights = torch.randn(2, 11, 4, 3, dtype=torch.float64)
    grads = []
    for fn in (ssm.scan_steps, lambda *a: ssm.scan_chunked(*a, chunk=4)):
        y, s = fn(*args)
        grads.append(torch.autograd.grad((y * weights).sum() + s.pow(2).sum(), args))
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2)


def test_conv_gradients_by_gradcheck():
    x, w, b, s0 = (t.requires_grad_() for t in conv_inputs(Bt=1, T=4, Cn=3, K=3))
    assert torch.autograd.gradcheck(lambda *a: ssm.conv(*a), (x, w, b, s0))


# The mixers inside the tiny models: the state passes between calls and past left padding.

FAMILIES = ["mamba2", "falcon-h1"]
LONG = [1] + [
    int(i) for i in torch.randint(3, 512, (149,), generator=torch.Generator().manual_seed(5))
]


def load(path, dtype=torch.float32):
    import retrograd

    return retrograd.load(path, device="cpu", dtype=dtype)


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_in_pieces_across_scan_chunks_equals_one_pass(tiny_model, name):
    """70 + 1 + 79 tokens: the first piece spans two scan chunks, the second is one decoded
    step (the walked scan), the third continues from the states both left in the cache."""
    from retrograd.model.kv_cache import KVCache

    dec = load(tiny_model(name)).decoder
    ids = torch.tensor([LONG])
    with torch.no_grad():
        whole = dec.head(dec(ids))[0]
        cache = KVCache.empty(dec.cfg, 1, 160, torch.float32, dec.device)
        pieces = []
        for a, b in ((0, 70), (70, 71), (71, 150)):
            pieces.append(dec.head(dec(ids[:, a:b], start=a, cache=cache))[0])
    torch.testing.assert_close(torch.cat(pieces), whole, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padded_batch_gives_each_row_its_own_logits_and_state(tiny_model, name):
    """Rows of 150, 90 and 5 tokens, left-padded into one prefill, then one decoded token each:
    every real position, and the step after, as the row alone."""
    from retrograd.model.kv_cache import KVCache

    dec = load(tiny_model(name)).decoder
    rows = [LONG, LONG[:90], LONG[60:65]]
    W, S = 150, 152
    pad = torch.tensor([W - len(r) for r in rows])
    ids = torch.zeros(3, W, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, W - len(r) :] = torch.tensor(r)
    key_mask = torch.arange(S)[None, :] >= pad[:, None]  # (3, S)
    positions = (torch.arange(W)[None, :] - pad[:, None]).clamp_min(0)
    nxt = torch.tensor([[7], [8], [9]])
    with torch.no_grad():
        cache = KVCache.empty(dec.cfg, 3, S, torch.float32, dec.device)
        batch = dec.head(dec(ids, 0, cache, key_mask[:, :W], positions))
        step = dec.head(dec(nxt, W, cache, key_mask[:, : W + 1], W - pad[:, None]))[:, 0]
        for i, r in enumerate(rows):
            alone = dec.head(dec(torch.tensor([r + [int(nxt[i])]])))[0]
            torch.testing.assert_close(batch[i, W - len(r) :], alone[:-1], atol=2e-4, rtol=0)
            torch.testing.assert_close(step[i], alone[-1], atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_compute_stays_close_to_float32(tiny_model, name):
    path = tiny_model(name)
    f32, bf16 = load(path).logits(LONG), load(path, torch.bfloat16).logits(LONG)
    assert (f32.argmax(-1) == bf16.argmax(-1)).float().mean() >= 0.9
    assert (f32 - bf16).abs().max() < 0.05 * f32.abs().max()


@pytest.mark.parametrize("name", FAMILIES)
def test_model_gradient_through_the_scan_equals_finite_differences(tiny_model, name):
    """d log p(last token) / d (LoRA B of blk.0.ssm_in) along a random direction, by autograd
    through two scan chunks, conv and norm, against a central difference."""
    from retrograd.trainable.lora import attach_lora

    dec = load(tiny_model(name)).decoder
    lora = attach_lora(dec, ["blk.0.ssm_in.weight"], rank=4, alpha=8.0, seed=0)["blk.0.ssm_in"]
    ids = torch.tensor([LONG[:100]])

    def logp() -> torch.Tensor:
        return dec.head(dec(ids))[0, -1].log_softmax(-1)[5]

    logp().backward()
    grad = lora.lora_b.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    d = torch.randn(grad.shape, generator=torch.Generator().manual_seed(0))
    eps = 1e-2
    with torch.no_grad():
        lora.lora_b += eps * d
        up = logp()
        lora.lora_b -= 2 * eps * d
        down = logp()
    fd = float(up - down) / (2 * eps)
    assert abs(fd - float((grad * d).sum())) < 0.02 * abs(fd) + 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_inspect_lists_exactly_the_matrices_lora_can_target(tiny_model, name):
    """Every tensor group inspect offers as a LoRA target names Linears of the decoder, and every
    Linear is offered (ssm_norm, 2-D per group, is a norm, not a matrix)."""
    from retrograd.cli.inspect import lora_targets
    from retrograd.trainable.lora import linear_modules, resolve_targets

    m = load(tiny_model(name))
    names = list(linear_modules(m.decoder))
    covered = set()
    for _, pattern, count, _ in lora_targets(m.gguf, m.config):
        chosen = resolve_targets(names, [pattern], ())
        assert len(chosen) == count, pattern
        covered.update(chosen)
    assert covered == set(names)
    auto = resolve_targets(names, ["auto"], m.config.arch.lora_targets_auto)
    assert {n.split(".")[-1] for n in auto} >= {"ssm_in", "ssm_out"}
