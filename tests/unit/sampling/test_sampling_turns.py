"""Multi-turn lockstep decoding: kept keys and values give the answers a fresh prefill gives."""

from __future__ import annotations

import pytest
import torch

from retrograd.sampling import Sampler, SampleRequest, SamplingParams
from retrograd.sampling.turns import Thread, TurnDecoder

NO_EOG = frozenset()
OPENING = [1, 300, 301, 17, 260, 400, 401, 402, 5]
OBSERVATIONS = [[7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


def run_turns(sampler, keep_kv, temperature, budgets_by_turn):
    """Three members, three turns each, observations of different lengths between turns; the
    second member stops one turn early. -> per member, the (ids, logprobs) of each turn."""
    dec = TurnDecoder(sampler, keep_kv=keep_kv)
    threads = [Thread(list(OPENING), torch.Generator().manual_seed(10 + j)) for j in range(3)]
    out = [[] for _ in threads]
    active = [0, 1, 2]
    for turn, budgets in enumerate(budgets_by_turn):
        if turn:
            for j in active:
                threads[j].seq += OBSERVATIONS[(turn + j) % 3]
        got = dec.turn(
            [threads[j] for j in active], [budgets[j] for j in active], temperature, 1.0, NO_EOG
        )
        for j, c in zip(active, got, strict=True):
            out[j].append(c)
            threads[j].seq += list(c.ids)
        if turn == 1:
            active = [0, 2]
    return out, dec, threads


@pytest.mark.parametrize(
    ("name", "fast", "temperature"),
    [("gemma3", False, 0.9), ("gemma3", True, 0.0), ("llama3", False, 1.0)],
)
def test_kept_keys_and_values_sample_what_a_fresh_prefill_samples(models, name, fast, temperature):
    """gemma3: a sliding window of 8 slots, crossed by the later turns."""
    m = models(name)
    s = Sampler(m.decoder, m.tokenizer, fast=fast)
    budgets = [[6, 3, 9], [4, 8, 2], [7, 1, 5]]
    kept, dec, threads = run_turns(s, True, temperature, budgets)
    fresh, dec0, threads0 = run_turns(s, False, temperature, budgets)
    for a, b in zip(kept, fresh, strict=True):
        assert [c.ids for c in a] == [c.ids for c in b]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-3, rtol=2e-3
            )
    assert [t.seq for t in threads] == [t.seq for t in threads0]
    assert dec.reused > 0 and dec0.reused == 0
    assert dec.prefilled < dec0.prefilled
    # turn 0 prefills the shared opening once, for three members
    assert dec0.prefilled >= len(OPENING) and dec.reused + dec.prefilled >= len(OPENING)


@pytest.mark.parametrize("name", ["gemma3", "lfm2"])
def test_a_small_generation_batch_samples_what_the_default_samples(models, name):
    """generation_batch = 2: every turn's prefill (the opening, then the kept threads' new
    tokens, or lfm2's whole sequences) in passes of two positions; the same turns."""
    m = models(name)
    budgets = [[6, 3, 9], [4, 8, 2], [7, 1, 5]]
    default, _, threads = run_turns(Sampler(m.decoder, m.tokenizer, fast=False), True, 0.9, budgets)
    small = Sampler(m.decoder, m.tokenizer, fast=False, generation_batch=2)
    cut, dec, threads2 = run_turns(small, True, 0.9, budgets)
    assert [[c.ids for c in a] for a in default] == [[c.ids for c in b] for b in cut]
    for a, b in zip(default, cut, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4
            )
    assert [t.seq for t in threads] == [t.seq for t in threads2]
    assert dec.prefilled > 0


def test_a_recurrent_family_prefills_whole_sequences_and_samples_the_same(models):
    """lfm2 keeps convolution states, which cannot recompute tokens as kept keys do: every
    turn prefills whole sequences, whatever the prefix-cache setting."""
    m = models("lfm2")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    budgets = [[6, 3, 9], [4, 8, 2]]
    kept, dec, threads = run_turns(s, True, 0.9, budgets)
    fresh, _, threads0 = run_turns(s, False, 0.9, budgets)
    assert [[c.ids for c in a] for a in kept] == [[c.ids for c in b] for b in fresh]
    assert dec.reused == 0 and not dec.keep_kv


@pytest.mark.parametrize("name", ["gemma3", "lfm2", "qwen35"])
def test_a_thread_continued_equals_its_whole_sequence_prefilled_alone(models, name):
    """Greedy: the third turn of a kept thread equals generating after its whole sequence
    in one ordinary batch."""
    m = models(name)
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    out, _, threads = run_turns(s, True, 0.0, [[6, 3, 9], [4, 8, 2], [7, 1, 5]])
    seq = threads[0].seq[: len(threads[0].seq) - len(out[0][2].ids)]
    req = SampleRequest(tuple(seq), SamplingParams(0.0, 1.0, 7, stop_ids=NO_EOG))
    [[ref]] = s.generate([req])
    assert ref.ids == out[0][2].ids
    torch.testing.assert_close(
        torch.tensor(ref.logprobs), torch.tensor(out[0][2].logprobs), atol=1e-3, rtol=1e-3
    )


def test_a_stop_token_ends_a_row_and_the_rest_go_on(models):
    m = models("gemma3")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    dec = TurnDecoder(s, keep_kv=True)
    threads = [Thread(list(OPENING), torch.Generator().manual_seed(j)) for j in range(4)]
    # greedy first tokens tell which id to stop on: the first member's first token
    [probe] = dec.turn([Thread(list(OPENING), torch.Generator())], [1], 0.0, 1.0, NO_EOG)
    stop = frozenset({probe.ids[0]})
    got = dec.turn(threads, [5, 5, 5, 5], 0.0, 1.0, stop)
    for c in got:  # greedy and identical prompts: every member stops on its first token
        assert c.ids == probe.ids and c.finish_reason == "stop"
    for t in threads:
        assert t.n_kv == len(OPENING)  # the stop token was never fed
