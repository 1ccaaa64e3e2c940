"""How a group's answers are put to the judge and how verdicts become scores (formats §3.3).

Pure arithmetic on member indices: the pairwise schedule, win rates and Bradley-Terry
strengths, the chunk plan with its anchor, and the rank correlations of `judge eval` (§3.6).
Nothing here renders prompts or speaks to the judge. Every score returned is in [0, 1].

Departures from the textbook:
- Bradley-Terry counts a tie as half a win for each side and, by default, adds one virtual
  tie of each member against a reference of strength 1, so a member that won (or lost) every
  comparison keeps a finite strength; `prior=0` gives the plain maximum-likelihood fit.
- Strengths are projected to [0, 1] as the expected win rate against the rest of the group,
  p_i / (p_i + p_j) averaged over j, so both aggregations speak the same unit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Outcome = tuple[int, int, str]  # (member shown as "a", member shown as "b", "a" | "b" | "tie")


def pair_schedule(n: int, max_pairs: int | None = None) -> list[tuple[int, int]]:
    """The pairs compared in a group of `n`: the ring (0,1), (1,2), ..., (n-1,0) first, so every
    member is compared twice, then the remaining pairs lexicographically. `max_pairs` below `n`
    is raised to `n`; raising it only appends pairs."""
    if n < 2:
        return []
    ring = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)]
    seen = {frozenset(p) for p in ring}
    rest = [(i, j) for i in range(n) for j in range(i + 1, n) if frozenset((i, j)) not in seen]
    pairs = ring + rest
    if max_pairs is None:
        return pairs
    return pairs[: max(max_pairs, n)]


def _wins(n: int, outcomes: Sequence[Outcome]) -> tuple[np.ndarray, np.ndarray]:
    """Wins per member (a tie is half a win each) and games per pair, as (n,) and (n, n)."""
    wins = np.zeros(n)
    games = np.zeros((n, n))
    for i, j, winner in outcomes:
        if i == j or not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"pair ({i}, {j}) is not two members of a group of {n}")
        if winner not in ("a", "b", "tie"):
            raise ValueError(f'winner must be "a", "b" or "tie", got {winner!r}')
        wins[i] += {"a": 1.0, "b": 0.0, "tie": 0.5}[winner]
        wins[j] += {"a": 0.0, "b": 1.0, "tie": 0.5}[winner]
        games[i, j] += 1.0
        games[j, i] += 1.0
    return wins, games


def win_rates(n: int, outcomes: Sequence[Outcome]) -> list[float]:
    """Each member's share of its comparisons won, a tie counting half; 0.5 when it was never
    compared."""
    wins, games = _wins(n, outcomes)
    played = games.sum(axis=1)
    return [float(w / g) if g else 0.5 for w, g in zip(wins, played, strict=True)]


def bradley_terry(n: int, outcomes: Sequence[Outcome], prior: float = 1.0) -> list[float]:
    """Bradley-Terry strengths, projected to [0, 1] as each member's expected win rate against
    the others (see the module docstring for `prior`)."""
    wins, games = _wins(n, outcomes)
    if n < 2:
        return [0.5] * n
    p = _fit_newton(wins, games, prior) if prior > 0 else _fit_mm(wins, games)
    return _expected_win_rates(p)


def _fit_newton(wins: np.ndarray, games: np.ndarray, prior: float) -> np.ndarray:
    """Newton's method on log-strengths; the virtual ties make the log-likelihood strictly
    concave, so it converges in a few steps where Hunter's MM needs thousands."""
    theta = np.zeros(len(wins))
    wins = wins + prior / 2  # half of each virtual tie is a win against the reference

    def loglik(t: np.ndarray) -> float:
        pair = np.logaddexp(t[:, None], t[None, :])  # (n, n)
        return float(wins @ t - (games * pair).sum() / 2 - prior * np.logaddexp(t, 0.0).sum())

    for _ in range(100):
        s = 1.0 / (1.0 + np.exp(theta[None, :] - theta[:, None]))  # (n, n) P(i beats j)
        r = 1.0 / (1.0 + np.exp(-theta))  # (n,) P(i beats the reference)
        grad = wins - (games * s).sum(axis=1) - prior * r
        w = games * s * (1 - s)
        hess = w - np.diag(w.sum(axis=1) + prior * r * (1 - r))  # negative definite
        step = np.linalg.solve(hess, -grad)
        base, scale = loglik(theta), 1.0
        while loglik(theta + scale * step) < base and scale > 1e-6:
            scale /= 2  # backtrack: a full step overshoots when strengths are far apart
        theta = theta + scale * step
        if np.max(np.abs(scale * step)) < 1e-12:
            break
    return np.exp(theta)


