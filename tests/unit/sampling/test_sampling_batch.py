"""The live batch on tiny models: requests join a running batch and leave it, answers keep."""

from __future__ import annotations

import pytest
import torch

import retrograd.sampling.batch as batch_mod
from retrograd.sampling import FINISH_LENGTH, Sampler, SampleRequest, SamplingParams
from retrograd.sampling.batch import LiveBatch

NO_EOG = frozenset()  # tiny random models: never stop early unless a test asks
PROMPT = [1, 300, 301, 17, 260, 400, 401, 402, 5]
SHORT = [1, 90, 91]
LONG = [1, *range(100, 130)]  # wider than the tiny gemma3's sliding window of 8


def req(prompt, **kw) -> SampleRequest:
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("stop_ids", NO_EOG)
    return SampleRequest(tuple(prompt), SamplingParams(**kw))


def run_joining(sampler, mine: SampleRequest, after: int, max_rows: int = 6):
    """`mine` joins a batch that has run `after` steps, beside a request of another length;
    -> its completion, and how many rows were live when it joined."""
    batch = LiveBatch(sampler, max_rows)
    got = {}
    batch.add(req(LONG, temperature=1.0, seed=1, max_new_tokens=30))
    batch.add(req(SHORT, temperature=0, max_new_tokens=5))
    for _ in range(after):
        batch.step()
    live = len(batch.rows)
    batch.add(mine, on_done=lambda answers: got.setdefault("mine", answers[0]))
    batch.add(req([*SHORT, *range(7, 20)], temperature=0.7, top_p=0.8, seed=9, max_new_tokens=40))
    while batch.step():
        pass
    return got["mine"], live


def assert_same_answer(a, b):
    assert a.ids == b.ids and a.text == b.text and a.finish_reason == b.finish_reason
    # rounding differs between batch shapes (products over other row counts, attention over
    # other slot counts): log-probabilities agree to float32 reassociation, not bit for bit
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize(
    ("name", "fast", "sampled"),
    [
        ("gemma3", False, True),
        ("gemma3", True, False),
        ("llama3", True, True),
        ("lfm2", False, True),
        ("lfm2", True, False),
        ("mamba2", False, True),
        ("falcon-h1", True, False),
        ("qwen35", False, True),
        ("qwen3next", True, False),
    ],
)
def test_an_answer_alone_equals_the_answer_joining_a_running_batch(models, name, fast, sampled):
    """fast: the 16-bit cache and fused attention; gemma3: a sliding window of 8 slots; lfm2:
    convolution states that join, move with their rows and leave."""
    m = models(name)
    s = Sampler(m.decoder, m.tokenizer, fast=fast)
    kw = dict(temperature=0.9, seed=3) if sampled else dict(temperature=0)
    mine = req(PROMPT, max_new_tokens=20, **kw)
    [[alone]] = s.generate([mine])
    for after in (2, 7):  # mid-way; after 7 steps the 5-token request has left
        joined, live = run_joining(s, mine, after)
        assert live == (2 if after < 5 else 1)
        assert_same_answer(joined, alone)


def test_slots_move_and_grow_as_rows_come_and_go(models, monkeypatch):
    """Tiny growth steps: the buffers grow, rows move right for a wide joiner and left when
    the common padding is large; every answer stays what it is alone."""
    monkeypatch.setattr(batch_mod, "GROW_MIN", 2)
    monkeypatch.setattr(batch_mod, "REBASE_MIN", 2)
    m = models("gemma3")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    asks = [
        req(SHORT, temperature=0, max_new_tokens=25),
        req(PROMPT, temperature=0.8, seed=4, max_new_tokens=6),
        req(LONG, temperature=0, max_new_tokens=9),
        req([1, 5, 6, 7], temperature=1.0, seed=2, max_new_tokens=14),
    ]
    alone = [s.generate([a])[0][0] for a in asks]
    batch = LiveBatch(s, 3)
    got: dict[int, object] = {}
    capacities, slots = set(), []
    for i, a in enumerate(asks):
        while batch.size + 1 > batch.max_rows:
            batch.step()
        batch.add(a, on_done=lambda answers, i=i: got.setdefault(i, answers[0]))
        for _ in range(2):
            batch.step()
            capacities.add(batch.capacity)
            slots.append(batch.slot)
    while batch.step():
        capacities.add(batch.capacity)
        slots.append(batch.slot)
    assert len(capacities) > 2  # grew more than once
    assert any(b < a for a, b in zip(slots, slots[1:], strict=False))  # moved left at least once
    for i, a in enumerate(alone):
        assert_same_answer(got[i], a)
    assert batch.idle and batch.slot == 0


def test_a_cancelled_request_leaves_and_hears_nothing_more(models):
    m = models("llama3")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    batch = LiveBatch(s, 4)
    texts: list[str] = []
    done = []
    gone = batch.add(req(PROMPT, temperature=0, max_new_tokens=30), lambda _j, d: texts.append(d))
    batch.add(req(SHORT, temperature=0, max_new_tokens=10), on_done=done.append)
    batch.step()
    batch.step()
    heard = len(texts)
    batch.cancel(gone)
    batch.step()
    assert len(batch.rows) == 1 and batch.rows[0].entry is not gone
    while batch.step():
        pass
    assert len(texts) == heard and len(done) == 1
    assert done[0][0].finish_reason == FINISH_LENGTH and len(done[0][0].ids) == 10


def test_the_batch_refuses_more_rows_than_it_holds(models):
    m = models("llama3")
    batch = LiveBatch(Sampler(m.decoder, m.tokenizer, fast=False), 2)
    batch.add(req(PROMPT))
    with pytest.raises(ValueError, match="do not fit"):
        batch.add(SampleRequest(tuple(SHORT), SamplingParams(stop_ids=NO_EOG), n=2))
    with pytest.raises(ValueError, match="empty prompt"):
        batch.add(req([]))
    assert batch.size == 1


def test_a_tiny_temperature_is_greedy(models):
    """softmax(logits / 1e-39) overflows float32: such a row must answer greedily, not NaN."""
    m = models("llama3")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    [[greedy]] = s.generate([req(PROMPT, temperature=0)])
    for t in (1e-39, 1e-30, 1e-6):
        [[tiny]] = s.generate([req(PROMPT, temperature=t, seed=5)])
        assert tiny.ids == greedy.ids and len(tiny.ids) == 12
        assert all(lp <= 0 for lp in tiny.logprobs)
