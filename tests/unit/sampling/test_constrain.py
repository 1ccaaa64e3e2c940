"""Constrained decoding on a tiny model: the allowed ids equal a walk over the whole vocabulary,
greedy answers take the best allowed token, every finished answer validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from retrograd.rewards.ruler.prompt import LISTWISE_SCHEMA, PAIRWISE_SCHEMA
from retrograd.sampling import FINISH_STOP, Sampler, SampleRequest, SamplingParams
from retrograd.sampling.constrain import Constraint, TokenTable
from retrograd.sampling.grammar import Grammar, json_schema_grammar

PROMPT = [1, 300, 301, 17, 260, 400, 401, 402, 5]
CLOSED = {  # no free text: every answer ends within a bounded number of tokens
    "type": "object",
    "properties": {
        "winner": {"enum": ["a", "b", "tie"]},
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["winner", "n", "ok", "score"],
    "additionalProperties": False,
}


def brute_force(c: Constraint, stop_ids: frozenset[int]) -> np.ndarray:
    return np.array([c.allows(i, stop_ids) for i in range(len(c.table.pieces))])


@pytest.mark.parametrize(
    "schema, prefix",
    [
        (LISTWISE_SCHEMA, b""),
        (LISTWISE_SCHEMA, b"{"),
        (LISTWISE_SCHEMA, b'{ "scores"'),
        (LISTWISE_SCHEMA, b'{"scores": [{"trajectory_id": 1'),
        (LISTWISE_SCHEMA, b'{"scores": [{"trajectory_id": 0, "explanation": "ab'),
        (LISTWISE_SCHEMA, b'{"scores": [{"trajectory_id": 0, "explanation": "ab\\'),
        (LISTWISE_SCHEMA, b'{"scores": [{"trajectory_id": 0, "explanation": "", "score": 0.'),
        (LISTWISE_SCHEMA, b'{"scores": []\n'),
        (CLOSED, b'{"winner": "tie", "n": 12'),
        (None, b'{"a": [1, {"b": nul'),
        (None, b'{"a": 1.5e'),
    ],
)
def test_mask_equals_a_walk_over_the_vocabulary(models, schema, prefix):
    m = models("gemma3")
    table = TokenTable(m.tokenizer)
    c = Constraint(json_schema_grammar(schema), table)
    c.state = c.grammar.feed(c.state, prefix)
    assert c.state, prefix
    stop = frozenset(m.tokenizer.eot_ids)
    mask = c.mask(stop)
    np.testing.assert_array_equal(mask, brute_force(c, stop))
    assert mask.any()


def generate(m, schema, n=1, **kw):
    kw.setdefault("max_new_tokens", 200)
    params = SamplingParams(grammar=json_schema_grammar(schema), **kw)
    return Sampler(m.decoder, m.tokenizer, fast=False).generate(
        [SampleRequest(tuple(PROMPT), params, n=n)]
    )[0]


@pytest.mark.parametrize("name", ["gemma3", "llama3"])
def test_greedy_takes_the_most_likely_allowed_token(models, name):
    """Each step's token is the argmax of a full recomputation's logits over the ids a walk of
    the vocabulary allows; the answer ends when the object closes and validates."""
    m = models(name)
    [answer] = generate(m, CLOSED, temperature=0)
    assert answer.finish_reason == FINISH_STOP and answer.stopped_by is None
    jsonschema.validate(json.loads(answer.text), CLOSED)
    logits = m.logits(PROMPT + list(answer.ids))[len(PROMPT) - 1 : -1].numpy()
    c = Constraint(json_schema_grammar(CLOSED), TokenTable(m.tokenizer))
    stop = frozenset(m.tokenizer.eot_ids)
    for step, tok in enumerate(answer.ids):
        allowed = brute_force(c, stop)
        best = int(np.argmax(np.where(allowed, logits[step][: allowed.size], -np.inf)))
        assert tok == best, step
        c.push(tok)
    assert Grammar.done(c.state)


def test_sampled_answers_follow_the_schema(models):
    """Sampled at temperature 1 with a bounded string (a random model would fill a free one
    to the end of its budget): every answer closes and validates."""
    m = models("gemma3")
    schema = json.loads(json.dumps(PAIRWISE_SCHEMA))
    schema["properties"]["explanation"]["maxLength"] = 12
    answers = generate(m, schema, n=6, temperature=1.0, seed=3, max_new_tokens=400)
    for a in answers:
        assert a.finish_reason == FINISH_STOP
        jsonschema.validate(json.loads(a.text), schema)
    assert len({a.text for a in answers}) > 1  # the seeds differ
    # a free string: the answers that run out of tokens are still prefixes the grammar allows
    for a in generate(m, PAIRWISE_SCHEMA, n=3, temperature=1.0, seed=4, max_new_tokens=60):
        c = Constraint(json_schema_grammar(PAIRWISE_SCHEMA), TokenTable(m.tokenizer))
        for tok in a.ids:
            assert c.allows(tok, frozenset(m.tokenizer.eot_ids))
            c.push(tok)


def test_a_constrained_row_leaves_its_batch_mates_alone(models):
    m = models("gemma3")
    sampler = Sampler(m.decoder, m.tokenizer, fast=False)
    free = SampleRequest(
        tuple(PROMPT),
        SamplingParams(temperature=1.0, seed=9, max_new_tokens=20, stop_ids=frozenset()),
    )
    held = SampleRequest(
        tuple(PROMPT[:5]), SamplingParams(temperature=0, grammar=json_schema_grammar(CLOSED))
    )
    [[alone]] = sampler.generate([free])
    [[together], [constrained]] = sampler.generate([free, held])
    assert together.ids == alone.ids
    jsonschema.validate(json.loads(constrained.text), CLOSED)