def _fit_mm(wins: np.ndarray, games: np.ndarray) -> np.ndarray:
    """Hunter's MM iteration for the plain maximum-likelihood fit (prior = 0). Slow to
    converge; a member that won or lost everything drifts to 0 or infinity as the MLE does."""
    n = len(wins)
    p = np.ones(n)
    for _ in range(10_000):
        with np.errstate(divide="ignore", invalid="ignore"):
            pair = np.where(games > 0, games / (p[:, None] + p[None, :]), 0.0)  # (n, n)
        denom = pair.sum(axis=1)
        new = np.where(denom > 0, wins / np.where(denom > 0, denom, 1.0), p)
        new = new / new.mean()  # no reference fixes the scale: hold the mean at 1
        change = np.max(np.abs(new - p) / np.maximum(p, 1e-300))
        p = new
        if change < 1e-13:
            break
    return p


def _expected_win_rates(p: np.ndarray) -> list[float]:
    """Mean over j != i of p_i / (p_i + p_j); 0.5 for a pair of zero strengths or n = 1."""
    n = len(p)
    if n < 2:
        return [0.5] * n
    total = p[:, None] + p[None, :]  # (n, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = np.where(total > 0, p[:, None] / total, 0.5)
    np.fill_diagonal(rates, 0.0)
    return [float(r) for r in rates.sum(axis=1) / (n - 1)]


# --- chunks ----------------------------------------------------------------------------------


def chunk_plan(n: int, per_chunk: int, anchor: bool) -> list[list[int]]:
    """Members 0..n-1 split into listwise requests of at most `per_chunk`, sizes as even as
    possible. With `anchor`, member 0 opens every chunk so `merge_anchored` can align scales."""
    if n <= per_chunk:
        return [list(range(n))]
    if not anchor:
        if per_chunk < 1:
            raise ValueError(f"a chunk holds at least 1 member, got {per_chunk}")
        return [list(part) for part in _even(range(n), math.ceil(n / per_chunk))]
    if per_chunk < 2:
        raise ValueError(f"an anchored chunk holds at least 2 members, got {per_chunk}")
    others = range(1, n)
    return [[0, *part] for part in _even(others, math.ceil((n - 1) / (per_chunk - 1)))]


def _even(items: range, parts: int) -> list[range]:
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def merge_anchored(
    chunks: Sequence[Sequence[int]], scores: Sequence[Mapping[int, float] | Sequence[float]]
) -> list[float]:
    """One score per member from per-chunk scores (a mapping member -> score, or a list in the
    chunk's order). When every chunk opens with the same member (the anchor), each chunk is
    shifted so the anchor scores its mean over the chunks; results are clipped to [0, 1]."""
    per_chunk = [_by_member(c, s) for c, s in zip(chunks, scores, strict=True)]
    members = sorted({m for c in chunks for m in c})
    if members != list(range(len(members))):
        raise ValueError("the chunks do not cover the members 0..n-1")
    anchored = len(chunks) > 1 and all(c and c[0] == chunks[0][0] for c in chunks)
    shifts = [0.0] * len(chunks)
    if anchored:
        a = chunks[0][0]
        level = sum(s[a] for s in per_chunk) / len(per_chunk)
        shifts = [level - s[a] for s in per_chunk]
    merged: dict[int, float] = {}
    for s, shift in zip(per_chunk, shifts, strict=True):
        for member, score in s.items():
            merged.setdefault(member, score + shift)  # the anchor keeps its common level
    return [min(max(merged[m], 0.0), 1.0) for m in members]


def _by_member(
    chunk: Sequence[int], scores: Mapping[int, float] | Sequence[float]
) -> dict[int, float]:
    if isinstance(scores, Mapping):
        if set(scores) != set(chunk):
            raise ValueError(f"chunk {list(chunk)} scored members {sorted(scores)}")
        return dict(scores)
    if len(scores) != len(chunk):
        raise ValueError(f"chunk {list(chunk)} has {len(scores)} scores")
    return dict(zip(chunk, scores, strict=True))


# --- rank correlations (judge eval) ----------------------------------------------------------


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either ranking corrected), as scipy.stats.kendalltau; NaN when
    either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"rankings of {len(x)} and {len(y)} items")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue  # tied in both: counts in neither correction
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else math.nan


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, tied values sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda k: values[k])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        stop = start
        while stop + 1 < len(order) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        for k in order[start : stop + 1]:
            ranks[k] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of mean ranks, as scipy.stats.spearmanr; NaN
    when either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"rankings of {len(x)} and {len(y)} items")
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx) if rx else 0.0, sum(ry) / len(ry) if ry else 0.0
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else math.nan
