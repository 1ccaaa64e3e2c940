"""nesting.py: the depth of JSON and TOML found without recursion, equal to the depth of what
json and tomllib parse, strings and comments stepped over; a too deep document is refused
before any parser recurses into it."""

from __future__ import annotations

import json
import random
import tomllib

import pytest

from retrograd import nesting
from retrograd.nesting import MAX_DEPTH, TooDeep


def depth(value) -> int:
    """The oracle: nesting of a parsed value, recursively (only small values come here)."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


NASTY = ['"', "\\", "[", "]", "{", "}", "\\[", '\\"', "#", "'", "\n", "é", "\u2028", " "]


def random_value(rng: random.Random, room: int):
    kind = rng.random()
    if room == 0 or kind < 0.3:
        return rng.choice([1, 2.5, None, True, "".join(rng.choices(NASTY, k=rng.randint(0, 6)))])
    if kind < 0.65:
        return [random_value(rng, room - 1) for _ in range(rng.randint(0, 3))]
    keys = ["".join(rng.choices(NASTY, k=rng.randint(0, 4))) for _ in range(rng.randint(0, 3))]
    return {k: random_value(rng, room - 1) for k in keys}


def test_the_depth_of_random_documents_is_what_the_parser_builds():
    rng = random.Random(7)
    for _ in range(400):
        value = random_value(rng, rng.randint(0, 9))
        d = depth(value)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            nesting.check_json(text, d)  # exactly the limit: accepted
            assert nesting.loads(text, d) == value
            if d:
                with pytest.raises(TooDeep):
                    nesting.check_json(text, d - 1)
            nesting.check_value(value, d)
            if d:
                with pytest.raises(TooDeep):
                    nesting.check_value(value, d - 1)


@pytest.mark.parametrize(
    ("text", "deepest"),
    [
        ('"[[[["', 0),  # brackets inside strings never count
        ('["\\"[[[[", 1]', 1),  # an escaped quote does not end the string
        ('["\\\\", [[1]]]', 3),  # an escaped backslash does: the brackets after it count
        ('{"a[": {"b]": ["}"]}}', 3),
        ("[" + "[]" * 100 + "]", 2),  # many arrays side by side are not deep
        ('["unterminated [[[[[[', 1),  # the parser fails at the string: its brackets cannot nest
    ],
)
def test_strings_are_stepped_over(text, deepest):
    nesting.check_json(text, deepest)
    if deepest:
        with pytest.raises(TooDeep):
            nesting.check_json(text, deepest - 1)


def test_a_hundred_thousand_deep_is_refused_before_the_parser_recurses():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)  # what happens without the check
    with pytest.raises(TooDeep) as caught:
        nesting.loads(deep)
    assert caught.value.pos == MAX_DEPTH  # the bracket that opens level 65
    assert (
        str(caught.value) == f"nested more than {MAX_DEPTH} levels deep: line 1 column 65 (char 64)"
    )
    assert isinstance(caught.value, json.JSONDecodeError)  # readers of bad JSON name it too
    assert nesting.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32"])
def test_bytes_are_read_in_the_encoding_json_detects(encoding):
    # a UTF-16 body hides its brackets from a scan of bytes: `\` and `"` are two bytes there
    text = '["\\"' + "x" * 3 + '", ' + "[" * 70 + "]" * 71
    with pytest.raises(TooDeep):
        nesting.loads(text.encode(encoding))
    assert nesting.loads('{"a": ["é"]}'.encode(encoding)) == {"a": ["é"]}


def test_raw_decode_checks_only_the_value_at_its_position():
    text = 'call: {"name": "f", "arguments": {"x": [1]}} and then ' + "[" * 100
    value, end = nesting.raw_decode(text, 6)
    assert value == {"name": "f", "arguments": {"x": [1]}} and text[end:].startswith(" and")
    deep = "say " + "[" * 5000 + "]" * 5000
    with pytest.raises(TooDeep) as caught:
        nesting.raw_decode(deep, 4)
    assert caught.value.pos == 4 + MAX_DEPTH
    assert nesting.raw_decode('"[[[[" then', 0) == ("[[[[", 6)


@pytest.mark.parametrize(
    ("text", "deepest"),
    [
        ('a = "[[[["\nb = 1', 0),
        ("a = '[[[[' # [[[[\nb = [1]", 1),
        ('a = """\n[[[[\n"\n""[[\n"""\nb = [[1]]', 2),
        ('a = """ends with two quotes"""""\nb = [1]', 1),
        ("a = '''\n[[[['\n'''\nb = {c = [1]}", 2),
        ('a = "\\"[[[["\nb = [1]', 1),
        ("[table] # [[[[\nx = 1", 1),  # a table header's brackets count as one level
        ("[[array]]\nx = [[1]]", 2),
    ],
)
def test_toml_strings_and_comments_are_stepped_over(text, deepest):
    tomllib.loads(text)  # each is a valid document
    nesting.check_toml(text, deepest)
    if deepest:
        with pytest.raises(TooDeep):
            nesting.check_toml(text, deepest - 1)


def test_deep_toml_is_refused_before_tomllib_recurses():
    text = "x = 1\na = " + "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):
        tomllib.loads(text)
    with pytest.raises(TooDeep) as caught:
        nesting.check_toml(text)
    assert (caught.value.lineno, caught.value.colno) == (2, 4 + MAX_DEPTH + 1)
    inline = "a = " + "{b = " * 100 + "1" + "}" * 100
    with pytest.raises(TooDeep):
        nesting.check_toml(inline)


def test_dotted_keys_nest_without_brackets_and_check_value_finds_them():
    text = "a" + ".a" * 100 + " = 1"
    nesting.check_toml(text)  # no bracket at all
    with pytest.raises(TooDeep) as caught:
        nesting.check_value(tomllib.loads(text))
    assert str(caught.value) == f"nested more than {MAX_DEPTH} levels deep"  # no line to name
    nesting.check_value({"a": ({"b": 1},)}, 3)  # tuples are walked too
    with pytest.raises(TooDeep):
        nesting.check_value({"a": ({"b": [1]},)}, 3)


def test_an_integer_of_more_digits_than_python_converts_is_malformed_json():
    # the parser raises a plain ValueError for it, which readers that name malformed JSON
    # (JSONDecodeError) let through: a 500 on the server, an exec tool's reply out of a run
    huge = "7" * 5000
    with pytest.raises(ValueError) as plain:
        json.loads("[" + huge + "]")
    assert not isinstance(plain.value, json.JSONDecodeError)  # what happens without loads
    text = '{"a": [1, ' + huge + "]}"
    with pytest.raises(json.JSONDecodeError) as caught:
        nesting.loads(text)
    assert "4300 digits" in str(caught.value) and caught.value.pos == text.index(huge)
    with pytest.raises(json.JSONDecodeError) as caught:
        nesting.raw_decode("x " + text + " y", 2)
    assert caught.value.pos == 2 + text.index(huge)
    assert nesting.loads("[" + "7" * 4300 + "]") == [int("7" * 4300)]  # the limit itself reads
