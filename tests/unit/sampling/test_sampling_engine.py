"""The sampler on tiny models: cached decoding equals recomputation, batches do not matter."""

from __future__ import annotations

import pytest
import torch

from retrograd.sampling import FINISH_LENGTH, FINISH_STOP, Sampler, SampleRequest, SamplingParams

NO_EOG = frozenset()  # tiny random models: never stop early unless a test asks


def params(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("stop_ids", NO_EOG)
    return SamplingParams(**kw)


def req(prompt, n=1, **kw) -> SampleRequest:
    return SampleRequest(tuple(prompt), params(**kw), n=n)


PROMPT = [1, 300, 301, 17, 260, 400, 401, 402, 5]
SHORT = [1, 90, 91]


@pytest.mark.parametrize("name", ["gemma3", "llama3", "qwen2"])
def test_cached_greedy_decoding_equals_full_recomputation(models, name):
    m = models(name)
    [[c]] = Sampler(m.decoder, m.tokenizer, fast=False).generate([req(PROMPT, temperature=0)])
    seq = PROMPT + list(c.ids)
    full = m.logits(seq)  # (T, V): one pass, no cache
    assert list(c.ids) == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    ref = m.logprobs(seq)[len(PROMPT) - 1 :]
    torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=1e-4)
    assert c.finish_reason == FINISH_LENGTH and len(c.ids) == 12


def test_fast_context_stays_close_to_the_exact_one(models):
    m = models("gemma3")
    sampled = req(PROMPT, temperature=1.0, seed=5)
    [[exact]] = Sampler(m.decoder, m.tokenizer, fast=False).generate([sampled])
    fast = Sampler(m.decoder, m.tokenizer, fast=True)
    assert fast.kv_dtype == torch.float16
    [[quick]] = fast.generate([sampled])
    ref = m.logprobs(PROMPT + list(quick.ids))[len(PROMPT) - 1 :]
    torch.testing.assert_close(torch.tensor(quick.logprobs), ref, atol=2e-2, rtol=2e-2)
    assert len(exact.ids) == len(quick.ids)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("compute", "fast", "kv", "expected"),
    [
        (F32, True, "f16", F16),  # 16 bits: float16 where the compute path has none of its own
        (BF16, True, "f16", BF16),  # the compute dtype: keys kept as computed
        (F32, True, "f32", F32),
        (BF16, True, "f32", F32),
        (F32, False, "f16", F32),  # exact sampling: training's float32, whatever kv_dtype says
        (BF16, False, "f16", F32),
    ],
)
def test_the_cache_is_kv_dtype_under_fast_sampling(compute, fast, kv, expected):
    from retrograd.sampling.engine import cache_dtype

    assert cache_dtype(compute, fast, kv) == expected


