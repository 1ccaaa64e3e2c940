"""The judge's strategies (formats §3.3) against hand-computed cases, Bradley-Terry against a
likelihood maximised by scipy.optimize, and the rank correlations against scipy.stats."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy import optimize, stats

from retrograd.rewards.ruler.strategy import (
    bradley_terry,
    chunk_plan,
    kendall_tau,
    merge_anchored,
    pair_schedule,
    spearman_rho,
    win_rates,
)

# --- pair schedule -------------------------------------------------------------------------


def test_pair_schedule_is_the_ring_then_the_rest_lexicographically():
    assert pair_schedule(4) == [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (1, 3)]
    assert pair_schedule(5, 7) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 2), (0, 3)]
    assert pair_schedule(3) == [(0, 1), (1, 2), (2, 0)]
    assert pair_schedule(2) == [(0, 1)]  # the ring of two is one pair
    assert pair_schedule(1) == [] and pair_schedule(0) == []


def test_pair_schedule_raises_max_pairs_to_the_group_and_only_appends():
    assert pair_schedule(6, 1) == pair_schedule(6, 6) == pair_schedule(6)[:6]
    assert pair_schedule(2, 1) == [(0, 1)]
    full = pair_schedule(9)
    assert len(full) == 9 * 8 // 2
    assert len({frozenset(p) for p in full}) == len(full)  # every pair once
    for k in range(1, len(full) + 3):
        assert pair_schedule(9, k) == full[: max(k, 9)]
    ring = pair_schedule(9, 9)
    assert all(sum(m in p for p in ring) == 2 for m in range(9))  # each member twice


# --- aggregation ---------------------------------------------------------------------------

# Strengths 4, 2, 1 fit these counts exactly: P(0>1) = 2/3, P(1>2) = 2/3, P(0>2) = 4/5, and
# each member's wins equal their expectation (6, 3, 2). Outcomes shown both ways round.
EXACT = (
    [(0, 1, "a")] * 2
    + [(1, 0, "a")]
    + [(1, 2, "a"), (2, 1, "b"), (1, 2, "b")]
    + [(0, 2, "a")] * 3
    + [(2, 0, "b"), (2, 0, "a")]
)


def test_win_rates_by_hand():
    # 0 won 6 of 8, 1 won 3 of 6, 2 won 2 of 8.
    assert win_rates(3, EXACT) == pytest.approx([6 / 8, 3 / 6, 2 / 8])
    # A tie is half a win for each side; a member never compared gets 0.5.
    assert win_rates(3, [(0, 1, "tie"), (0, 1, "a")]) == [0.75, 0.25, 0.5]


def test_bradley_terry_maximum_likelihood_by_hand():
    # Expected win rate against the others: (2/3 + 4/5) / 2, (1/3 + 2/3) / 2, (1/3 + 1/5) / 2.
    assert bradley_terry(3, EXACT, prior=0) == pytest.approx([11 / 15, 1 / 2, 4 / 15], abs=1e-9)
    # Two members, 2 wins to 1: strengths 2 : 1.
    two = [(0, 1, "a"), (1, 0, "b"), (0, 1, "b")]
    assert bradley_terry(2, two, prior=0) == pytest.approx([2 / 3, 1 / 3], abs=1e-9)


def _penalised_nll(theta, n, outcomes, prior):
    """The negative log-likelihood bradley_terry maximises, written out independently: each
    comparison, ties as half a win each, plus `prior` virtual ties against strength 1."""
    nll = 0.0
    for i, j, w in outcomes:
        share = {"a": 1.0, "b": 0.0, "tie": 0.5}[w]
        log_pi = theta[i] - np.logaddexp(theta[i], theta[j])
        log_pj = theta[j] - np.logaddexp(theta[i], theta[j])
        nll -= share * log_pi + (1 - share) * log_pj
    for i in range(n):  # half a win and half a loss against a reference of log-strength 0
        log_win, log_loss = theta[i] - np.logaddexp(theta[i], 0), -np.logaddexp(theta[i], 0)
        nll -= prior * 0.5 * (log_win + log_loss)
    return nll


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prior", [1.0, 0.25])
def test_bradley_terry_matches_scipy_maximising_the_same_likelihood(seed, prior):
    rng = random.Random(seed)
    n = 6
    choices = {True: ["a", "a", "b"], False: ["a", "b", "tie"]}
    outcomes = [(i, j, rng.choice(choices[i < j])) for i, j in pair_schedule(n, 10)]
    res = optimize.minimize(
        _penalised_nll, np.zeros(n), args=(n, outcomes, prior), method="BFGS", tol=1e-12
    )
    p = np.exp(res.x)
    expected = [np.mean([p[i] / (p[i] + p[j]) for j in range(n) if j != i]) for i in range(n)]
    assert bradley_terry(n, outcomes, prior=prior) == pytest.approx(expected, abs=1e-5)


def test_bradley_terry_stays_finite_when_one_member_wins_everything():
    sweep = [(i, j, "a" if i < j else "b") for i, j in pair_schedule(5)]
    scores = bradley_terry(5, sweep)
    assert all(0 < s < 1 for s in scores)
    assert scores == sorted(scores, reverse=True)  # 0 beat everyone, 4 lost to everyone
    assert scores[2] == pytest.approx(0.5)  # the middle of a symmetric order


def test_bradley_terry_ranks_by_transitivity_where_win_rates_cannot():
    # Only the ring of a strict order 0 > 1 > ... > 7 is compared: each middle member won one
    # and lost one, so win rates tie them, while the strengths still order them.
    ring = [(i, j, "a" if i < j else "b") for i, j in pair_schedule(8, 8)]
    assert win_rates(8, ring) == [1.0] + [0.5] * 6 + [0.0]
    scores = bradley_terry(8, ring)
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 8
    assert sum(scores) == pytest.approx(8 / 2)  # expected win rates of all pairs sum to n / 2


def test_bradley_terry_of_a_cycle_or_ties_is_even():
    cycle = [(0, 1, "a"), (1, 2, "a"), (2, 0, "a")]
    assert bradley_terry(3, cycle) == pytest.approx([0.5] * 3)
    assert bradley_terry(3, cycle, prior=0) == pytest.approx([0.5] * 3)
    assert bradley_terry(4, [(i, j, "tie") for i, j in pair_schedule(4)]) == pytest.approx(
        [0.5] * 4
    )
    assert bradley_terry(1, []) == [0.5] and bradley_terry(0, []) == []


@pytest.mark.parametrize("bad", [[(0, 0, "a")], [(0, 3, "a")], [(0, 1, "c")]])
def test_aggregations_refuse_bad_outcomes(bad):
    with pytest.raises(ValueError):
        win_rates(3, bad)
    with pytest.raises(ValueError):
        bradley_terry(3, bad)


# --- chunks --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, per_chunk", [(10, 4), (9, 3), (17, 5), (5, 5), (3, 8), (64, 7)])
def test_chunk_plan_with_an_anchor(n, per_chunk):
    chunks = chunk_plan(n, per_chunk, anchor=True)
    assert all(c[0] == 0 and len(c) <= per_chunk for c in chunks)
    others = sorted(m for c in chunks for m in c[1:])
    assert others == list(range(1, n))  # every other member exactly once
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1  # as even as possible
    assert len(chunks) == max(1, math.ceil((n - 1) / (per_chunk - 1)) if n > per_chunk else 1)


def test_chunk_plan_by_hand():
    assert chunk_plan(10, 4, anchor=True) == [[0, 1, 2, 3], [0, 4, 5, 6], [0, 7, 8, 9]]
    assert chunk_plan(10, 4, anchor=False) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert chunk_plan(4, 4, anchor=True) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        chunk_plan(5, 1, anchor=True)  # no room beside the anchor


def test_merge_anchored_shifts_each_chunk_to_the_anchors_mean_by_hand():
    chunks = [[0, 1, 2], [0, 3, 4]]
    # The anchor scored 0.5 and 0.3: level 0.4, so chunk 0 moves -0.1 and chunk 1 +0.1.
    scores = [{0: 0.5, 1: 0.9, 2: 0.1}, {0: 0.3, 3: 0.6, 4: 0.2}]
    assert merge_anchored(chunks, scores) == pytest.approx([0.4, 0.8, 0.0, 0.7, 0.3])
    # The same in each chunk's order, and a shift past 1 is clipped.
    assert merge_anchored(chunks, [[0.5, 0.9, 0.1], [0.3, 0.6, 0.2]]) == pytest.approx(
        [0.4, 0.8, 0.0, 0.7, 0.3]
    )
    assert merge_anchored([[0, 1], [0, 2]], [[0.2, 1.0], [0.6, 0.1]])[1] == 1.0


def test_merge_without_an_anchor_places_the_scores():
    chunks = chunk_plan(5, 2, anchor=False)
    assert merge_anchored(chunks, [[0.1, 0.2], [0.3, 0.4], [0.5]]) == [0.1, 0.2, 0.3, 0.4, 0.5]
    with pytest.raises(ValueError):
        merge_anchored([[0, 1], [3]], [[0.1, 0.2], [0.3]])  # member 2 missing
    with pytest.raises(ValueError):
        merge_anchored([[0, 1]], [{0: 0.1, 5: 0.2}])


# --- rank correlations ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_rank_correlations_match_scipy_with_ties(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 25)
    x = [rng.randint(0, 5) for _ in range(n)]  # many ties
    y = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)]
    for a, b in ((x, y), (x, [rng.random() for _ in range(n)])):
        if len(set(a)) > 1 and len(set(b)) > 1:
            assert kendall_tau(a, b) == pytest.approx(stats.kendalltau(a, b).statistic)
            assert spearman_rho(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)


def test_rank_correlations_by_hand_and_when_undefined():
    assert kendall_tau([1, 2, 3], [1, 2, 3]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert spearman_rho([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(0.8)  # 1 - 6*2/60
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman_rho([1, 2, 3], [5, 5, 5]))
    with pytest.raises(ValueError):
        kendall_tau([1, 2], [1])
