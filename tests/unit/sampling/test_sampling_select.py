"""Token selection: host (float64 oracle) and device sampling draw from the same distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrograd.sampling.select import (
    greedy_device,
    nucleus_above,
    nucleus_from_candidates,
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


def draw(fn, logits, temperature, top_p, fast=False, n=N):
    row = torch.as_tensor(logits, dtype=torch.float32)[None].expand(n, -1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = torch.full((n,), temperature)
    p = torch.full((n,), top_p)
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
    tokens = draw(select_device, logits.numpy(), 1.0, 0.9, fast=True, n=2000)
    assert tokens.max() >= 256
    assert (np.bincount(tokens, minlength=1000)[900:] == 0).all()  # stable order: ids < 900
    assert (tokens == draw(select_device, logits.numpy(), 1.0, 0.9, n=2000)).all()


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


# -- the top candidates against the full sort ---------------------------------------------------

TEMPERATURES = (0.3, 0.7, 1.0, 1.6)
TOP_PS = (0.05, 0.5, 0.9, 0.95, 0.999, 0.99999)  # the last: beyond a histogram's reach
# edges of [0, 1): 0, the smallest draws, a half, and draws that round to 1 in float32
EDGE_U = (0.0, 1e-12, 0.5, 1 - 1e-9, 1 - 2**-53)


def shapes(V: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Logits rows (V,) of the kinds a nucleus meets: where the candidates decide, where they
    do not (flat, heavy tails), and ties everywhere that topk may order unlike a stable sort."""
    ids = torch.randperm(V, generator=gen)  # tied or top tokens at scattered ids
    noise = torch.randn(V, generator=gen)
    peaked = noise * 2
    peaked[ids[:20]] += 15  # a language model's few likely tokens
    zipf = torch.empty(V)
    zipf[ids] = -1.1 * torch.log(torch.arange(1, V + 1).float())  # mass spread past 256
    tied_top = noise.clone()
    tied_top[ids[:7]] = 9.0  # seven tokens share the top, ids in no order
    boundary = noise.clone()
    boundary[ids[:100]] = 9.0 + noise[:100]
    boundary[ids[100:1100]] = 6.0  # a tied block across the 256th place
    masked = torch.full((V,), float("-inf"))  # a grammar's restriction: 300 tokens allowed
    masked[ids[:300]] = noise[:300] * 3
    one = noise.clone()
    one[ids[0]] = 200.0  # every other probability underflows to 0
    return {
        "peaked": peaked,
        "zipf": zipf,
        "flat": torch.zeros(V),
        "near flat": noise * 0.05,
        "quantized": torch.round(noise * 3),  # ties at every level
        "tied top": tied_top,
        "tied boundary": boundary,
        "masked": masked,
        "one": one,
    }