def test_a_sampler_builds_its_caches_in_its_kv_dtype(models):
    m = models("gemma3")
    sampler = Sampler(m.decoder, m.tokenizer, fast=True, kv_dtype="f32")
    cache, _, _ = sampler.prefill([PROMPT], 32)
    assert sampler.kv_dtype == F32 and {t.dtype for t in cache.k + cache.v} == {F32}
    with pytest.raises(ValueError, match="kv_dtype = 'bf16': must be one of f16, f32"):
        Sampler(m.decoder, m.tokenizer, kv_dtype="bf16")


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_left_padded_batch_equals_each_prompt_alone(models, name):
    m = models(name)
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    together = s.generate([req(PROMPT, temperature=0), req(SHORT, temperature=0)])
    for prompt, [c] in zip((PROMPT, SHORT), together, strict=True):
        [[alone]] = s.generate([req(prompt, temperature=0)])
        assert c.ids == alone.ids
        torch.testing.assert_close(
            torch.tensor(c.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=1e-4
        )
        assert c.prompt_tokens == len(prompt)


def test_a_fixed_seed_gives_the_same_answer_whatever_the_batch(models):
    m = models("qwen3")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    mine = req(SHORT, n=2, temperature=0.9, top_p=0.95, seed=11)
    [alone] = s.generate([mine])
    crowd = [req(PROMPT, n=3, temperature=1.0, seed=1), mine, req([1, 5, 6, 7, 8], seed=2)]
    in_crowd = s.generate(crowd)[1]
    assert [c.ids for c in alone] == [c.ids for c in in_crowd]
    assert alone[0].ids != alone[1].ids  # two answers, two seeds
    [again] = s.generate([mine])
    assert [c.ids for c in again] == [c.ids for c in alone]


def test_host_and_device_sampling_agree_in_the_engine(models):
    m = models("llama")
    r = [req(PROMPT, n=3, temperature=0.8, top_p=0.9, seed=4)]
    dev = Sampler(m.decoder, m.tokenizer, fast=False).generate(r)
    host = Sampler(
        m.decoder, m.tokenizer, fast=False, device_sampling=False, device_logprobs=False
    ).generate(r)
    assert [c.ids for c in dev[0]] == [c.ids for c in host[0]]
    for a, b in zip(dev[0], host[0], strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4
        )


def test_environment_switches(models, tiny_model, monkeypatch):
    """The sampler's switches come from the compute plan its model was loaded by, which reads
    the environment; an explicit plan or keyword wins."""
    import retrograd
    from retrograd import compute, environ

    monkeypatch.setenv("RETRO_DEVICE_SAMPLING", "0")
    monkeypatch.setenv("RETRO_DEVICE_LOGPROBS", "false")
    monkeypatch.setenv("RETRO_FAST_TOP_P", "off")
    m = retrograd.load(tiny_model("llama"))
    s = Sampler(m.decoder, m.tokenizer)
    assert (s.device_sampling, s.device_logprobs, s.fast_top_p) == (False, False, False)
    assert "host sampling (RETRO_DEVICE_SAMPLING=0)" in m.report.lines()[1]
    monkeypatch.delenv("RETRO_DEVICE_SAMPLING")
    monkeypatch.delenv("RETRO_FAST_TOP_P")
    s = Sampler(m.decoder, m.tokenizer, plan=compute.ComputePlan.of(environ.read()).sampling)
    assert s.device_sampling and s.fast_top_p  # the top candidates first, by default
    assert not s.device_logprobs
    s = Sampler(models("llama").decoder, m.tokenizer, device_logprobs=True)
    assert s.device_logprobs


def test_the_top_candidates_answer_what_the_full_sort_answers(models, monkeypatch):
    """Nucleus answers through the sampler, 8 candidates searched first (a tiny vocabulary
    holds little more than 256) against every row sorted: the same ids and log-probabilities,
    with both ways of choosing taken along the way."""
    from retrograd.sampling import select

    decided = []  # per nucleus row and step: did the candidates decide?
    real = select.nucleus_from_candidates

    def counted(probs, top_p, u, k):
        assert k == 8
        ids, sure = real(probs, top_p, u, k)
        decided.extend(sure.tolist())
        return ids, sure

    monkeypatch.setattr(select, "NUCLEUS_CANDIDATES", 8)
    monkeypatch.setattr(select, "nucleus_from_candidates", counted)
    m = models("qwen3")
    asked = [
        req(PROMPT, n=3, temperature=0.3, top_p=0.5, seed=1, max_new_tokens=16),
        req(SHORT, n=2, temperature=0.7, top_p=0.9, seed=2, max_new_tokens=16),
        req(SHORT, temperature=1.5, top_p=0.99, seed=4, max_new_tokens=16),  # beyond 8
        req(PROMPT, temperature=1.0, seed=3, max_new_tokens=16),  # top_p = 1: no nucleus
    ]
    fast = Sampler(m.decoder, m.tokenizer, fast=False).generate(asked)
    assert True in decided and False in decided
    full = Sampler(m.decoder, m.tokenizer, fast=False, fast_top_p=False).generate(asked)
    for a, b in zip(fast, full, strict=True):
        assert [c.ids for c in a] == [c.ids for c in b]
        assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_a_group_prefills_its_prompt_once(models, monkeypatch):
    m = models("gemma3")
    shapes = []
    real = m.decoder.forward
    monkeypatch.setattr(
        m.decoder, "forward", lambda ids, **kw: shapes.append(ids.shape) or real(ids, **kw)
    )
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    [group] = s.generate([req(PROMPT, n=4, temperature=1.0, seed=3, max_new_tokens=3)])
    assert shapes[0] == (1, len(PROMPT))  # one prefill for the four answers
    assert all(shape == (4, 1) for shape in shapes[1:])
    assert len({c.ids for c in group}) > 1


@pytest.mark.parametrize("name", ["gemma3", "llama3", "lfm2"])
def test_a_small_generation_batch_samples_what_the_default_samples(models, name, monkeypatch):
    """generation_batch = 3: left-padded prompts of 3 to 23 tokens prefilled three positions a
    pass, each pass reading the keys and values (or, lfm2, the convolution states) of the ones
    before, gemma3's window of 8 crossed; the answers are the default's, token for token."""
    m = models(name)
    long = PROMPT + list(range(20, 34))  # 23 tokens
    asked = [
        req(long, n=2, temperature=1.0, seed=4),
        req(SHORT, temperature=0.8, top_p=0.9, seed=9),
        req(PROMPT, temperature=0),
    ]
    default = Sampler(m.decoder, m.tokenizer, fast=False).generate(asked)
    shapes = []
    real = m.decoder.forward
    monkeypatch.setattr(
        m.decoder, "forward", lambda ids, **kw: shapes.append(tuple(ids.shape)) or real(ids, **kw)
    )
    small = Sampler(m.decoder, m.tokenizer, fast=False, generation_batch=3).generate(asked)
    assert shapes[:8] == [(3, 3)] * 7 + [(3, 2)]  # the three prompts, 23 positions
    for a, b in zip(default, small, strict=True):
        assert [c.ids for c in a] == [c.ids for c in b]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4
            )


