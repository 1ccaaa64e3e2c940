"""JSON-schema grammars: what they accept and refuse, checked against `json` and `jsonschema`."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from retrograd.rewards.ruler.prompt import LISTWISE_SCHEMA, PAIRWISE_SCHEMA
from retrograd.sampling.grammar import Grammar, SchemaError, json_schema_grammar

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5},
        "tags": {"type": "array", "items": {"enum": ["x", "y", 3, None]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "n": {"type": "integer"},
        "child": {"$ref": "#/$defs/node"},
        "either": {"anyOf": [{"type": "null"}, {"type": "number"}]},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"const": "leaf"}, "next": {"$ref": "#/$defs/node"}},
            "required": ["v"],
        }
    },
}


def accepts(g: Grammar, text: str) -> bool:
    return Grammar.accepts(g.feed(g.start, text.encode()))


@pytest.mark.parametrize(
    "doc",
    [
        {"scores": []},
        {"scores": [{"trajectory_id": 0, "explanation": "fine", "score": 1}]},
        {"scores": [{"trajectory_id": 12, "explanation": 'a "quote" é\n', "score": 0.25}]},
        {
            "scores": [
                {"trajectory_id": 1, "explanation": "", "score": 0},
                {"trajectory_id": 2, "explanation": "\\", "score": 1.0},
            ]
        },
    ],
)
@pytest.mark.parametrize("indent", [None, 0, 2, "\t"])
def test_listwise_replies_are_accepted(doc, indent):
    g = json_schema_grammar(LISTWISE_SCHEMA)
    assert accepts(g, json.dumps(doc, indent=indent, ensure_ascii=False))
    assert accepts(g, json.dumps(doc, separators=(",", ":")))


@pytest.mark.parametrize(
    "text",
    [
        '{"scores": [{"trajectory_id": 0, "score": 1, "explanation": "x"}]}',  # order
        '{"scores": [{"trajectory_id": 0, "explanation": "x"}]}',  # missing
        '{"scores": [{"trajectory_id": -1, "explanation": "x", "score": 1}]}',  # minimum 0
        '{"scores": [{"trajectory_id": 0, "explanation": "x", "score": 1.5}]}',  # maximum 1
        '{"scores": [{"trajectory_id": 0, "explanation": "x", "score": 2}]}',
        '{"scores": [{"trajectory_id": 0.5, "explanation": "x", "score": 1}]}',  # integer
        '{"scores": [], "extra": 1}',  # additionalProperties false
        '{"scores": [{"trajectory_id": 0, "explanation": "a\nb", "score": 1}]}',  # raw newline
        '{"scores": [{"trajectory_id": 01, "explanation": "x", "score": 1}]}',  # leading zero
        '{"scores": []} ',  # nothing after the value
        ' {"scores": []}',  # nor before
        '{"scores":' + " " * 30 + "[]}",  # unbounded whitespace
    ],
)
def test_listwise_violations_are_refused(text):
    assert not accepts(json_schema_grammar(LISTWISE_SCHEMA), text)


def test_pairwise_enum_and_nested_schema():
    g = json_schema_grammar(PAIRWISE_SCHEMA)
    assert accepts(g, '{"winner": "tie", "explanation": "same"}')
    assert not accepts(g, '{"winner": "c", "explanation": "same"}')
    g = json_schema_grammar(NESTED)
    good = {
        "name": "ab",
        "ok": True,
        "tags": ["x", 3, None],
        "n": -7,
        "child": {"v": "leaf", "next": {"v": "leaf"}},
        "either": -1.5e10,
    }
    assert accepts(g, json.dumps(good))
    assert accepts(g, json.dumps({"name": "a", "ok": False}))
    assert accepts(g, json.dumps({"name": "a", "ok": False, "either": None}))
    for bad in (
        {"name": "", "ok": True},  # minLength
        {"name": "abcdef", "ok": True},  # maxLength
        {"name": "a", "ok": True, "tags": ["x", "x", "x", "x"]},  # maxItems
        {"name": "a", "ok": True, "child": {"v": "other"}},  # const
        {"name": "a"},  # required
    ):
        assert not accepts(g, json.dumps(bad)), bad


def test_json_object_admits_any_object():
    g = json_schema_grammar(None)
    rng = random.Random(0)
    for _ in range(50):
        doc = {f"k{i}": _random_value(rng, 3) for i in range(rng.randint(0, 4))}
        assert accepts(g, json.dumps(doc, ensure_ascii=False)), doc
    assert not accepts(g, "[1, 2]")
    assert not accepts(g, '"text"')


def _random_value(rng: random.Random, depth: int):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return round(rng.uniform(-100, 100), 4)
    if kind == "str":
        return "".join(rng.choice('ab "\\\né/\t') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth - 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("schema", [LISTWISE_SCHEMA, PAIRWISE_SCHEMA, NESTED, None])
def test_random_walks_give_valid_documents(schema):
    """Walk the grammar byte by byte at random (closing brackets and quotes preferred once the
    text is long) to its end: every document it finishes parses and validates."""
    g = json_schema_grammar(schema)
    rng = random.Random(1)
    finished = 0
    for _ in range(60):
        state, out = g.start, bytearray()
        while not Grammar.done(state) and len(out) < 600:
            allowed = sorted(g.next_bytes(state))
            if Grammar.accepts(state) and rng.random() < 0.5:
                break
            closing = [b for b in allowed if b in b'}]"']
            pick = rng.choice(closing if closing and len(out) > 80 else allowed)
            state = g.step(state, pick)
            out.append(pick)
        if not Grammar.accepts(state):
            continue
        finished += 1
        doc = json.loads(out.decode("utf-8", "replace"))
        jsonschema.validate(doc, schema or {"type": "object"})
    assert finished >= 20


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"type": "string", "pattern": "a+"}, "schema.pattern"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "schema.properties.a.not"),
        ({"$ref": "#/$defs/missing"}, "schema.$ref"),
        ({"$ref": "http://example.com/s.json"}, "schema.$ref"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "schema.required"),
        ({"type": "strin"}, "schema.type"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "schema.maxItems"),
        ({"allOf": [{}, {}]}, "schema.allOf"),
    ],
)
def test_unsupported_schemas_are_refused_by_place(schema, where):
    with pytest.raises(SchemaError, match=f"^{where.replace('$', '[$]')}"):
        json_schema_grammar(schema)


def test_states_are_shared_inside_strings():
    """A string's characters loop on one state: memoized steps, and a plain-loop state."""
    from retrograd.sampling.grammar import STRING_BYTE

    g = json_schema_grammar(PAIRWISE_SCHEMA)
    state = g.feed(g.start, b'{"winner": "a", "explanation": "')
    assert g.plain_loop(state, STRING_BYTE)
    assert g.feed(state, "some text, é!".encode()) == state
    assert not g.plain_loop(g.start, STRING_BYTE)
    assert Grammar.done(g.feed(state, b'"}'))


