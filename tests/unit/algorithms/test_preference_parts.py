"""The preference loop's parts that need no model: how an epoch cuts into steps and passes,
the reference scores' file, and the logps_drop_warn rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from retrograd.algorithms.pairs import (
    FIRST,
    REFERENCE,
    PairStats,
    Scores,
    decode_scores,
    encode_scores,
    pieces_of,
    shared_tokens,
)
from retrograd.algorithms.preference import drop_warning, steps_of
from retrograd.data.pairs import TokenPair
from retrograd.errors import CheckpointError


def tp(index: int, prompt: int, chosen: int, rejected: int) -> TokenPair:
    return TokenPair(
        f"p.jsonl:{index + 1}",
        index,
        tuple(range(prompt)),
        tuple(range(chosen)),
        (1,) * chosen,
        tuple(range(rejected)),
        (1,) * rejected,
    )


def cfg(ctx: int = 100, per: int | None = None):
    return SimpleNamespace(
        preference=SimpleNamespace(pairs_per_step=per), training=SimpleNamespace(ctx=ctx)
    )


def test_steps_fill_the_context_window_by_default():
    pairs = [tp(i, 20, 10, 10) for i in range(7)]  # 40 tokens each: two to a window of 100
    order = np.array([6, 5, 4, 3, 2, 1, 0])
    assert steps_of(pairs, order, cfg(100)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert steps_of(pairs, order, cfg(30)) == [(i, i + 1) for i in range(7)]  # one at least


def test_pairs_per_step_takes_that_many_whatever_their_tokens():
    pairs = [tp(i, 20, 10, 10) for i in range(7)]
    assert steps_of(pairs, np.arange(7), cfg(50, per=3)) == [(0, 3), (3, 6), (6, 7)]


def test_passes_share_the_prompt_where_the_pair_fits_and_go_as_rows_otherwise():
    small, big = tp(0, 10, 3, 5), tp(1, 30, 20, 4)
    assert shared_tokens(small) == 20 and shared_tokens(big) == 70
    pairs = [small, big, tp(2, 10, 5, 5), tp(3, 30, 20, 4)]
    pieces = pieces_of(pairs, [0, 1, 2, 3], 64, "auto")
    assert [(p.pairs, p.shared) for p in pieces] == [
        ((0,), True),
        ((2,), True),
        ((1,), False),  # rows 50 wide: 100 tokens, over 64, still a pass of its own
        ((3,), False),
    ]
    off = pieces_of(pairs, [0, 2], 64, "off")
    assert [(p.pairs, p.shared) for p in off] == [((0, 2), False)]  # 4 rows 15 wide
    assert all(p.shared for p in pieces_of(pairs, [0, 1], 8, "max"))


def test_scores_round_trip_with_their_magic():
    a = Scores(np.array([-1.5, -2.0], np.float32), np.array([-3.0, -4.25], np.float32))
    b = Scores(np.zeros(0, np.float32), np.zeros(0, np.float32))
    data = encode_scores(REFERENCE, [a, b])
    assert data[:8] == b"RGPREFRF"
    x, y = decode_scores(REFERENCE, data, "ck")
    np.testing.assert_array_equal(x.chosen, a.chosen)
    np.testing.assert_array_equal(x.rejected, a.rejected)
    assert len(y.chosen) == 0
    with pytest.raises(CheckpointError, match="RGPREFRF"):
        decode_scores(REFERENCE, encode_scores(FIRST, [a]), "ck")


def stats(members, chosen, rejected) -> PairStats:
    return PairStats(
        members,
        {"chosen_logps": np.array(chosen, float), "rejected_logps": np.array(rejected, float)},
    )


def test_the_drop_warning_needs_both_answers_to_fall():
    first = Scores(np.array([-10.0, -10.0, np.nan]), np.array([-12.0, -12.0, np.nan]))
    # chosen fell 3 nats, rejected rose: the pairs are learned, no warning
    assert drop_warning(2.0, first, [0, 1], stats([0, 1], [-13, -13], [-11, -11])) is None
    # chosen fell 1.5 nats, rejected too: under the limit
    assert drop_warning(2.0, first, [0, 1], stats([0, 1], [-11.5, -11.5], [-20, -20])) is None
    warning = drop_warning(2.0, first, [0, 1], stats([0, 1], [-13, -12.5], [-20, -20]))
    assert warning is not None and "2.75 nats" in warning and "logps_drop_warn = 2.0" in warning


def test_a_pair_first_scored_now_records_its_first_value():
    first = Scores.unset(2)
    assert drop_warning(0.0, first, [1], stats([1], [-5.0], [-6.0])) is None
    assert first.chosen[1] == -5.0 and first.rejected[1] == -6.0 and np.isnan(first.chosen[0])