def test_stops_end_of_generation_ids_and_strings(models):
    m = models("llama")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    [[free]] = s.generate([req(PROMPT, temperature=0)])
    stop_tok = free.ids[3]
    [[by_id]] = s.generate([req(PROMPT, temperature=0, stop_ids=frozenset({stop_tok}))])
    first = free.ids.index(stop_tok)
    assert by_id.ids == free.ids[: first + 1] and by_id.finish_reason == FINISH_STOP
    assert by_id.stopped_by == stop_tok
    piece = free.text[3:5]
    [[by_text]] = s.generate([req(PROMPT, temperature=0, stop=(piece,))])
    assert by_text.finish_reason == FINISH_STOP and by_text.stopped_by == piece
    assert by_text.text == free.text[: free.text.index(piece)]
    assert len(by_text.ids) < len(free.ids)


def test_streamed_text_equals_the_answer(models):
    m = models("llama")
    s = Sampler(m.decoder, m.tokenizer, fast=False)
    got: dict[int, str] = {}
    out = s.generate(
        [req(PROMPT, n=2, temperature=1.0, seed=9, stop=("zz",)), req(SHORT, temperature=0)],
        on_text=lambda i, d: got.__setitem__(i, got.get(i, "") + d),
    )
    answers = [c for group in out for c in group]
    assert [got.get(i, "") for i in range(3)] == [c.text for c in answers]


def test_context_limit_ends_with_length(models):
    m = models("llama")
    s = Sampler(m.decoder, m.tokenizer, fast=False, max_len=len(PROMPT) + 4)
    [[c]] = s.generate([req(PROMPT, temperature=0, max_new_tokens=100)])
    assert len(c.ids) == 4 and c.finish_reason == FINISH_LENGTH
    with pytest.raises(ValueError, match="no room"):
        Sampler(m.decoder, m.tokenizer, max_len=len(PROMPT)).generate([req(PROMPT)])


def test_per_sequence_positions_leave_unpadded_logits_unchanged(models):
    m = models("gemma3")
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    ref = m.decoder(ids)
    pos = torch.arange(len(PROMPT)).expand(2, -1)
    assert torch.equal(m.decoder(ids, positions=pos), ref)