def batch(V: int, draws: int, seed: int, temperatures=TEMPERATURES, top_ps=TOP_PS):
    """Every shape x temperature x top_p, `draws` uniform numbers each (every third an edge
    of [0, 1)), with top_p = 1 rows among them, half of those greedy -> logits (B, V),
    temperature, top_p, u (B,)."""
    gen = torch.Generator().manual_seed(seed)
    rows, temps, tops, us = [], [], [], []
    for row in shapes(V, gen).values():
        for t in temperatures:
            for p in (*top_ps, 1.0):
                for _ in range(draws):
                    n = len(rows)
                    u = torch.rand((), generator=gen, dtype=torch.float64).item()
                    rows.append(row)
                    temps.append(0.0 if p == 1 and n % 2 else t)
                    tops.append(p)
                    us.append(EDGE_U[n // 3 % len(EDGE_U)] if n % 3 == 0 else u)
    return (
        torch.stack(rows),
        torch.tensor(temps),
        torch.tensor(tops),
        torch.tensor(us, dtype=torch.float64),
    )


@pytest.fixture
def tiers(monkeypatch):
    """Counts of how nucleus rows were decided: by the 256 candidates, by the tokens above a
    power of two, or by sorting the row (neither could)."""
    from retrograd.sampling import select

    seen = {"candidates": 0, "above": 0, "sorted": 0}
    candidates, above = select.nucleus_from_candidates, select.nucleus_above

    def by_candidates(*a):
        ids, sure = candidates(*a)
        seen["candidates"] += int(sure.sum())
        return ids, sure

    def by_above(*a):
        token = above(*a)
        seen["above" if token is not None else "sorted"] += 1
        return token

    monkeypatch.setattr(select, "nucleus_from_candidates", by_candidates)
    monkeypatch.setattr(select, "nucleus_above", by_above)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("V", "draws", "temperatures", "top_ps"),
    [(4096, 8, TEMPERATURES, TOP_PS), (262144, 2, (1.0,), (0.5, 0.95, 0.99999))],
)
def test_the_top_candidates_choose_what_the_full_sort_chooses(
    dtype, V, draws, temperatures, top_ps, tiers
):
    """Same logits, settings and uniform number: the same token whether the nucleus is found
    among the top candidates, among the tokens above a power of two, or by sorting the whole
    vocabulary, row by row, in a mixed batch and in a batch of nucleus rows alone; each way
    decides some rows. V 262144 is Gemma 3's vocabulary."""
    logits, t, p, u = batch(V, draws, V, temperatures, top_ps)
    logits = logits.to(dtype)
    fast = select_device(logits, t, p, u, fast_top_p=True)
    assert all(tiers.values()), tiers
    full = select_device(logits, t, p, u, fast_top_p=False)
    assert torch.equal(fast, full), f"{(fast != full).sum()} of {len(fast)} rows differ"
    nucleus = (t > 0) & (p < 1)
    alone = select_device(logits[nucleus], t[nucleus], p[nucleus], u[nucleus])
    assert torch.equal(alone, full[nucleus])


def test_the_candidates_decide_where_they_can_and_only_there():
    """Where the 256 candidates are certain of the full sort's token (`sure`), where the tokens
    above a power of two are, and where the row must be sorted (the same token each way, by
    the test above)."""
    rows = shapes(4096, torch.Generator().manual_seed(7))

    def decide(shape: str, top_p: float, u: float) -> tuple[int, bool, bool]:
        """-> (the full sort's token, decided by the candidates, by the tokens above)"""
        logits = rows[shape][None]  # (1, V)
        p, draw = torch.tensor([top_p]), torch.tensor([u], dtype=torch.float64)
        probs = torch.softmax(logits, -1)
        ids, sure = nucleus_from_candidates(probs, p, draw)
        above = nucleus_above(probs[0], p[0], draw[0])
        full = int(select_device(logits, torch.ones(1), p, draw, fast_top_p=False)[0])
        assert not sure or ids[0] == full
        assert above is None or above == full
        return full, bool(sure), above is not None

    assert decide("peaked", 0.95, 0.3)[1:] == (True, True)
    assert decide("peaked", 0.999, 0.99)[1]
    assert decide("zipf", 0.95, 0.3)[1:] == (False, True)  # wider than the candidates
    assert decide("zipf", 0.2, 0.3)[1]
    # every token tied: the tie leaves the candidates; the tokens above are all of them
    assert decide("flat", 0.5, 0.3)[1:] == (False, True)
    tied = torch.nonzero(rows["tied top"] == 9.0)[:, 0]  # (7,) ids in increasing order
    assert decide("tied top", 0.5, 0.0)[:2] == (int(tied[0]), True)  # ties in id order
    assert decide("tied top", 0.5, 1 - 2**-53)[0] in tied.tolist()
    # 100 likely tokens (71% of the mass), then 1000 tied: a draw among the tied ones leaves
    # the candidates, not the tokens above a power of two (no tie crosses one)
    assert decide("tied boundary", 0.73, 0.0)[1]
    assert decide("tied boundary", 0.73, 0.999)[1:] == (False, True)
    assert decide("tied boundary", 0.99, 0.0)[1:] == (False, True)  # wider than 256
    assert decide("one", 0.9, 0.5)[:2] == (int(rows["one"].argmax()), True)  # the rest: 0
    assert decide("zipf", 0.99999, 0.5)[1:] == (False, False)  # within the histogram's margin
