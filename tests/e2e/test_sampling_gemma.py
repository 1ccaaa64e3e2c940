"""The nucleus on Gemma 3 270M's own distributions: the default way (the top candidates, then
the tokens above a power of two) answers what sorting the whole 262k vocabulary answers."""

from __future__ import annotations

import pytest

import retrograd
from retrograd.sampling import Sampler, SampleRequest, SamplingParams, select

pytestmark = pytest.mark.slow

TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_nucleus_answers_equal_the_full_sort_on_gemma(gemma_path, monkeypatch, temperature):
    model = retrograd.load(gemma_path, device="cpu")
    ids = tuple(model.tokenizer.tokenize(TEXT, add_bos=True))
    params = SamplingParams(temperature, 0.95, 24, stop_ids=frozenset(), seed=7)
    asked = [SampleRequest(ids, params, n=4)]
    seen = {"candidates": 0, "above": 0}
    candidates, above = select.nucleus_from_candidates, select.nucleus_above

    def by_candidates(*a):
        out = candidates(*a)
        seen["candidates"] += int(out[1].sum())
        return out

    def by_above(*a):
        token = above(*a)
        seen["above"] += token is not None
        return token

    monkeypatch.setattr(select, "nucleus_from_candidates", by_candidates)
    monkeypatch.setattr(select, "nucleus_above", by_above)
    [default] = Sampler(model.decoder, model.tokenizer).generate(asked)
    [full] = Sampler(model.decoder, model.tokenizer, fast_top_p=False).generate(asked)
    assert [c.ids for c in default] == [c.ids for c in full]
    assert [c.logprobs for c in default] == [c.logprobs for c in full]
    assert len({c.ids for c in default}) == 4  # sampled: four answers, four paths
    assert seen["candidates"] > 0
    if temperature == 1.0:  # nuclei of hundreds of tokens and more
        assert seen["above"] > 0