def test_prefix_items_fix_each_position():
    schema = {
        "type": "array",
        "prefixItems": [{"const": 1}, {"type": "string"}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    }
    g = json_schema_grammar(schema)
    for doc in ([1, "a"], [1, "a", True]):
        assert accepts(g, json.dumps(doc))
    for doc in ([], [1], [2, "a"], [1, "a", True, 4], [1, 2]):
        assert not accepts(g, json.dumps(doc)), doc
    more = json_schema_grammar({"prefixItems": [{"const": 0}], "items": {"type": "null"}})
    assert accepts(more, "[]") and accepts(more, "[0, null, null]")
    assert not accepts(more, "[null]")
    with pytest.raises(SchemaError, match="minItems"):
        json_schema_grammar({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2})


def test_the_judges_guided_schemas_admit_only_parseable_replies():
    """Under the grammar of `guided_listwise_schema`, every reply a random walk finishes
    validates and is one `parse_listwise` takes for exactly those ids."""
    from retrograd.rewards.ruler.prompt import (
        guided_listwise_schema,
        guided_pairwise_schema,
        parse_listwise,
        parse_pairwise,
    )

    ids = [3, 0, 2]
    schema = guided_listwise_schema(ids)
    g = json_schema_grammar(schema)
    rng = random.Random(2)
    finished = 0
    for _ in range(30):
        state, out = g.start, bytearray()
        while not Grammar.done(state) and len(out) < 3000:
            allowed = sorted(g.next_bytes(state))
            closing = [b for b in allowed if b in b'}]"']
            pick = rng.choice(closing if closing and rng.random() < 0.1 else allowed)
            state = g.step(state, pick)
            out.append(pick)
        if Grammar.done(state):
            finished += 1
            doc = json.loads(out.decode("utf-8", "replace"))
            jsonschema.validate(doc, schema)
            assert [s["trajectory_id"] for s in doc["scores"]] == ids
            assert set(parse_listwise(doc, ids)) == set(ids)
    assert finished >= 10
    good = {"scores": [{"trajectory_id": i, "explanation": "x", "score": 0.5} for i in ids]}
    assert accepts(g, json.dumps(good))
    good["scores"].reverse()
    assert not accepts(g, json.dumps(good))  # the order shown
    pair = json_schema_grammar(guided_pairwise_schema())
    assert parse_pairwise(json.loads('{"winner": "b", "explanation": ""}')) == "b"
    assert accepts(pair, '{"winner": "b", "explanation": "' + "x" * 240 + '"}')
    assert not accepts(pair, '{"winner": "b", "explanation": "' + "x" * 241 + '"}')


def _chain(k: int) -> dict:
    """d_k is d_{k-1} or d_{k-1}: 2^k ways down to one string, each the same stack."""
    defs = {"d0": {"type": "string"}}
    for i in range(1, k + 1):
        defs[f"d{i}"] = {"anyOf": [{"$ref": f"#/$defs/d{i - 1}"}] * 2}
    return {"$defs": defs, "$ref": f"#/$defs/d{k}"}


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"},
        {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
            "$ref": "#/$defs/a",
        },
    ],
)
def test_a_schema_that_refers_to_itself_before_any_text_is_refused(schema):
    """Left recursion: expanding it never ends (it was a RecursionError in the server's
    generation thread, which then answered nobody again). llama.cpp refuses it too."""
    with pytest.raises(SchemaError, match=r"^schema: #/\$defs/\w refers to itself before any text"):
        json_schema_grammar(schema)


def test_recursion_after_text_and_many_ways_to_one_stack_stay_cheap():
    """A tree refers to itself inside brackets (fine); a chain of 60 two-way choices has 2^60
    paths to one stack and costs 60 (it took 7 s at 20 links, doubling with each)."""
    tree = {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/n",
    }
    g = json_schema_grammar(tree)
    assert Grammar.accepts(g.feed(g.start, b'{"v": 1, "kids": [{"v": 2, "kids": []}]}'))
    g = json_schema_grammar(_chain(60))
    assert len(g.start) == 1 and Grammar.accepts(g.feed(g.start, b'"x"'))
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)}}
    g = json_schema_grammar(many)  # 800 optional properties: a deep chain, no RecursionError
    assert Grammar.accepts(g.feed(g.start, b'{"p0": 1, "p799": 2}'))


def test_a_schema_that_compiles_past_the_rule_bound_is_refused():
    """1,000 strings of maxLength 4096 built 4 million rules: 11 s and a gigabyte a request."""
    big = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 4096} for i in range(1000)},
    }
    with pytest.raises(SchemaError, match=r"^schema: compiles to more than 131072 grammar rules"):
        json_schema_grammar(big)
