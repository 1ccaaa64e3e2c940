"""Token selection: host (float64 oracle) and device sampling draw from the same distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrograd.sampling.select import (
    greedy_device,
    select_device,
    select_host,
    token_logprobs_device,
    token_logprobs_host,
)

V, N = 40, 20000


def exact_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The target distribution, written independently of the code under test."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    q = np.zeros_like(p)
    q[kept] = p[kept] / p[kept].sum()
    return q


def draw(fn, logits, temperature, top_p, fast=False):
    row = torch.as_tensor(logits, dtype=torch.float32)[None].expand(N, -1)
    u = torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = torch.full((N,), temperature)
    p = torch.full((N,), top_p)
    return fn(row, t, p, u, fast).numpy()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_host_and_device_sampling_give_the_same_distribution(temperature, top_p):
    logits = np.random.default_rng(1).normal(0, 2, V)
    target = exact_probs(logits, temperature, top_p)
    device = draw(select_device, logits, temperature, top_p)
    host = draw(select_host, logits, temperature, top_p)
    fast = draw(select_device, logits, temperature, top_p, fast=True)
    for tokens in (device, host, fast):
        freq = np.bincount(tokens, minlength=V) / N
        assert 0.5 * np.abs(freq - target).sum() < 0.02  # total variation
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(target))  # never off-nucleus
    # the same uniform numbers pick the same tokens, save for rounding at a boundary
    assert (device == host).mean() > 0.999


def test_fast_top_p_falls_back_when_the_top_candidates_are_not_enough():
    # a flat distribution over 1000 tokens: 256 candidates hold only ~26% of the mass
    logits = torch.zeros(1000)
    tokens = draw(select_device, logits.numpy(), 1.0, 0.9, fast=True)
    assert tokens.max() >= 256
    assert (np.bincount(tokens, minlength=1000)[900:] == 0).all()  # stable order: ids < 900


def test_greedy_rows_ignore_u_and_mix_with_sampled_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0.0, 1.0, 0.0, 0.5])
    p = torch.tensor([1.0, 1.0, 0.3, 0.8])
    u = torch.rand(4, dtype=torch.float64)
    out = select_device(logits, t, p, u)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert torch.equal(out, select_host(logits, t, p, u))


def test_logprobs_device_equal_host_oracle():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(4)) * 5
    t = torch.tensor([0.0, 0.7, 1.0])
    tok = torch.tensor([5, 17, 999])
    dev = token_logprobs_device(logits, t, tok)
    host = token_logprobs_host(logits, t, tok)
    torch.testing.assert_close(dev, host, atol=1e-5, rtol=1e-5)
    ref = torch.log_softmax(logits[0].double(), -1)[5]  # greedy: temperature 1
    assert abs(dev[0].item() - ref.item()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_in_one_kernel_equals_the_general_path(dtype):
    logits = (torch.randn(5, 3000, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    logits[2, 7] = logits[2, 1000] = logits[2].max() + 1  # a tie: the first index wins
    t, p = torch.zeros(5), torch.ones(5)
    tokens, lp = greedy_device(logits)
    assert torch.equal(tokens, select_device(logits, t, p, torch.rand(5, dtype=torch.float64)))
    assert tokens[2] == 7
    torch.testing.assert_close(lp, token_logprobs_host(logits, t, tokens), atol=1e-5, rtol=1e-5)
